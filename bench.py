"""Measurements: each row times one of our modules against a baseline in the same process.

    .venv/bin/python bench.py                 # every row
    .venv/bin/python bench.py --rows pack_thd # some rows

A row is a function returning a dict with the columns below; add one by writing the
function and listing it in ROWS. Speed is always a ratio against a baseline run on the
same input in the same process, so a busy machine slows both sides alike. Rows that
initialise torch.distributed, megatron-core's parallel state or a vLLM engine measure in
processes spawned by `run_in_processes` (ours and the baseline in the same one). One
intra-op thread by default: on a shared machine, elementwise ops split over every core
wait on whichever core a neighbour holds, and the table would measure the neighbours.

This module holds the CLI and the micro rows of the training side; the rows that drive vLLM
engines or whole runs (`weight_sync_push`, `spec_rollout`, `draft_training`, `trl_step`:
whole train_grpo.py or TRL runs and their figures) are in bench_runs.py and bench_trl.py, listed in ROWS
alike.
"""

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

import bench_runs
import bench_trl
import cp_thd
import cpu_backend
import forward
import hf_weights
import mtp_patch
import tasks
import tiny_model
import trainer
from megatron_model import build_gpt_model
from harness import pad_batch, padded_logprobs, run_in_processes

COLUMNS = ("row", "ours_ms", "baseline_ms", "speedup", "notes")
DEFAULT_THREADS = 1


# ---------------------------------------------------------------------------------------
# pack_thd: vectorised CP/THD layout vs a per-sequence loop
# ---------------------------------------------------------------------------------------

PACK_NUM_SEQUENCES = 4096
PACK_MAX_LENGTH = 512
PACK_CP_SIZE = 4
# Sequence parallel over tp=2, so the padding comparison with the reference rule
# (every sequence to tp*cp*2) is not trivially equal.
PACK_TP_SIZE = 2
# Interleaved repeats: pack_thd takes milliseconds, so many of them steady the median.
PACK_REPEATS = 21


