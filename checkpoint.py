"""Checkpoints that a killed run cannot corrupt, and the choice of the one to resume from.

    lock = lock_out(out) if rank == 0 else None                    # one run per folder
    layout = {"world_size": 2, "tp": 1, "cp": 1, "model": "..."}   # what must match to resume
    directory = choose_checkpoint(out, "auto", layout)             # None: start fresh
    state = load_rank_state(directory, rank) if directory else None
    stop = StopRequest()                                           # SIGTERM / SIGINT
    for step in ...:
        ...
        if stop.agreed(device) or step % save_every == 0:
            save_checkpoint(out, step, {"model": ..., "optimizer": ...}, layout, keep=2, rank=rank)

On disk: OUT/checkpoints/step_000050/{rank0.pt, rank1.pt, ..., meta.json}. Every rank
writes its shard into step_N.partial/, each file flushed to disk and hashed (sha256) as it
is written; rank 0 then writes meta.json (the layout, the step, each file's size and
checksum) and renames the directory to step_N: a checkpoint directory either is complete
or does not exist, and one whose files do not match their recorded sizes or checksums (a
disk that lost or garbled writes) is skipped with a warning naming the file. A save
that does not fit the disk is refused before it writes (or, where the disk fills while it
writes, undone), naming the folder and the bytes it needs; the checkpoint before it stays.
`out` must be storage every node sees. Refusals are `CheckpointError` (a ValueError)
naming the directory and what differs. Imports torch and the standard library.
"""

import fcntl
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import sys
import time

import torch
import torch.distributed as dist

import preflight

CHECKPOINTS_DIR = "checkpoints"
METRICS_FILE = "metrics.jsonl"
FINAL_DIR = "final"
CHECKPOINT_META = "meta.json"
LOCK_FILE = preflight.LOCK_FILE
# The suffix of a checkpoint that failed verification, set aside by `choose_checkpoint`.
CORRUPT = "corrupt"
# What a save writes beyond its tensors' bytes (pickled structure, meta.json), at least.
SAVE_OVERHEAD_BYTES = 2**20
DIGEST_BYTES = hashlib.sha256().digest_size
HASH_CHUNK_BYTES = 2**22
# Set by the fault-tolerance tests: "PHASE:STEP[,PHASE:STEP...]" makes the last rank SIGKILL
# itself at the i-th point on torchrun's i-th attempt (PHASE: sync, before the step's weight
# push; save, after writing its file, before the checkpoint is published).
KILL_AT_ENV = "TRAIN_GRPO_KILL_AT"
# What a resumed run may set otherwise than its checkpoint: how it runs, drafts, saves and
# logs, its length and the optimizer's step size. Any other flag makes it another run.
RESUME_MAY_CHANGE = ("steps", "out", "resume", "save_every", "keep_checkpoints", "eval_every", "tensorboard",
                     "verbose", "wandb_project", "lr", "grad_clip", "micro_batches", "max_tokens_per_micro_batch",
                     "mtp_rollout", "num_speculative_tokens", "max_speculative_tokens", "auto_draft", "draft_tokens",
                     "tune_every",
                     "acceptance_check_every", "check_draft_every", "spec_config", "gpu_memory_utilization",
                     "kv_cache_bytes", "shared_prefix", "reward_timeout", "resume_with_changed_inputs")
