"""The whole test suite: real megatron-core and real vLLM (CPU build) on tiny models.

    .venv/bin/python -m pytest test_all.py

Anything that initialises torch.distributed, megatron-core's parallel state or a vLLM
engine runs in freshly spawned processes (`run_in_processes`), so tests never share
global state and multi-rank tests use real gloo process groups.
"""

import math
import multiprocessing
import os
import queue
import tempfile
import traceback

import pytest
import torch

import cpu_backend
import tiny_model

PROCESS_TIMEOUT_SECONDS = 600
# vLLM's engine core runs in the calling process: no extra processes, faster start.
VLLM_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


# ---------------------------------------------------------------------------------------
# Harness
# ---------------------------------------------------------------------------------------

def _process_entry(fn, args, rank, world_size, master_port, env, results):
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(master_port), **env})
    # Two cores shared by world_size processes: more threads only contend.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    try:
        results.put((rank, "ok", fn(*args)))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def run_in_processes(fn, world_size=1, args=(), env=None, timeout=PROCESS_TIMEOUT_SECONDS):
    """Run `fn(*args)` in `world_size` spawned processes with torchrun's environment set.

    `fn` must be a module-level function; it calls `cpu_backend.init_distributed()` itself
    if it needs a process group. Returns the list of return values by rank; a failure on
    any rank fails the caller with that rank's traceback.
    """
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    master_port = cpu_backend.free_port()
    processes = [context.Process(target=_process_entry,
                                 args=(fn, args, rank, world_size, master_port, env or {}, results))
                 for rank in range(world_size)]
    for process in processes:
        process.start()
    by_rank, errors = {}, []
    try:
        for _ in range(world_size):
            rank, status, value = results.get(timeout=timeout)
            if status == "ok":
                by_rank[rank] = value
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


@pytest.fixture(scope="session")
def tiny_checkpoint():
    """The default tiny MiMo checkpoint, written once per test session."""
    with tempfile.TemporaryDirectory(prefix="tiny-mimo-") as directory:
        yield tiny_model.build_tiny_mimo(directory)


# ---------------------------------------------------------------------------------------
# Foundation: tiny checkpoint in vLLM, megatron-core on CPU, RNG tracker
# ---------------------------------------------------------------------------------------

def _vllm_generates_with_mtp(checkpoint):
    from vllm import LLM, SamplingParams
    llm = LLM(model=checkpoint, dtype="float32", gpu_memory_utilization=0.1, max_model_len=256, seed=0,
              enforce_eager=True, disable_log_stats=False,
              speculative_config={"method": "mtp", "num_speculative_tokens": 1})
    outputs = llm.generate(["abc", "hello world"], SamplingParams(max_tokens=16, temperature=1.0, seed=0, ignore_eos=True))
    counters = {metric.name: getattr(metric, "value", None) for metric in llm.get_metrics()
                if metric.name.startswith("vllm:spec_decode")}
    return [len(output.outputs[0].token_ids) for output in outputs], counters


def test_tiny_checkpoint_generates_in_vllm_with_mtp_drafts(tiny_checkpoint):
    lengths, counters = run_in_processes(_vllm_generates_with_mtp, args=(tiny_checkpoint,), env=VLLM_ENV)[0]
    assert lengths == [16, 16]
    assert counters["vllm:spec_decode_num_drafts"] > 0
    assert counters["vllm:spec_decode_num_draft_tokens"] >= counters["vllm:spec_decode_num_drafts"]
    assert 0 <= counters["vllm:spec_decode_num_accepted_tokens"] <= counters["vllm:spec_decode_num_draft_tokens"]


def test_tiny_checkpoint_is_cached_and_tokenizer_round_trips(tmp_path):
    path = tiny_model.build_tiny_mimo(str(tmp_path / "m"), seed=3, hidden_size=128, num_heads=2, num_kv_heads=1)
    written = os.path.getmtime(os.path.join(path, "model.safetensors"))
    assert tiny_model.build_tiny_mimo(path, seed=3, hidden_size=128, num_heads=2, num_kv_heads=1) == path
    assert os.path.getmtime(os.path.join(path, "model.safetensors")) == written
    tokenizer = tiny_model.build_tokenizer()
    text = "Reverse: a1 B2!\n"
    ids = tokenizer.encode(text).ids
    assert len(ids) == len(text) and max(ids) < tiny_model.VOCAB_SIZE
    assert tokenizer.decode(ids) == text
    with pytest.raises(ValueError, match="num_kv_heads=3"):
        tiny_model.mimo_config(num_heads=4, num_kv_heads=3)


