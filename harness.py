"""Test plumbing shared by test_all.py, bench.py and bench_runs.py: fresh processes with torchrun's environment.

Anything that initialises torch.distributed, megatron-core's parallel state or a vLLM
engine runs in fresh processes (`run_in_processes`), so callers never share
global state and multi-rank code runs over real gloo process groups. Imports torch,
the standard library and cpu_backend (pytest only inside `requires_cuda`), so `import bench` stays
free of the test suite.
"""

import atexit
import ctypes
import io
import multiprocessing
import os
import queue
import sys
import traceback

import torch

from cpu_backend import free_port

PROCESS_TIMEOUT_SECONDS = 600
REPO_DIR = os.path.dirname(os.path.abspath(__file__))
# vLLM's engine core runs in the calling process: no extra processes, faster start.
VLLM_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
# Imported once by the server the processes fork from, beside the caller's module: vLLM's
# engine, which each process would otherwise import anew (seconds); absent, it is skipped.
FORKSERVER_PRELOAD = ("vllm.entrypoints.llm", "vllm.v1.engine.core", "vllm.v1.worker.cpu_worker")


def shared_memory_names():
    """The names in /dev/shm (empty where there is none) but multiprocessing's semaphores
    (its resource tracker unlinks those): vLLM's CPU engines over several ranks share
    memory there that only their process's exit unlinks."""
    names = os.listdir("/dev/shm") if os.path.isdir("/dev/shm") else []
    return {name for name in names if not name.startswith("sem.")}


def _process_entry(fn, args, rank, world_size, master_port, env, results):
    shared_before = shared_memory_names()
    os.environ.update(env, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(master_port))
    # Two cores shared by world_size processes: more threads only contend.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    try:
        # As bytes: a tensor sent through the queue as-is lives in shared memory that
        # vanishes when this process exits, before the parent may have read it.
        buffer = io.BytesIO()
        torch.save(fn(*args), buffer)
        results.put((rank, "ok", buffer.getvalue()))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
    # The result is through the pipe once the queue's feeder thread is joined. The shutdown
    # the interpreter would do next (vLLM's exit hooks collecting garbage engine by engine,
    # every module torn down) takes seconds per process and saves nothing, unless shared
    # memory appeared meanwhile (this rank's or another's: vLLM's CPU engines over several
    # ranks): the exit hooks and then C's exit() unlink it, os._exit alone would not.
    results.close()
    results.join_thread()
    sys.stdout.flush()
    sys.stderr.flush()
    if shared_memory_names() - shared_before:
        atexit._run_exitfuncs()
        ctypes.CDLL(None).exit(0)
    os._exit(0)


def run_in_processes(fn, world_size=1, args=(), env=None, timeout=PROCESS_TIMEOUT_SECONDS):
    """Run `fn(*args)` in `world_size` fresh processes with torchrun's environment set.

    `fn` must be a module-level function; it calls `cpu_backend.init_distributed()` itself
    if it needs a process group. `env` holds in each process before `fn` runs. Returns the
    list of return values by rank; a failure on any rank fails the caller with that rank's
    traceback.

    Without CUDA the processes fork from a server that imported `fn`'s module once (torch,
    megatron-core, vLLM: seconds per process otherwise); nothing in it has run a process
    group or an engine, so each process still starts clean. Their stdout is the server's
    (the first caller's). With CUDA they are spawned: a forked CUDA context is unusable.
    """
    if torch.cuda.is_available():
        context = multiprocessing.get_context("spawn")
    else:
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload([fn.__module__, *FORKSERVER_PRELOAD])
    results = context.Queue()
    master_port = free_port()
    processes = [context.Process(target=_process_entry,
                                 args=(fn, args, rank, world_size, master_port, dict(env or {}), results))
                 for rank in range(world_size)]
    # Set here too, so that a spawned process imports with it (CUDA_VISIBLE_DEVICES).
    saved_env = {key: os.environ.get(key) for key in env or {}}
    os.environ.update(env or {})
    try:
        for process in processes:
            process.start()
    finally:
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key)
            else:
                os.environ[key] = value
    by_rank, errors = {}, []
    try:
        for _ in range(world_size):
            rank, status, value = results.get(timeout=timeout)
            if status == "ok":
                by_rank[rank] = torch.load(io.BytesIO(value), weights_only=False)
            else:
                errors.append(f"rank {rank}:\n{value}")
                break
    except queue.Empty:
        errors.append(f"timed out after {timeout}s waiting for {world_size - len(by_rank)} rank(s)")
    finally:
        for process in processes:
            process.join(timeout=5 if errors else 60)
            if process.is_alive():
                process.terminate()
    if errors:
        raise AssertionError(f"{fn.__name__} failed\n" + "\n".join(errors))
    return [by_rank[rank] for rank in range(world_size)]


def to_host(tree):
    """`tree` with tensors detached, in fp32, on the CPU: what a spawned process returns."""
    if torch.is_tensor(tree):
        return tree.detach().float().cpu()
    if isinstance(tree, dict):
        return {key: to_host(value) for key, value in tree.items()}
    if isinstance(tree, list):
        return [to_host(value) for value in tree]
    return tree


def requires_cuda(test):
    """pytest marker: skip `test` where no CUDA GPU answers."""
    import pytest
    return pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")(test)


def pad_batch(input_ids, seqlens):
    """The padded reference layout of a packed batch, for tests and benchmarks.

    input_ids [T] int64 (sequences concatenated), seqlens [B] -> right-padded ids [B, S]
    int64, positions [B, S] int64, real [B, S] bool (a token, not padding) and next_mask
    [B, S] fp32 (1 where the token has a next token in its sequence), S the longest length.
    """
    lengths = torch.as_tensor(seqlens).tolist()
    padded = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    real = torch.zeros(len(lengths), max(lengths), dtype=torch.bool)
    next_mask = torch.zeros(len(lengths), max(lengths))
    for row, sequence in enumerate(torch.split(input_ids, lengths)):
        padded[row, :len(sequence)] = sequence
        real[row, :len(sequence)] = True
        next_mask[row, :len(sequence) - 1] = 1.0
    positions = torch.arange(max(lengths)).expand(len(lengths), max(lengths))
    return padded, positions, real, next_mask


def padded_logprobs(log_probs, padded, next_mask):
    """log_probs [B, S, V] fp32 (log-softmax of the logits), padded ids [B, S], next_mask
    [B, S] -> (next-token log-probs [B, S], 0 where there is no next token; entropy [B, S])."""
    labels = torch.cat([padded[:, 1:], torch.zeros(len(padded), 1, dtype=torch.long)], dim=1)
    logprobs = log_probs.gather(-1, labels[..., None])[..., 0] * next_mask
    return logprobs, -(log_probs.exp() * log_probs).sum(-1)