# What a checkpoint saved before a flag existed ran with.
SETTINGS_BEFORE_THEY_EXISTED = {"distributed_optimizer": False, "mtp_loss": "ce", "mtp_train_depths": None}


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed or saved; the message names it and why."""


def lock_out(out):
    """Hold OUT/.lock for the life of this process (keep the returned file open): a second
    run on the same folder is refused, naming the first. An flock, so the kernel releases
    it when the holder dies: a crashed or killed run leaves no stale lock."""
    os.makedirs(out, exist_ok=True)
    lock = open(os.path.join(out, LOCK_FILE), "a+")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read().strip() or "a process that wrote nothing yet"
        lock.close()
        raise CheckpointError(preflight.locked_out_message(out, holder)) from None
    lock.seek(0)
    lock.truncate()
    lock.write(f"pid {os.getpid()} on {socket.gethostname()}, started {time.strftime('%Y-%m-%d %H:%M:%S')}: "
               + " ".join(sys.argv))
    lock.flush()
    return lock


def in_use(out):
    """Whether a live run holds OUT/.lock (`lock_out`'s refusal then names it)."""
    return preflight.out_holder(out) is not None


class StopRequest:
    """SIGTERM and SIGINT (what a scheduler sends before preemption, and Ctrl-C) as a request
    to stop at the next step boundary with a checkpoint, instead of dying mid-step.

    `agreed(device)` (collective: every rank calls it once per step) is the number of the
    signal any rank received, 0 for none: every rank stops at the same step, also when
    only one was signalled. Under torchrun the agent forwards its SIGTERM to the workers
    and gives them 30 s before SIGKILL; a step and a save take a few seconds.
    """

    def __init__(self, signals=(signal.SIGTERM, signal.SIGINT)):
        self.signum = 0
        for signum in signals:
            signal.signal(signum, self._request)

    def _request(self, signum, frame):
        self.signum = signum

    def agreed(self, device):
        received = torch.tensor([self.signum], dtype=torch.int64, device=device)
        dist.all_reduce(received, op=dist.ReduceOp.MAX)
        return int(received.item())


def fault_point(phase, step):
    """The fault-tolerance tests' SIGKILL, where KILL_AT_ENV names (phase, step) for this attempt."""
    points = os.environ.get(KILL_AT_ENV, "").split(",")
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if attempt < len(points) and points[attempt] == f"{phase}:{step}" and dist.get_rank() == dist.get_world_size() - 1:
        os.kill(os.getpid(), signal.SIGKILL)


class _HashingWriter:
    """A binary file's write and flush that also feed every byte written to a sha256."""

    def __init__(self, f):
        self.file, self.sha256 = f, hashlib.sha256()

    def write(self, data):
        self.sha256.update(data)
        return self.file.write(data)

    def flush(self):
        self.file.flush()


def write_synced(path, write):
    """Write a file through `write(f)` (f has write and flush), flushed to disk, under a
    temporary name renamed at the end; returns the sha256 digest (bytes) of what was written:
    hashed on the way out, so the file is not read again."""
    with open(path + ".tmp", "wb") as f:
        hashing = _HashingWriter(f)
        write(hashing)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)
    return hashing.sha256.digest()


def file_sha256(path):
    """The sha256 hex digest of a file, read in chunks (a shard may not fit in memory twice)."""
    sha256 = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK_BYTES):
            sha256.update(chunk)
    return sha256.hexdigest()


def save_checkpoint(out, step, state, meta, keep, rank):
    """Every rank writes `state` (its shard: any torch.save-able dict) into step_N.partial/;
    rank 0 publishes step_N with meta.json (`meta`: the layout and anything JSON the run
    wants to find again, plus the step, the file sizes and their sha256) and keeps
    the newest `keep`. Collective: every rank calls it. Where a shard does not fit its
    disk (checked before writing, and any write error), every rank raises CheckpointError
    and step_N.partial/ is removed: the checkpoints before it stay as they were."""
    root = os.path.join(out, CHECKPOINTS_DIR)
    final = os.path.join(root, f"step_{step:06d}")
    staging = final + ".partial"
    if rank == 0:
        shutil.rmtree(staging, ignore_errors=True)
        os.makedirs(staging)
    dist.barrier()
    needed, free = state_bytes(state) + SAVE_OVERHEAD_BYTES, shutil.disk_usage(staging).free
    error = None if needed <= free else "not enough free space"
    digest = bytes(DIGEST_BYTES)
    if error is None:
        try:
            digest = write_synced(os.path.join(staging, f"rank{rank}.pt"), lambda f: torch.save(state, f))
        except (OSError, RuntimeError) as write_error:
            # torch.save's zip writer turns a failed write into a RuntimeError while it closes.
            cause = write_error if isinstance(write_error, OSError) else write_error.__context__
            error = getattr(cause, "strerror", None) or str(write_error)
    fault_point("save", step)
    digests = _refuse_unless_saved(error, needed, free, staging, step, rank, digest)
    if rank == 0:
        files = {name: os.path.getsize(os.path.join(staging, name)) for name in sorted(os.listdir(staging))}
        published = dict(meta, step=step, files=files,
                         sha256={f"rank{r}.pt": digest.hex() for r, digest in enumerate(digests)})
        write_synced(os.path.join(staging, CHECKPOINT_META),
                     lambda f: f.write(json.dumps(published, indent=1).encode()))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(staging, final)
        for old in checkpoint_dirs(root)[keep:]:
            shutil.rmtree(old)
    dist.barrier()


