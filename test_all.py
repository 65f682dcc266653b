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


# ---------------------------------------------------------------------------------------
# forward.py: packed THD under TP and CP equals the unsharded forward
# ---------------------------------------------------------------------------------------

FORWARD_TOLERANCE = 1e-5  # fp32 on CPU, same math in another layout
# Mixed lengths, three of them shorter than 2 * cp at cp=2.
FORWARD_SEQLENS = [1, 2, 3, 7, 12, 25, 40]


def _forward_batch(vocab_size=100, seed=0):
    generator = torch.Generator().manual_seed(seed)
    seqlens = torch.tensor(FORWARD_SEQLENS)
    input_ids = torch.randint(3, vocab_size, (int(seqlens.sum()),), generator=generator)
    # A response-style mask: the first two predictions of every sequence do not count.
    starts = torch.repeat_interleave(torch.cumsum(seqlens, 0) - seqlens, seqlens)
    loss_mask = ((torch.arange(len(input_ids)) - starts) >= 2).float()
    weights = torch.randn(len(input_ids), generator=generator)
    return input_ids, seqlens, loss_mask, weights


def _reference_state(checkpoint, seed=0):
    """Random weights shared by every layout: built once at TP=1, CP=1 in this process."""
    from megatron_model import build_gpt_model
    cpu_backend.init_model_parallel(seed=seed)
    return build_gpt_model(checkpoint).state_dict()


def _sharded_state(full_state, model):
    """Slice full (TP=1) tensors to this rank's TP shard, for each parameter of `model`."""
    from megatron.core import parallel_state
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    sharded = {}
    for name, local in model.state_dict().items():
        if local is None or not torch.is_tensor(local) or name not in full_state:
            continue
        full = full_state[name]
        if full.shape == local.shape:
            sharded[name] = full
        elif name.endswith("linear_fc1.weight"):
            # SwiGLU fc1 is [gate; up]: each rank holds [gate shard; up shard].
            gate, up = full.chunk(2, dim=0)
            sharded[name] = torch.cat([gate.chunk(tp_size)[tp_rank], up.chunk(tp_size)[tp_rank]])
        else:
            dim = next(d for d in range(full.dim()) if full.shape[d] != local.shape[d])
            sharded[name] = full.chunk(tp_size, dim=dim)[tp_rank]
    return sharded


def _run_forward(checkpoint, full_state, *, tp=1, cp=1, mtp=True, attention="thd", position_formula=None):
    """Build the model at (tp, cp), load `full_state`, run forward + backward; return
    gathered log-probs / entropy, the summed MTP loss, grads (full shape) and MTP inputs."""
    import forward
    from megatron.core import parallel_state
    from megatron_model import build_gpt_model
    cpu_backend.init_model_parallel(tensor_parallel=tp, context_parallel=cp, seed=0)
    model = build_gpt_model(checkpoint, mtp=mtp, attention=attention, tensor_parallel=tp, context_parallel=cp)
    model.load_state_dict(_sharded_state(full_state, model), strict=False)
    input_ids, seqlens, loss_mask, weights = _forward_batch()
    mtp_position_ids = []
    if mtp:
        model.mtp.layers[0].register_forward_pre_hook(
            lambda module, args, kwargs: mtp_position_ids.append(kwargs["position_ids"].detach().clone()),
            with_kwargs=True)
    if position_formula is not None:
        original_pack = forward.pack_thd

        def pack_with_formula(*args, **kwargs):
            batch = original_pack(*args, **kwargs)
            batch.position_ids = position_formula(batch)
            return batch
        forward.pack_thd = pack_with_formula
    out = forward.forward_logprobs(model, input_ids, seqlens, loss_mask=loss_mask, with_entropy=True,
                                   mtp_train=mtp, temperature=0.7)
    num_tokens = loss_mask[:-1].sum()
    local_weights = out.batch.pack(weights)
    loss = -(out.logprobs * local_weights).sum() / num_tokens - 0.01 * (out.entropy * out.loss_mask).sum() / num_tokens
    loss.backward()
    cp_group = parallel_state.get_context_parallel_group()
    tp_group = parallel_state.get_tensor_model_parallel_group()
    grads = {}
    for name, param in model.named_parameters():
        grad = param.grad if param.grad is not None else torch.zeros_like(param)
        # megatron's usual reduction: gradients are summed over the CP group (DDP).
        torch.distributed.all_reduce(grad, group=cp_group)
        if param.shape != full_state[name].shape:
            pieces = [torch.empty_like(grad) for _ in range(tp)]
            torch.distributed.all_gather(pieces, grad.contiguous(), group=tp_group)
            if name.endswith("linear_fc1.weight"):
                halves = [piece.chunk(2) for piece in pieces]
                grad = torch.cat([half[0] for half in halves] + [half[1] for half in halves])
            else:
                dim = next(d for d in range(grad.dim()) if grad.shape[d] != full_state[name].shape[d])
                grad = torch.cat(pieces, dim=dim)
        grads[name] = grad
    mtp_loss = None
    if out.mtp_loss is not None:
        mtp_loss = out.mtp_loss.clone()
        torch.distributed.all_reduce(mtp_loss, group=cp_group)
    gathered_positions = None
    if mtp_position_ids:
        gathered_positions = out.batch.unpack(mtp_position_ids[0][0], cp_group=cp_group)
    return {
        "logprobs": out.batch.unpack(out.logprobs.detach(), cp_group=cp_group),
        "entropy": out.batch.unpack(out.entropy.detach(), cp_group=cp_group),
        "mtp_loss": mtp_loss,
        "grads": grads,
        "mtp_position_ids": gathered_positions,
        "loss_mask": out.batch.unpack(out.loss_mask, cp_group=cp_group),
    }