def loop_pack_thd(input_ids, seqlens, cp_size, cp_rank, tp_size):
    """The per-sequence baseline: same layout as `pack_thd`, one Python iteration per sequence."""
    lengths = seqlens.tolist()
    multiple = 2 * cp_size
    padded = [-(-length // multiple) * multiple for length in lengths]
    while sum(padded) % (tp_size * cp_size):
        padded[-1] += multiple
    local_ids = torch.zeros(sum(padded) // cp_size, dtype=input_ids.dtype)
    local_positions = torch.empty(sum(padded) // cp_size, dtype=torch.int64)
    source, slot = 0, 0
    for length, padded_length in zip(lengths, padded):
        sequence = input_ids[source:source + length]
        chunk = padded_length // multiple
        for chunk_id in (cp_rank, multiple - 1 - cp_rank):
            start = chunk_id * chunk
            real_end = min(start + chunk, length)
            if real_end > start:
                local_ids[slot:slot + real_end - start] = sequence[start:real_end]
            local_positions[slot:slot + chunk] = torch.arange(start, start + chunk).clamp_(max=length - 1)
            slot += chunk
        source += length
    return local_ids, local_positions


def lean_loop_pack_thd(input_ids, seqlens, cp_size, cp_rank, tp_size):
    """The leanest per-sequence loop: writes only the local ids and position ids, two slice
    copies per chunk (padding slots keep the zeros and the clamped positions they start with)."""
    lengths = seqlens.tolist()
    multiple = 2 * cp_size
    padded = [-(-length // multiple) * multiple for length in lengths]
    padded[-1] += -sum(padded) % (tp_size * cp_size * multiple) if sum(padded) % (tp_size * cp_size) else 0
    positions_table = torch.arange(max(padded))
    local_ids = torch.zeros(sum(padded) // cp_size, dtype=input_ids.dtype)
    local_positions = torch.empty(sum(padded) // cp_size, dtype=torch.int64)
    source, slot = 0, 0
    for length, padded_length in zip(lengths, padded):
        chunk = padded_length // multiple
        for start in (cp_rank * chunk, (multiple - 1 - cp_rank) * chunk):
            real = min(chunk, max(length - start, 0))
            if real:
                local_ids[slot:slot + real] = input_ids[source + start:source + start + real]
                local_positions[slot:slot + real] = positions_table[start:start + real]
            if real < chunk:
                local_positions[slot + real:slot + chunk] = length - 1
            slot += chunk
        source += length
    return local_ids, local_positions


def interleaved_median_ms(functions, repeats=PACK_REPEATS):
    """Median wall time in ms of each function, called in turn each repeat (after one warm-up
    round): a burst of load from other processes hits every function alike."""
    times = [[] for _ in functions]
    for repeat in range(repeats + 1):
        for fn, fn_times in zip(functions, times):
            start = time.perf_counter()
            fn()
            if repeat:
                fn_times.append(time.perf_counter() - start)
    return [1000 * statistics.median(fn_times) for fn_times in times]


def row_pack_thd():
    generator = torch.Generator().manual_seed(0)
    seqlens = torch.randint(1, PACK_MAX_LENGTH + 1, (PACK_NUM_SEQUENCES,), generator=generator)
    input_ids = torch.randint(0, 32000, (int(seqlens.sum()),), generator=generator)
    rank = PACK_CP_SIZE - 1

    def ours():
        return cp_thd.pack_thd(input_ids, seqlens, cp_size=PACK_CP_SIZE, cp_rank=rank, tp_size=PACK_TP_SIZE,
                               sequence_parallel=True)

    def baseline():
        return loop_pack_thd(input_ids, seqlens, PACK_CP_SIZE, rank, PACK_TP_SIZE)

    def lean():
        return lean_loop_pack_thd(input_ids, seqlens, PACK_CP_SIZE, rank, PACK_TP_SIZE)

    batch = ours()
    for name, (loop_ids, loop_positions) in (("loop", baseline()), ("lean loop", lean())):
        if not (torch.equal(batch.input_ids, loop_ids) and torch.equal(batch.position_ids, loop_positions)):
            raise AssertionError(f"pack_thd and the {name} baseline disagree: the timing would compare different work")
    # What pack_thd must write: its three per-slot outputs. The machine's copy bandwidth,
    # twice: into memory already mapped, and cloning each output (fresh tensors, as pack_thd
    # writes: glibc maps blocks this large afresh, so a first touch pays page faults).
    outputs = (batch.input_ids, batch.position_ids, batch.index)
    output_bytes = sum(tensor.numel() * tensor.element_size() for tensor in outputs)
    destinations = [torch.empty_like(tensor) for tensor in outputs]

    def copy_mapped():
        for destination, source in zip(destinations, outputs):
            destination.copy_(source)

    def copy_fresh():
        return [source.clone() for source in outputs]

    ours_ms, baseline_ms, lean_ms, mapped_ms, fresh_ms = interleaved_median_ms(
        [ours, baseline, lean, copy_mapped, copy_fresh])

    real = int(seqlens.sum())
    ours_padded = int(batch.seqlens_padded.sum())
    rule = PACK_TP_SIZE * PACK_CP_SIZE * 2
    rule_padded = int(((seqlens + rule - 1) // rule * rule).sum())
    return {
        "row": "pack_thd",
        "ours_ms": ours_ms,
        "baseline_ms": baseline_ms,
        "speedup": baseline_ms / ours_ms,
        "notes": (f"{PACK_NUM_SEQUENCES} seqs len U[1,{PACK_MAX_LENGTH}], cp={PACK_CP_SIZE} rank {rank}, "
                  f"tp={PACK_TP_SIZE}+SP; lean loop (ids+positions only) {lean_ms:.1f} ms: "
                  f"{lean_ms / ours_ms:.1f}x; writes {output_bytes / 1e6:.1f} MB: {output_bytes / ours_ms / 1e6:.2f} "
                  f"GB/s vs copy {output_bytes / fresh_ms / 1e6:.2f} GB/s into fresh tensors "
                  f"({output_bytes / mapped_ms / 1e6:.2f} GB/s into mapped memory); "
                  f"padding {(ours_padded - real) / ours_padded:.2%} "
                  f"vs {(rule_padded - real) / rule_padded:.2%} with tp*cp*2={rule} per seq"),
    }


# ---------------------------------------------------------------------------------------
# forward+backward: packed THD forward_logprobs (CP 1 and 2) vs a padded bshd batch
# ---------------------------------------------------------------------------------------

TRAIN_BATCH_SIZES = (24, 64, 128)
# The batch whose tokens/s CP=2 is measured on (against CP=1), in CP_ROUNDS rounds of a
# CP=1 then a CP=2 measurement, each config's fastest round counting: this machine's speed
# drifts by 20-30% over minutes, so one CP=1 run minutes before one CP=2 run compares drift.
CP_BATCH_SIZE = 64
CP_ROUNDS = 3
TRAIN_MIN_LENGTH = 16
TRAIN_MAX_LENGTH = 256
# Lognormal lengths, median 64 tokens: most responses short, a tail up to the cap, as in RL rollouts.
TRAIN_LOG_LENGTH_MEAN = 4.16
TRAIN_LOG_LENGTH_STD = 0.7
TRAIN_WARMUP = 1
TRAIN_REPEATS = 3
ENTROPY_COEFFICIENT = 0.01
# fp32 on CPU, the same math in two layouts (the suite's forward tolerance).
LAYOUT_TOLERANCE = 1e-5
# attention scaling: B sequences of one length, smallest and largest B. Attention whose
# work is per sequence makes the step time grow like B; a dense [T, T] mask, like B^2.
SCALING_LENGTH = 64
SCALING_BATCH_SIZES = (8, 96)
SCALING_REPEATS = 5


def training_batch(vocab_size, num_sequences=TRAIN_BATCH_SIZES[0]):
    """(input_ids [T] int64, seqlens [B] int64), the same in every process."""
    generator = torch.Generator().manual_seed(0)
    log_lengths = torch.randn(num_sequences, generator=generator) * TRAIN_LOG_LENGTH_STD + TRAIN_LOG_LENGTH_MEAN
    seqlens = log_lengths.exp().round().long().clamp(TRAIN_MIN_LENGTH, TRAIN_MAX_LENGTH)
    input_ids = torch.randint(0, vocab_size, (int(seqlens.sum()),), generator=generator)
    return input_ids, seqlens


def surrogate_loss(logprobs, entropy, mask):
    """The shape of a GRPO loss: mean next-token log-prob plus an entropy bonus, over real tokens."""
    num_tokens = mask.sum().clamp(min=1)
    return -(logprobs * mask).sum() / num_tokens - ENTROPY_COEFFICIENT * (entropy * mask).sum() / num_tokens


def interleaved_step_ms(steps, repeats=TRAIN_REPEATS):
    """{name: (median wall time in ms, first result)} of zero-grad + `step()` (forward, loss,
    backward) for each name -> (model, step), the steps taking turns after warm-up rounds:
    a burst of load from other processes hits every step alike."""
    times = {name: [] for name in steps}
    first = {}
    for iteration in range(TRAIN_WARMUP + repeats):
        for name, (model, step) in steps.items():
            model.zero_grad(set_to_none=True)
            start = time.perf_counter()
            result = step()
            if iteration >= TRAIN_WARMUP:
                times[name].append(time.perf_counter() - start)
            first.setdefault(name, result)
    return {name: (1000 * statistics.median(times[name]), first[name]) for name in steps}


def thd_step(model, input_ids, seqlens, mtp_train):
    out = forward.forward_logprobs(model, input_ids, seqlens, with_entropy=True, mtp_train=mtp_train)
    surrogate_loss(out.logprobs, out.entropy, out.loss_mask).backward()
    return out


def bshd_step(model, input_ids, seqlens, mtp_train):
    """Right-padded [B, S] batch through megatron's local attention (causal); returns
    (logprobs, entropy) of the real tokens, concatenated like the packed input. With
    `mtp_train` labels and loss mask go to the model, so megatron adds the MTP loss to the
    graph; log-probs and entropy then come from the main logits its output layer made."""
    padded, positions, real, mask = pad_batch(input_ids, seqlens)
    if mtp_train:
        labels = torch.cat([padded[:, 1:], torch.zeros(len(padded), 1, dtype=torch.long)], dim=1)
        logits = forward.output_layer_logits(model, clone=True, input_ids=padded, position_ids=positions,
                                             attention_mask=None, labels=labels, loss_mask=mask)
        logits = logits.transpose(0, 1)  # [s, b, v] -> [b, s, v]
    else:
        logits = model(padded, positions, None)
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    logprobs, entropy = padded_logprobs(log_probs, padded, mask)
    surrogate_loss(logprobs, entropy, mask).backward()
    return logprobs[real].detach(), entropy[real].detach()


def check_same_outputs(thd_out, bshd_out, input_ids):
    """Raise unless a THD step and a bshd step gave the same log-probs and entropy (same weights)."""
    logprobs, entropy = bshd_out
    real = thd_out.batch.pack(torch.ones_like(input_ids)).bool()
    next_token = thd_out.loss_mask[real] > 0
    if not (torch.allclose(thd_out.logprobs[real][next_token].detach(), logprobs[next_token], rtol=0,
                           atol=LAYOUT_TOLERANCE)
            and torch.allclose(thd_out.entropy[real].detach(), entropy, rtol=0, atol=LAYOUT_TOLERANCE)):
        raise AssertionError("packed THD and padded bshd disagree: the timing would compare different work")


def measure_forward_backward(checkpoint, threads, batch_sizes, with_bshd):
    """Runs in spawned processes (one per CP rank): {(step, B): median ms} for B in `batch_sizes`.

    Steps: "thd_mtp" and "thd", forward_logprobs with entropy, with and without MTP training,
    at the world size as CP. With `with_bshd` (CP 1), also the padded bshd
    batch through megatron's local attention without and with MTP ("bshd", "bshd_mtp"),
    on the same weights, after checking that both layouts give the same log-probs.
    """
    torch.set_num_threads(threads)
    _, world_size, _ = cpu_backend.init_distributed()
    mtp_patch.patch_megatron_mtp()
    cpu_backend.init_model_parallel(context_parallel=world_size, seed=0)
    models = {"thd_mtp": build_gpt_model(checkpoint, attention="thd", context_parallel=world_size),
              "thd": build_gpt_model(checkpoint, mtp=False, attention="thd", context_parallel=world_size)}
    if with_bshd:
        models["bshd"] = build_gpt_model(checkpoint, mtp=False, attention="local")
        models["bshd_mtp"] = build_gpt_model(checkpoint, attention="local")
    for name in models:
        models[name].load_state_dict(models["thd_mtp"].state_dict(), strict=False)
    times = {}
    for num_sequences in batch_sizes:
        input_ids, seqlens = training_batch(tiny_model.VOCAB_SIZE, num_sequences)
        steps = {"thd_mtp": lambda: thd_step(models["thd_mtp"], input_ids, seqlens, mtp_train=True),
                 "thd": lambda: thd_step(models["thd"], input_ids, seqlens, mtp_train=False)}
        if with_bshd:
            steps["bshd"] = lambda: bshd_step(models["bshd"], input_ids, seqlens, mtp_train=False)
            steps["bshd_mtp"] = lambda: bshd_step(models["bshd_mtp"], input_ids, seqlens, mtp_train=True)
        results = interleaved_step_ms({name: (models[name], step) for name, step in steps.items()})
        if with_bshd:
            # The first steps ran before any optimiser could move the weights: same weights, same math.
            for thd, bshd in (("thd", "bshd"), ("thd_mtp", "bshd_mtp")):
                check_same_outputs(results[thd][1], results[bshd][1], input_ids)
        times.update({(name, num_sequences): ms for name, (ms, _) in results.items()})
    return times


def measure_attention_scaling(checkpoint, threads):
    """Runs in a spawned process: {B: median ms} of the THD step (no MTP, with entropy) on B
    sequences of SCALING_LENGTH tokens, CP 1."""
    torch.set_num_threads(threads)
    cpu_backend.init_distributed()
    mtp_patch.patch_megatron_mtp()
    cpu_backend.init_model_parallel(seed=0)
    model = build_gpt_model(checkpoint, mtp=False, attention="thd")
    steps = {}
    for num_sequences in SCALING_BATCH_SIZES:
        seqlens = torch.full((num_sequences,), SCALING_LENGTH)
        input_ids = torch.randint(0, tiny_model.VOCAB_SIZE, (int(seqlens.sum()),),
                                  generator=torch.Generator().manual_seed(0))
        steps[num_sequences] = (model, lambda input_ids=input_ids, seqlens=seqlens:
                                thd_step(model, input_ids, seqlens, mtp_train=False))
    return {num_sequences: ms for num_sequences, (ms, _) in interleaved_step_ms(steps, SCALING_REPEATS).items()}


def row_forward_backward():
    threads = torch.get_num_threads()
    with tempfile.TemporaryDirectory(prefix="bench-forward-") as directory:
        checkpoint = tiny_model.build_tiny_model(directory)
        cp1 = run_in_processes(measure_forward_backward, args=(checkpoint, threads, TRAIN_BATCH_SIZES, True))[0]
        rounds = []
        for _ in range(CP_ROUNDS):
            alone = run_in_processes(measure_forward_backward, args=(checkpoint, threads, (CP_BATCH_SIZE,), False))[0]
            # Ranks step together (collectives in every layer): the slower rank is the step time.
            split = run_in_processes(measure_forward_backward, world_size=2,
                                     args=(checkpoint, threads, (CP_BATCH_SIZE,), False))
            measured = {}
            for name in ("thd", "thd_mtp"):
                measured[(1, name)] = alone[(name, CP_BATCH_SIZE)]
                measured[(2, name)] = max(rank_times[(name, CP_BATCH_SIZE)] for rank_times in split)
            rounds.append(measured)
        fastest = {key: min(measured[key] for measured in rounds) for key in rounds[0]}
    rows = []
    for num_sequences in TRAIN_BATCH_SIZES:
        _, seqlens = training_batch(tiny_model.VOCAB_SIZE, num_sequences)
        real = int(seqlens.sum())
        padded = len(seqlens) * int(seqlens.max())
        thd, bshd = cp1[("thd", num_sequences)], cp1[("bshd", num_sequences)]
        thd_mtp, bshd_mtp = cp1[("thd_mtp", num_sequences)], cp1[("bshd_mtp", num_sequences)]
        notes = (f"tiny MiMo, {num_sequences} seqs lognormal len {int(seqlens.min())}..{int(seqlens.max())}, "
                 f"{real} real tokens vs {padded} padded bshd (padding {(padded - real) / padded:.1%}), "
                 f"+entropy, no MTP; with MTP: THD {thd_mtp:.0f} ms vs bshd {bshd_mtp:.0f} ms, "
                 f"{bshd_mtp / thd_mtp:.2f}x; CP1 {real / thd_mtp * 1000:.0f} tok/s")
        if num_sequences == CP_BATCH_SIZE:
            ratios = {name: [measured[(1, name)] / measured[(2, name)] for measured in rounds]
                      for name in ("thd_mtp", "thd")}
            cp1_mtp, cp2_mtp, cp1_plain, cp2_plain = (fastest[key] for key in ((1, "thd_mtp"), (2, "thd_mtp"),
                                                                             (1, "thd"), (2, "thd")))
            notes += (f"; CP2 vs CP1, fastest of {CP_ROUNDS} alternating rounds: with MTP CP1 "
                      f"{real / cp1_mtp * 1000:.0f} tok/s, CP2 {real / cp2_mtp * 1000:.0f} tok/s ({cp2_mtp:.0f} ms, "
                      f"2 procs x {threads} thr): {cp1_mtp / cp2_mtp:.2f}x; without MTP CP1 "
                      f"{real / cp1_plain * 1000:.0f} tok/s, CP2 {real / cp2_plain * 1000:.0f} tok/s: "
                      f"{cp1_plain / cp2_plain:.2f}x (per round: with MTP "
                      + " / ".join(f"{r:.2f}" for r in ratios["thd_mtp"]) + ", without "
                      + " / ".join(f"{r:.2f}" for r in ratios["thd"]) + ")")
        rows.append({"row": f"forward+backward {num_sequences} seqs", "ours_ms": thd, "baseline_ms": bshd,
                     "speedup": bshd / thd, "notes": notes})
    return rows


# MoE forward+backward at expert parallel 1 vs 2: 2 processes, each with its own batch (data
# parallel), the experts whole on each rank or split between them; MOE_ROUNDS alternating
# rounds (the layout needs megatron's parallel groups rebuilt), each config's fastest counting.
MOE_BATCH_SIZE = 24
MOE_ROUNDS = 3


def measure_moe_expert_parallel(checkpoint, threads, expert_parallel):
    """Runs in 2 spawned processes: median ms of a THD step with MTP on this rank's batch, and
    the routed-expert parameters this rank holds, at `expert_parallel`."""
    torch.set_num_threads(threads)
    cpu_backend.init_distributed()
    mtp_patch.patch_megatron_mtp()
    cpu_backend.init_model_parallel(expert_parallel=expert_parallel, seed=0)
    model = build_gpt_model(checkpoint, attention="thd", expert_parallel=expert_parallel)
    hf_weights.load_hf_into_megatron(model, checkpoint)
    input_ids, seqlens = training_batch(tiny_model.VOCAB_SIZE, MOE_BATCH_SIZE)
    # Data parallel: each rank its own sequences (the same lengths, other tokens).
    input_ids = (input_ids + dist.get_rank()) % tiny_model.VOCAB_SIZE
    (ms, _), = interleaved_step_ms({"moe": (model, lambda: thd_step(model, input_ids, seqlens, mtp_train=True))}
                                   ).values()
    experts = sum(param.numel() for name, param in model.named_parameters() if hf_weights.ROUTED_EXPERT.search(name))
    return ms, experts, int(seqlens.sum())


def row_moe_expert_parallel():
    threads = torch.get_num_threads()
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-moe-") as directory:
        for family in ("deepseek", "glm"):
            checkpoint = tiny_model.build_tiny_model(os.path.join(directory, family), family)
            rounds = []
            for _ in range(MOE_ROUNDS):
                # Ranks step together (the dispatcher's collectives): the slower rank is the step time.
                rounds.append({ep: max(run_in_processes(measure_moe_expert_parallel, world_size=2,
                                                        args=(checkpoint, threads, ep)))
                               for ep in (1, 2)})
            ep1, ep2 = (min(measured[ep][0] for measured in rounds) for ep in (1, 2))
            tokens = rounds[0][1][2]
            rows.append({"row": f"moe {family} EP 2 vs 1", "ours_ms": ep2, "baseline_ms": ep1, "speedup": ep1 / ep2,
                         "notes": (f"tiny {family} ({tiny_model.builtin_config(family)[1]['n_routed_experts']} "
                                   f"experts), forward+backward with MTP, {MOE_BATCH_SIZE} seqs ({tokens} tokens) per "
                                   f"rank, 2 procs x {threads} thr, fastest of {MOE_ROUNDS} alternating rounds (per "
                                   "round " + " / ".join(f"{m[1][0] / m[2][0]:.2f}" for m in rounds) + "); routed-"
                                   f"expert parameters per rank {rounds[0][1][1]} at EP 1, {rounds[0][2][1]} at EP 2")})
    return rows


def row_attention_scaling():
    with tempfile.TemporaryDirectory(prefix="bench-scaling-") as directory:
        checkpoint = tiny_model.build_tiny_model(directory)
        times = run_in_processes(measure_attention_scaling, args=(checkpoint, torch.get_num_threads()))[0]
    smallest, largest = SCALING_BATCH_SIZES
    growth = (times[largest] / times[smallest]) / (largest / smallest)
    return {
        "row": "attention scaling",
        "ours_ms": times[largest],
        "baseline_ms": times[smallest],
        "speedup": None,
        "notes": (f"THD forward+backward (no MTP, +entropy), B seqs of {SCALING_LENGTH} tokens, CP 1: "
                  f"B={largest} {times[largest]:.0f} ms vs B={smallest} {times[smallest]:.0f} ms; time grows "
                  f"{growth:.2f}x faster than B (1.00: linear)"),
    }


# ---------------------------------------------------------------------------------------
# optimizer step: megatron-core DDP + Adam (trainer) vs per-parameter all-reduce + torch Adam
# ---------------------------------------------------------------------------------------

OPTIMIZER_REPEATS = 7
OPTIMIZER_SEQLENS = [16, 16]  # the gradients' values do not matter, only that every parameter has one
OPTIMIZER_LR = tasks.TASKS["repeat"]["lr"]
OPTIMIZER_GRAD_CLIP = 1.0


def measure_optimizer_step(checkpoint, threads):
    """Runs in 2 spawned processes (data parallel 2): ms per gradient sync + clip + Adam step.

    Ours: trainer.build_optimizer (megatron DDP's bucketed all-reduce into fp32 main_grad
    buffers, megatron's Adam and global clip). Baseline: one all-reduce per parameter,
    torch's clip_grad_norm_ and torch.optim.Adam. Same weights; each repeat runs an
    untimed backward first.
    """
    torch.set_num_threads(threads)
    _, world_size, _ = cpu_backend.init_distributed()
    mtp_patch.patch_megatron_mtp()
    cpu_backend.init_model_parallel(seed=0)
    seqlens = torch.tensor(OPTIMIZER_SEQLENS)
    input_ids = torch.randint(0, tiny_model.VOCAB_SIZE, (int(seqlens.sum()),), generator=torch.Generator().manual_seed(0))
    model = build_gpt_model(checkpoint)
    plain = build_gpt_model(checkpoint)
    plain.load_state_dict(model.state_dict())
    # Not overlapped: the all-reduce runs inside the timed step, as the baseline's does.
    ddp_model, optimizer = trainer.build_optimizer(model, OPTIMIZER_LR, OPTIMIZER_GRAD_CLIP, overlap_grad_reduce=False)
    adam = torch.optim.Adam(plain.parameters(), lr=OPTIMIZER_LR, betas=(0.9, 0.99), eps=trainer.ADAM_EPS)

    def ours():
        ddp_model.finish_grad_sync()
        ddp_model.scale_gradients(world_size)
        with cpu_backend.cuda_on_cpu():
            optimizer.step()

    def baseline():
        for param in plain.parameters():
            dist.all_reduce(param.grad)
        torch.nn.utils.clip_grad_norm_(plain.parameters(), OPTIMIZER_GRAD_CLIP)
        adam.step()

    times = {"ours": [], "baseline": []}
    for _ in range(OPTIMIZER_REPEATS + 1):  # the first (warm-up) repeat is dropped
        ddp_model.zero_grad_buffer()
        optimizer.zero_grad()
        thd_step(model, input_ids, seqlens, mtp_train=True)
        adam.zero_grad(set_to_none=True)
        thd_step(plain, input_ids, seqlens, mtp_train=True)
        for name, step in (("ours", ours), ("baseline", baseline)):
            dist.barrier()
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
    parameters = sum(param.numel() for param in plain.parameters())
    return {name: 1000 * statistics.median(values[1:]) for name, values in times.items()}, parameters


def row_optimizer_step():
    with tempfile.TemporaryDirectory(prefix="bench-optimizer-") as directory:
        # The weight-push row's model: big enough that the step stands clear of timer noise.
        checkpoint = tiny_model.build_tiny_model(directory, **bench_runs.WEIGHT_SYNC_SIZES)
        results = run_in_processes(measure_optimizer_step, world_size=2, args=(checkpoint, torch.get_num_threads()))
    # Ranks step together (collectives): the slower rank is the step time.
    ours_ms = max(times["ours"] for times, _ in results)
    baseline_ms = max(times["baseline"] for times, _ in results)
    parameters = results[0][1]
    return {
        "row": "optimizer step",
        "ours_ms": ours_ms,
        "baseline_ms": baseline_ms,
        "speedup": baseline_ms / ours_ms,
        "notes": (f"data parallel 2 (2 processes), {parameters / 1e6:.0f}M fp32 parameters; gradient sync + clip + "
                  f"Adam: megatron-core DDP + optimizer vs per-parameter all-reduce + torch Adam; median of "
                  f"{OPTIMIZER_REPEATS}"),
    }




ROWS = {
    "pack_thd": row_pack_thd,
    "weight_sync_push": bench_runs.row_weight_sync_push,
    "forward_backward": row_forward_backward,
    "attention_scaling": row_attention_scaling,
    "optimizer_step": row_optimizer_step,
    "spec_rollout": bench_runs.row_spec_rollout,
    "draft_training": bench_runs.row_draft_training,
    "rl_drafting": bench_runs.row_rl_drafting,
    "trl_step": bench_trl.row_trl_step,
    "moe_expert_parallel": row_moe_expert_parallel,
}


def format_cell(value):
    if isinstance(value, float):
        return f"{value:.2f}"
    return "-" if value is None else str(value)


def print_table(results):
    cells = [[format_cell(result.get(column)) for column in COLUMNS] for result in results]
    widths = [max(len(column), *(len(row[i]) for row in cells)) for i, column in enumerate(COLUMNS)]
    print("  ".join(column.ljust(width) for column, width in zip(COLUMNS, widths)))
    print("  ".join("-" * width for width in widths))
    for row in cells:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="+", choices=sorted(ROWS), default=list(ROWS),
                        help="rows to run (default: all)")
    parser.add_argument("--trl-worker", metavar="OUT", default=None,
                        help="internal (trl_step): run TRL's GRPOTrainer on the default run's work into OUT and exit")
    parser.add_argument("--threads", type=int, default=DEFAULT_THREADS, help="torch intra-op threads")
    parser.add_argument("--spec-checkpoint", default=None,
                        help="spec_rollout: a MiMo checkpoint with a trained MTP head; default: the final policy of "
                             f"train_grpo.py {' '.join(bench_runs.SPEC_TRAIN_FLAGS)}, trained once into "
                             f"{bench_runs.SPEC_RUN_DIR}")
    args = parser.parse_args()
    if args.trl_worker is not None:
        return bench_trl.trl_worker(args.trl_worker)
    if args.spec_checkpoint is not None and not os.path.isfile(os.path.join(args.spec_checkpoint, "config.json")):
        parser.error(f"--spec-checkpoint {args.spec_checkpoint!r}: no config.json there; expected a HF checkpoint dir")
    rows = dict(ROWS, spec_rollout=lambda: bench_runs.row_spec_rollout(args.spec_checkpoint))
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads", file=sys.stderr)
    results = []
    for number, name in enumerate(args.rows, 1):
        print(f"[{number}/{len(args.rows)}] {name} ...", file=sys.stderr, flush=True)
        start = time.perf_counter()
        result = rows[name]()
        results.extend(result if isinstance(result, list) else [result])
        print(f"[{number}/{len(args.rows)}] {name} done in {time.perf_counter() - start:.1f}s", file=sys.stderr,
              flush=True)
    print_table(results)


if __name__ == "__main__":
    main()