def state_bytes(state):
    """The bytes of every tensor in a nested state (dicts, lists, tuples): what torch.save
    writes, less its small pickled structure."""
    if torch.is_tensor(state):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(state_bytes(value) for value in state.values())
    if isinstance(state, (list, tuple)):
        return sum(state_bytes(value) for value in state)
    return 0


def _refuse_unless_saved(error, needed, free, staging, step, rank, digest):
    """Collective: where any rank's shard was not written, remove the partial checkpoint and
    raise on every rank, naming the folder, the bytes the save needs and those free; else
    [every rank's shard's sha256 digest (bytes)], by rank. `digest`: this rank's."""
    # One all-reduce: the failure count, the bytes needed and each rank's digest bytes
    # (0-255, exact in float64) in its own slot.
    shared = torch.zeros(2 + dist.get_world_size() * DIGEST_BYTES, dtype=torch.float64)
    shared[0], shared[1] = float(error is not None), float(needed)
    shared[2 + rank * DIGEST_BYTES:2 + (rank + 1) * DIGEST_BYTES] = torch.tensor(list(digest), dtype=torch.float64)
    dist.all_reduce(shared)
    failed = shared[:2]
    if not failed[0]:
        return [bytes(row) for row in shared[2:].to(torch.uint8).view(-1, DIGEST_BYTES).tolist()]
    if rank == 0:
        shutil.rmtree(staging, ignore_errors=True)
    previous = checkpoint_dirs(os.path.dirname(staging))
    raise CheckpointError(
        f"the step {step} checkpoint did not fit: {os.path.dirname(staging)} needs about {int(failed[1])} bytes for "
        f"it ({needed} for this rank's shard), {free} bytes are free there ({int(failed[0])} rank(s) could not "
        f"write{': ' + error if error else ''}); free some space or pass another --out. Kept "
        + (f"{previous[0]}, the last complete checkpoint" if previous else "no checkpoint (none was complete)"))


def checkpoint_dirs(root):
    """Published checkpoint directories under `root`, newest first."""
    if not os.path.isdir(root):
        return []
    names = [name for name in os.listdir(root) if re.fullmatch(r"step_\d+", name)]
    return [os.path.join(root, name) for name in sorted(names, reverse=True)]


def set_aside(directory, why):
    """Rename a published checkpoint (rank 0) so that no resume picks it again: a checkpoint
    whose files are whole but whose first step gives a non-finite loss, or one that failed
    verification; returns the new name."""
    aside, copies = f"{directory}.{why}", 1
    while os.path.exists(aside):  # set aside before: each kept
        copies += 1
        aside = f"{directory}.{why}{copies}"
    os.replace(directory, aside)
    return aside


def checkpoint_problem(directory):
    """Why `directory` is not a complete checkpoint (naming the file), or None: a file
    missing, of another size than meta.json records, or (where meta.json records sha256
    checksums) of other contents. Reads every file of the checkpoint once."""
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
    for name, expected in meta.get("sha256", {}).items():
        path = os.path.join(directory, name)
        actual = file_sha256(path)
        if actual != expected:
            return f"{path} does not match its checksum (sha256 {actual[:16]}..., expected {expected[:16]}...)"
    return None