def _megatron_tp2_forward_backward(checkpoint):
    from megatron_model import build_gpt_model
    rank, world_size, _ = cpu_backend.init_distributed()
    cpu_backend.init_model_parallel(tensor_parallel=world_size, seed=1)
    model = build_gpt_model(checkpoint)
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(3, 100, (2, 24), generator=generator)
    position_ids = torch.arange(24).expand(2, 24)
    labels = torch.roll(input_ids, -1, dims=1)
    loss = model(input_ids, position_ids, None, labels=labels, loss_mask=torch.ones(2, 24)).mean()
    loss.backward()
    grads_finite = all(torch.isfinite(p.grad).all().item() for p in model.parameters() if p.grad is not None)
    num_grads = sum(p.grad is not None for p in model.parameters())
    mtp_grad = model.mtp.layers[0].eh_proj.weight.grad
    return loss.item(), grads_finite, num_grads, float(mtp_grad.norm()) if mtp_grad is not None else 0.0


def test_megatron_gpt_with_mtp_runs_at_tensor_parallel_2(tiny_checkpoint):
    results = run_in_processes(_megatron_tp2_forward_backward, world_size=2, args=(tiny_checkpoint,))
    (loss0, finite0, count0, mtp0), (loss1, finite1, count1, mtp1) = results
    assert math.isfinite(loss0) and loss0 == pytest.approx(loss1, abs=1e-6)
    # Random init on a 128-token vocabulary: close to ln(128) = 4.85.
    assert 4.0 < loss0 < 6.0
    assert finite0 and finite1 and count0 == count1 > 20
    assert mtp0 > 0 and mtp1 > 0


def _rng_tracker_forks(seed):
    from megatron.core import tensor_parallel
    cpu_backend.init_distributed()
    cpu_backend.init_model_parallel(seed=seed)
    tracker = tensor_parallel.get_cuda_rng_tracker()
    torch.manual_seed(99)
    default_before = torch.get_rng_state()
    masks = []
    for _ in range(2):
        with tracker.fork():
            masks.append(torch.nn.functional.dropout(torch.ones(64), p=0.5))
    default_after_forks = torch.get_rng_state()
    return {
        "tracker": type(tracker).__name__,
        "masks": masks,
        "default_undisturbed": torch.equal(default_before, default_after_forks),
        "default_draw": torch.rand(4),
    }


def test_cpu_rng_tracker_is_reproducible_and_leaves_default_generator_alone():
    first, = run_in_processes(_rng_tracker_forks, args=(7,))
    again, = run_in_processes(_rng_tracker_forks, args=(7,))
    other_seed, = run_in_processes(_rng_tracker_forks, args=(8,))
    assert first["tracker"] == "CpuRNGStatesTracker"
    # Same seed, same sequence of masks; consecutive forks continue the tracked stream.
    assert torch.equal(first["masks"][0], again["masks"][0]) and torch.equal(first["masks"][1], again["masks"][1])
    assert not torch.equal(first["masks"][0], first["masks"][1])
    assert not torch.equal(first["masks"][0], other_seed["masks"][0])
    assert first["default_undisturbed"]
    torch.manual_seed(99)
    assert torch.equal(first["default_draw"], torch.rand(4))


def test_cpu_rng_tracker_rejects_unknown_names_and_reused_seeds():
    tracker = cpu_backend.CpuRNGStatesTracker()
    tracker.add("a", 1)
    with pytest.raises(ValueError, match="seed 1"):
        tracker.add("b", 1)
    with pytest.raises(ValueError, match="'missing'"):
        with tracker.fork("missing"):
            pass
    states = tracker.get_states()
    with tracker.fork("a"):
        first = torch.rand(3)
    tracker.set_states(states)
    with tracker.fork("a"):
        assert torch.equal(torch.rand(3), first)
