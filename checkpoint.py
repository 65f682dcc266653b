"""Checkpoints that a killed run cannot corrupt, and the choice of the one to resume from.

    layout = {"world_size": 2, "tp": 1, "cp": 1, "model": "..."}   # what must match to resume
    directory = choose_checkpoint(out, "auto", layout)             # None: start fresh
    state = load_rank_state(directory, rank) if directory else None
    ...
    save_checkpoint(out, step, {"model": ..., "optimizer": ...}, layout, keep=2, rank=rank)

On disk: OUT/checkpoints/step_000050/{rank0.pt, rank1.pt, ..., meta.json}. Every rank
writes its shard into step_N.partial/, each file flushed to disk; rank 0 then writes
meta.json (the layout, the step, each file's size) and renames the directory to step_N:
a checkpoint directory either is complete or does not exist, and one whose files do not
match their recorded sizes (a disk that lost writes) is skipped with a warning. `out`
must be storage every node sees. Refusals are `CheckpointError` (a ValueError) naming
the directory and what differs. Imports torch and the standard library.
"""

import json
import os
import re
import shutil
import signal
import sys

import torch
import torch.distributed as dist

CHECKPOINTS_DIR = "checkpoints"
CHECKPOINT_META = "meta.json"
# Set by the fault-tolerance tests: "PHASE:STEP" makes the last rank SIGKILL itself there,
# on torchrun's first attempt only (PHASE: sync, before the step's weight push; save,
# after writing its file, before the checkpoint is published).
KILL_AT_ENV = "TRAIN_GRPO_KILL_AT"


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed; the message names it and why."""


def fault_point(phase, step):
    """The fault-tolerance tests' SIGKILL, where KILL_AT_ENV names (phase, step)."""
    if os.environ.get(KILL_AT_ENV) == f"{phase}:{step}" and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0" \
            and dist.get_rank() == dist.get_world_size() - 1:
        os.kill(os.getpid(), signal.SIGKILL)


def write_synced(path, write):
    """Write a file through `write(f)`, flushed to disk, under a temporary name renamed at the end."""
    with open(path + ".tmp", "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)


def save_checkpoint(out, step, state, layout, keep, rank):
    """Every rank writes `state` (its shard: any torch.save-able dict) into step_N.partial/;
    rank 0 publishes step_N with meta.json (`layout`, the step, the file sizes) and keeps
    the newest `keep`. Collective: every rank calls it."""
    root = os.path.join(out, CHECKPOINTS_DIR)
    final = os.path.join(root, f"step_{step:06d}")
    staging = final + ".partial"
    if rank == 0:
        shutil.rmtree(staging, ignore_errors=True)
        os.makedirs(staging)
    dist.barrier()
    write_synced(os.path.join(staging, f"rank{rank}.pt"), lambda f: torch.save(state, f))
    fault_point("save", step)
    dist.barrier()
    if rank == 0:
        files = {name: os.path.getsize(os.path.join(staging, name)) for name in sorted(os.listdir(staging))}
        meta = dict(layout, step=step, files=files)
        write_synced(os.path.join(staging, CHECKPOINT_META), lambda f: f.write(json.dumps(meta, indent=1).encode()))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(staging, final)
        for old in checkpoint_dirs(root)[keep:]:
            shutil.rmtree(old)
    dist.barrier()


def checkpoint_dirs(root):
    """Published checkpoint directories under `root`, newest first."""
    if not os.path.isdir(root):
        return []
    names = [name for name in os.listdir(root) if re.fullmatch(r"step_\d+", name)]
    return [os.path.join(root, name) for name in sorted(names, reverse=True)]


def checkpoint_problem(directory):
    """Why `directory` is not a complete checkpoint (naming the file), or None."""
    meta_path = os.path.join(directory, CHECKPOINT_META)
    try:
        with open(meta_path) as f:
            meta = json.load(f)
    except (OSError, json.JSONDecodeError) as error:
        return f"{meta_path} cannot be read ({error})"
    for name, size in meta["files"].items():
        path = os.path.join(directory, name)
        actual = os.path.getsize(path) if os.path.exists(path) else None
        if actual != size:
            return f"{path} is {'missing' if actual is None else f'{actual} bytes'}, expected {size} bytes"
    return None


def resume_problems(out, resume):
    """Why `resume` ("auto", "never" or a directory) cannot be used with `out`: [messages]."""
    if resume == "never" and checkpoint_dirs(os.path.join(out, CHECKPOINTS_DIR)):
        return [f"--resume never: {os.path.join(out, CHECKPOINTS_DIR)} holds checkpoints of an earlier run; "
                "expected a fresh --out (or --resume auto to continue it)"]
    if resume not in ("auto", "never") and not os.path.isdir(resume):
        return [f"--resume {resume!r}: no such directory; expected auto, never or a checkpoint dir"]
    return []


def choose_checkpoint(out, resume, layout):
    """The checkpoint directory a run continues from, or None to start fresh.

    resume: "auto" (the newest complete checkpoint under OUT/checkpoints, if any), "never",
    or a directory (a checkpoint, or a checkpoints folder for its newest). A complete
    checkpoint of another `layout` is a CheckpointError; an incomplete one is skipped
    with a warning on stderr (from rank 0) naming the bad file.
    """
    if resume == "never":
        return None
    root = os.path.join(out, CHECKPOINTS_DIR) if resume == "auto" else resume
    candidates = [root] if os.path.isfile(os.path.join(root, CHECKPOINT_META)) else checkpoint_dirs(root)
    for directory in candidates:
        problem = checkpoint_problem(directory)
        if problem is not None:
            if int(os.environ.get("RANK", "0")) == 0:
                print(f"train_grpo.py: warning: checkpoint {directory} skipped: {problem}", file=sys.stderr, flush=True)
            continue
        with open(os.path.join(directory, CHECKPOINT_META)) as f:
            saved = json.load(f)
        different = {key: (saved[key], value) for key, value in layout.items() if saved[key] != value}
        if different:
            raise CheckpointError(f"--resume {resume}: {directory} was saved with " + ", ".join(
                f"{key} {was!r}" for key, (was, _) in different.items()) + "; this run has " + ", ".join(
                f"{key} {now!r}" for key, (_, now) in different.items()) + " (resume with the same layout, or "
                "pass --resume never and another --out)")
        return directory
    if resume != "auto":
        raise CheckpointError(f"--resume {resume!r}: no complete checkpoint there; expected a checkpoint dir "
                              f"(OUT/checkpoints/step_N) or a run's OUT/checkpoints")
    return None


def load_rank_state(directory, rank):
    """This rank's saved state dict (tensors on the host)."""
    return torch.load(os.path.join(directory, f"rank{rank}.pt"), weights_only=True)


def keep_records(metrics_path, last_step):
    """A JSONL metrics file cut back to the records of steps up to `last_step` (a resumed
    run logs the later ones again; a fresh one, 0, starts empty); returns those kept."""
    records = []
    if os.path.exists(metrics_path):
        with open(metrics_path) as f:
            records = [record for record in map(json.loads, f) if record["step"] <= last_step]
    write_synced(metrics_path, lambda f: f.write("".join(json.dumps(r) + "\n" for r in records).encode()))
    return records
