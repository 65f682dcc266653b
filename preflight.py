"""What a run needs from the disk before it starts: the --out lock, the model's files, and
the outputs it will write.

    refuse_locked_out(sys.argv[1:])                  # before the heavy imports: a second run on --out
    problems = config_problems(model_dir)            # config.json there and parsing (flag_checks.py asks)
    problems = run_problems(model_dir, out)          # weights, tokenizer, --out writable, room to save

Each check is cheap (headers and metadata only, no tensor is read) and names the file and
what was expected, so that a broken download or a full disk is one line before any process
group, not a traceback on every rank after the model is built. Imports the standard
library only, so that train_grpo.py can ask before it imports torch.
"""

import fcntl
import glob
import json
import math
import os
import shutil
import sys

DEFAULT_OUT = "runs/grpo"
LOCK_FILE = ".lock"
SAFETENSORS_INDEX = "model.safetensors.index.json"
# Any of these makes a tokenizer transformers can load (a fast one, SentencePiece, BPE files).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
# What the run writes into --out and may replace: a file or folder there it cannot write
# stops it late (metrics.jsonl at the first step, final/ at the end).
OUTPUT_NAMES = ("metrics.jsonl", "curves.png", "acceptance_vs_entropy.png", "checkpoints", "final", "tensorboard",
                "rollout-model", LOCK_FILE)
# The least a checkpoint and final/ take per parameter: Adam's two fp32 moments (8 bytes)
# and the weights (at least bf16, 2) in a checkpoint, the weights again in final/ (2).
MIN_BYTES_PER_PARAMETER = 12


# ---------------------------------------------------------------------------------------
# The --out lock, before the heavy imports
# ---------------------------------------------------------------------------------------

def out_holder(out):
    """What OUT/.lock says of the live run holding it ("pid 12 on host, started ...: the
    command"), or None when no live run holds it. The holder's flock is exclusive: a shared
    one that cannot be had means it is held."""
    try:
        with open(os.path.join(out, LOCK_FILE)) as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return lock.read().strip() or "a process that wrote nothing yet"
    except (FileNotFoundError, NotADirectoryError):
        pass
    return None


def locked_out_message(out, holder):
    """The refusal of a second run on `out`, held by `holder` (`out_holder`)."""
    return f"--out {out} is in use by another run ({holder}); wait for it to end or pass another --out"


def out_flag(argv):
    """--out as `argv` gives it (argparse's forms: `--out X`, `--out=X`), else DEFAULT_OUT."""
    out = DEFAULT_OUT
    for index, word in enumerate(argv):
        if word == "--out" and index + 1 < len(argv):
            out = argv[index + 1]
        elif word.startswith("--out="):
            out = word.split("=", 1)[1]
    return out


def refuse_locked_out(argv):
    """Exit (status 1) with one line when another live run holds --out's lock: said by rank 0
    before it imports torch, megatron-core or vLLM (seconds under load). The other ranks
    are stopped by torchrun as rank 0 exits; checkpoint.lock_out holds the lock for the run."""
    holder = out_holder(out_flag(argv))
    if holder is not None and os.environ.get("RANK", "0") == "0":
        print(f"train_grpo.py: {locked_out_message(out_flag(argv), holder)}", file=sys.stderr, flush=True)
        sys.exit(1)


# ---------------------------------------------------------------------------------------
# The model's files
# ---------------------------------------------------------------------------------------

def json_problem(path, what):
    """Why `path` is not a JSON object (`what` it should hold), or None."""
    try:
        with open(path, "rb") as f:
            value = json.load(f)
    except OSError as error:
        return f"{path} cannot be read ({error.strerror}); expected {what}"
    except ValueError as error:
        return f"{path} is not JSON ({error}); expected {what}, whole (a truncated download?)"
    return None if isinstance(value, dict) else f"{path} holds a {type(value).__name__}; expected {what}"