def _assert_forward_equal(reference, other, tolerance=FORWARD_TOLERANCE):
    mask = reference["loss_mask"] > 0
    torch.testing.assert_close(other["logprobs"][mask], reference["logprobs"][mask], rtol=0, atol=tolerance)
    torch.testing.assert_close(other["entropy"][mask], reference["entropy"][mask], rtol=0, atol=tolerance)
    for name, grad in reference["grads"].items():
        torch.testing.assert_close(other["grads"][name], grad, rtol=0, atol=tolerance, msg=lambda m: f"{name}: {m}")
    if reference["mtp_loss"] is not None:
        torch.testing.assert_close(other["mtp_loss"], reference["mtp_loss"], rtol=0, atol=tolerance)


def _padded_reference_logprobs(checkpoint, full_state):
    """Right-padded [B, S] batch through megatron's own local attention (causal mask)."""
    from megatron_model import build_gpt_model
    cpu_backend.init_model_parallel(seed=0)
    model = build_gpt_model(checkpoint, mtp=False, attention="local")
    model.load_state_dict(full_state, strict=False)
    input_ids, seqlens, _, _ = _forward_batch()
    max_len = int(seqlens.max())
    padded = torch.zeros(len(seqlens), max_len, dtype=torch.long)
    for row, sequence in enumerate(torch.split(input_ids, seqlens.tolist())):
        padded[row, :len(sequence)] = sequence
    positions = torch.arange(max_len).expand(len(seqlens), max_len)
    with torch.no_grad():
        logits = model(padded, positions, None).float() / 0.7
    log_probs = torch.log_softmax(logits, dim=-1)
    next_logprobs = log_probs[:, :-1].gather(-1, padded[:, 1:, None])[..., 0]
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    logprob_rows = [torch.cat([next_logprobs[row, :n - 1], torch.zeros(1)]) for row, n in enumerate(seqlens.tolist())]
    entropy_rows = [entropy[row, :n] for row, n in enumerate(seqlens.tolist())]
    return torch.cat(logprob_rows), torch.cat(entropy_rows)


def _forward_cp1_vs_padded(checkpoint):
    cpu_backend.init_distributed()
    full_state = _reference_state(checkpoint)
    packed = _run_forward(checkpoint, full_state, mtp=False)
    return packed, _padded_reference_logprobs(checkpoint, full_state)


def test_forward_packed_thd_equals_padded_bshd(tiny_checkpoint):
    packed, (logprobs, entropy) = run_in_processes(_forward_cp1_vs_padded, args=(tiny_checkpoint,))[0]
    mask = packed["loss_mask"] > 0
    assert mask.sum() > 50
    torch.testing.assert_close(packed["logprobs"][mask], logprobs[mask], rtol=0, atol=FORWARD_TOLERANCE)
    torch.testing.assert_close(packed["entropy"], entropy, rtol=0, atol=FORWARD_TOLERANCE)
    # At temperature 0.7 a random model is not uniform: the comparison is not between two constants.
    assert entropy.std() > 1e-3 and logprobs[mask].std() > 1e-2


def _forward_layouts(checkpoint, tp, cp):
    cpu_backend.init_distributed()
    full_state = _reference_state(checkpoint)
    reference = _run_forward(checkpoint, full_state)
    return reference, _run_forward(checkpoint, full_state, tp=tp, cp=cp)


@pytest.mark.parametrize("tp,cp", [(1, 2), (2, 1)])
def test_forward_under_tensor_or_context_parallel_equals_unsharded(tiny_checkpoint, tp, cp):
    results = run_in_processes(_forward_layouts, world_size=2, args=(tiny_checkpoint, tp, cp))
    for reference, sharded in results:
        _assert_forward_equal(reference, sharded)
        assert reference["mtp_loss"] is not None and torch.isfinite(reference["mtp_loss"])
        assert reference["grads"]["mtp.layers.0.eh_proj.weight"].abs().sum() > 0