def out_problems(out, resume):
    """Why `out` cannot hold this run, or `resume` ("auto", "never" or a directory) cannot
    be used with it: [messages], before anything is written."""
    if os.path.exists(out) and not os.path.isdir(out):
        return [f"--out {out!r} is a file; expected a folder for metrics.jsonl, checkpoints/ and final/"]
    existing = os.path.abspath(out)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.access(existing, os.W_OK) or os.statvfs(existing).f_flag & os.ST_RDONLY:
        return [f"--out {out!r}: {existing} is read-only; expected a folder this run can write"]
    if resume == "never" and checkpoint_dirs(os.path.join(out, CHECKPOINTS_DIR)):
        return [f"--resume never: {os.path.join(out, CHECKPOINTS_DIR)} holds checkpoints of an earlier run; "
                "expected a fresh --out (or --resume auto to continue it)"]
    if resume not in ("auto", "never", "afresh") and not os.path.isdir(resume):
        return [f"--resume {resume!r}: no such directory; expected auto, never, afresh or a checkpoint dir"]
    # afresh replaces the run's files by request (its checkpoints are checked to have failed).
    return [] if resume == "afresh" else another_runs_files(out) + metrics_problems(os.path.join(out, METRICS_FILE))


def another_runs_files(out):
    """[a message] when `out` holds a run's metrics or final/ but no checkpoint to continue
    it from: another run's, which this one would overwrite. A worker group that torchrun
    restarts (TORCHELASTIC_RESTART_COUNT > 0) is the same run, stopped before its first
    checkpoint, and starts over."""
    found = [name for name in (METRICS_FILE, FINAL_DIR) if os.path.exists(os.path.join(out, name))]
    if not found or checkpoint_dirs(os.path.join(out, CHECKPOINTS_DIR)) \
            or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0 or in_use(out):
        return []
    return [f"--out {out!r} holds {' and '.join(found)} of an earlier run but no checkpoint to continue it from; "
            "this run would overwrite them: pass another --out, or move them away to reuse this one"]


def metrics_problems(metrics_path):
    """[a message] when `metrics_path` exists but is not a metrics.jsonl this project wrote
    (one JSON record with a "step" per line): resuming would cut it back by step."""
    if not os.path.isfile(metrics_path):
        return []
    with open(metrics_path, "rb") as f:
        for number, line in enumerate(f, 1):
            try:
                record = json.loads(line)
            except ValueError:
                record = None
            if not isinstance(record, dict) or not isinstance(record.get("step"), int):
                return [f"{metrics_path}: line {number} is not a step record of train_grpo.py (a JSON object "
                        "with an int \"step\"); expected this project's metrics.jsonl: pass another --out"]
    return []


def choose_checkpoint(out, resume, layout):
    """The checkpoint directory a run continues from, or None to start fresh.

    resume: "auto" (the newest complete checkpoint under OUT/checkpoints, if any), "never",
    or a directory (a checkpoint, or a checkpoints folder for its newest). A complete
    checkpoint of another `layout` is a CheckpointError; an incomplete or corrupted one is
    skipped with a warning on stderr (from rank 0) naming the bad file, and the newest good
    one is taken. One saved without checksums is taken as its sizes say, with a note.
    """
    if resume == "never":
        return None
    root = os.path.join(out, CHECKPOINTS_DIR) if resume in ("auto", "afresh") else resume
    candidates = [root] if os.path.isfile(os.path.join(root, CHECKPOINT_META)) else checkpoint_dirs(root)
    rank0 = int(os.environ.get("RANK", "0")) == 0
    failed = []
    for directory in candidates:
        problem = checkpoint_problem(directory)
        if problem is not None:
            failed.append(f"{directory} ({problem})")
            continue
        if resume == "afresh":
            raise CheckpointError(f"--resume afresh: {directory} is a complete checkpoint; expected --resume auto to "
                                  "continue from it (afresh starts only an --out whose every checkpoint failed)")
        for skipped in failed if rank0 else ():
            print(f"train_grpo.py: warning: checkpoint {skipped.replace(' (', ' skipped: ', 1)[:-1]}; it is set "
                  f"aside as step_N.{CORRUPT} when the run starts", file=sys.stderr, flush=True)
        saved = read_meta(directory)
        if "sha256" not in saved and rank0:
            print(f"train_grpo.py: note: checkpoint {directory} has no checksums (saved before they were recorded); "
                  "its files are checked by size only", file=sys.stderr, flush=True)
        different = {key: (saved.get(key), value) for key, value in layout.items() if saved.get(key) != value}
        if different:
            raise CheckpointError(f"--resume {resume}: {directory} was saved with " + ", ".join(
                f"{key} {was!r}" for key, (was, _) in different.items()) + "; this run has " + ", ".join(
                f"{key} {now!r}" for key, (_, now) in different.items()) + " (resume with the same layout, or "
                "pass --resume never and another --out)")
        return directory
    if resume not in ("auto", "afresh"):
        raise CheckpointError(f"--resume {resume!r}: no complete checkpoint there; expected a checkpoint dir "
                              f"(OUT/checkpoints/step_N) or a run's OUT/checkpoints")
    if failed and resume == "auto":
        raise CheckpointError(f"--resume auto: every checkpoint in {root} failed verification, so none can be "
                              f"resumed: {'; '.join(failed)}. Nothing was changed; pass --resume afresh to start "
                              f"this --out again from step 1 (each is then set aside as step_N.{CORRUPT}, and its "
                              "metrics.jsonl and final/ are replaced)")
    return None