def read_header(path):
    """(a safetensors file's JSON header as a dict, its length in bytes), or None where the
    file has no readable header (too short, not JSON)."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        length = int.from_bytes(f.read(8), "little") if size >= 8 else None
        try:
            header = json.loads(f.read(length)) if length is not None and 8 + length <= size else None
        except ValueError:
            header = None
    return (header, length) if isinstance(header, dict) else None


def tensors(header):
    """The tensor entries of a safetensors header ({dtype, shape, data_offsets} each)."""
    return [entry for name, entry in header.items() if name != "__metadata__"]


def safetensors_problem(path):
    """Why `path` is not a whole safetensors file, or None: its 8-byte header length, its JSON
    header, and the bytes the header's tensors end at, against the file's size."""
    if not os.path.isfile(path):
        return f"{path} is missing; expected the weights file the index names"
    size, read = os.path.getsize(path), read_header(path)
    if read is None:
        return f"{path} ({size} bytes) has no readable safetensors header; expected a whole .safetensors file"
    header, length = read
    end = 8 + length + max((entry["data_offsets"][1] for entry in tensors(header)), default=0)
    if end > size:
        return f"{path} is {size} bytes, its header's tensors end at byte {end}; expected the whole file " \
               "(a truncated download?)"
    return None


def weights_files(model_dir):
    """The weights files of a checkpoint directory: those model.safetensors.index.json names
    (None where the index does not parse), or without an index every *.safetensors."""
    index = os.path.join(model_dir, SAFETENSORS_INDEX)
    if not os.path.exists(index):
        return sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if json_problem(index, "a safetensors index"):
        return None
    with open(index) as f:
        return [os.path.join(model_dir, name) for name in sorted(set(json.load(f).get("weight_map", {}).values()))]


def weights_problems(model_dir):
    """[why] the weights are not all there: every file model.safetensors.index.json names,
    or without an index every *.safetensors of the folder (at least one)."""
    paths = weights_files(model_dir)
    if paths is None:
        return [json_problem(os.path.join(model_dir, SAFETENSORS_INDEX), "a safetensors index (its weight_map)")]
    if not paths:
        return [f"--model {model_dir}: no weights there; expected model.safetensors (or {SAFETENSORS_INDEX} and "
                "the files it names)"]
    return [problem for problem in map(safetensors_problem, paths) if problem]


def parameter_count(model_dir):
    """How many numbers the model's weights hold, from their headers (whole files: `weights_problems`)."""
    return sum(math.prod(entry["shape"]) for path in weights_files(model_dir)
               for entry in tensors(read_header(path)[0]))


def config_problems(model_dir):
    """[one line] when `model_dir` holds no config.json, or one that does not parse: asked
    before any of its fields is (flag_checks.py)."""
    config = os.path.join(model_dir, "config.json")
    if not os.path.isfile(config):
        return [f"--model {model_dir!r}: no config.json there; expected a Hugging Face checkpoint dir"]
    problem = json_problem(config, "the model's config (a JSON object)")
    return [problem] if problem else []


def model_files_problems(model_dir):
    """[one line per problem] with a Hugging Face checkpoint directory's other files: the
    weights are whole (`weights_problems`), the tokenizer's files are there and its JSON ones
    parse. Headers only: no tensor is read."""
    problems = weights_problems(model_dir)
    if not any(os.path.exists(os.path.join(model_dir, name)) for name in TOKENIZER_FILES):
        problems.append(f"--model {model_dir}: no tokenizer there; expected {' or '.join(TOKENIZER_FILES)}")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if os.path.exists(os.path.join(model_dir, name)):
            problems.append(json_problem(os.path.join(model_dir, name), "the tokenizer's settings (a JSON object)"))
    return [problem for problem in problems if problem]


# ---------------------------------------------------------------------------------------
# The outputs
# ---------------------------------------------------------------------------------------

def output_problems(out, parameters=0):
    """[one line per entry] of `out` (the folder itself, and what the run writes or replaces
    in it: OUTPUT_NAMES) that exists but this process cannot write: an immutable or
    read-only metrics.jsonl or final/ stopped a run at its first step or its end; and one
    when the disk under `out` has less free space than a model of `parameters` numbers
    needs for a checkpoint and final/ (at least MIN_BYTES_PER_PARAMETER each); one when a
    folder above `out` is a file."""
    paths = [out] + [os.path.join(out, name) for name in OUTPUT_NAMES]
    problems = [f"--out {out}: {path} is not writable by this run (read-only or immutable); expected a "
                f"{'folder' if os.path.isdir(path) else 'file'} it can replace: change its permissions or pass "
                "another --out" for path in paths if os.path.exists(path) and not os.access(path, os.W_OK)]
    existing = os.path.abspath(out)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if existing != os.path.abspath(out) and not os.path.isdir(existing):
        return [f"--out {out}: {existing} is a file; expected folders above --out (the run makes the missing ones)"]
    free, needed = shutil.disk_usage(existing).free, parameters * MIN_BYTES_PER_PARAMETER
    if free < needed:
        problems.append(f"--out {out}: {free} bytes are free on its disk ({existing}); a checkpoint and final/ of "
                        f"this model's {parameters} parameters need at least {needed}: free some space or pass "
                        "another --out")
    return problems


def run_problems(model_dir, out):
    """[one line per problem] before a run: `model_dir`'s files (None: the built-in model,
    written by the run), then, once they hold, `out`'s (`output_problems`)."""
    problems = model_files_problems(model_dir) if model_dir else []
    return problems or output_problems(out, parameter_count(model_dir) if model_dir else 0)