def set_aside_failed(out, resume_dir):
    """Rank 0, holding the lock, before any save: the checkpoints `choose_checkpoint` found
    failed (every one newer than `resume_dir`; None: every one, --resume afresh) set aside
    as step_N.corrupt, where no save overwrites and no pruning deletes them. Returns their new names."""
    resumed = os.path.basename(resume_dir) if resume_dir else ""
    return [set_aside(directory, CORRUPT) for directory in checkpoint_dirs(os.path.join(out, CHECKPOINTS_DIR))
            if os.path.basename(directory) > resumed]


def read_meta(directory):
    """A complete checkpoint's meta.json as a dict (layout, step, files, and what the run saved with it)."""
    with open(os.path.join(directory, CHECKPOINT_META)) as f:
        return json.load(f)


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


def resume_changes(resume_dir, settings):
    """The settings (`settings`: the run's resolved flags by name) this run has otherwise than
    the checkpoint in `resume_dir` was saved with (its meta.json), as flags ("--steps 8 (was
    5)"; "" for none): those RESUME_MAY_CHANGE allows; any other is a CheckpointError naming
    each, then and now, and so is --steps below the checkpoint's step."""
    meta = read_meta(resume_dir)
    if settings["steps"] < meta["step"]:
        raise CheckpointError(f"--steps {settings['steps']}: {resume_dir} was saved after step {meta['step']}; "
                              f"expected --steps {meta['step']} or more to continue it (or --resume never and another "
                              "--out)")
    saved = {**SETTINGS_BEFORE_THEY_EXISTED, **meta.get("flags", {})}
    changed = {name: (saved[name], value) for name, value in settings.items() if name in saved and saved[name] != value}

    def described(names):
        return ", ".join(f"--{name.replace('_', '-')} {changed[name][1]} (was {changed[name][0]})" for name in names)
    refused = [name for name in changed if name not in RESUME_MAY_CHANGE]
    if refused:
        raise CheckpointError(f"--resume {settings['resume']}: {resume_dir} is another run: {described(refused)}; "
                              "resume with the values it was saved with, or pass --resume never and another --out")
    return described(changed)


def refuse_changed_inputs(resume_dir, settings, digests):
    """A CheckpointError when a file the run of `resume_dir` read differs in content from
    today's: `digests` and the checkpoint's meta map each of --data, --eval-data and --reward
    to its file's sha256. settings["resume_with_changed_inputs"] lets it through."""
    saved = read_meta(resume_dir).get("inputs")
    if saved is None or settings["resume_with_changed_inputs"]:
        return
    changed = [flag for flag in sorted(set(saved) | set(digests)) if saved.get(flag) != digests.get(flag)]
    if changed:
        files = ", ".join(f"{flag} {settings[flag[2:].replace('-', '_')]!r}" for flag in changed)
        raise CheckpointError(f"--resume {settings['resume']}: {files} changed in content since {resume_dir} was "
                              "saved; resume with the files that run read, or pass --resume-with-changed-inputs to "
                              "train on the new ones")
