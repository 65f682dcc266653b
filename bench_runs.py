"""End-to-end rows of bench.py: the weight push into a vLLM engine, whole train_grpo.py
runs, vLLM engines on a trained policy (TRL's runs: bench_trl.py).

    .venv/bin/python bench.py --rows weight_sync_push spec_rollout draft_training rl_drafting

bench.py holds the CLI and the micro rows and runs these rows by name. A row here
launches `train_grpo.py` under torchrun (its checkpoints and metrics cached under runs/),
then reports ratios from their timings and draws the figures in docs/. `spec_rollout`
measures vLLM engines on a checkpoint such a run trained, and `weight_sync_push` times
vllm_sync's bucketed push against a naive one, each in a spawned process.

Imports torch and the project's cpu_backend, draft_tuner, grpo_loss, hf_weights, megatron_model,
rollout, run_log, spec_config, tasks, tiny_model, vllm_sync and harness; vLLM, matplotlib
and transformers inside the rows that need them.
"""

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch

import cpu_backend
import draft_tuner
import grpo_loss
import hf_weights
import rollout
import run_log
import spec_config
import tasks
import tiny_model
import vllm_sync
from harness import REPO_DIR, VLLM_ENV, run_in_processes
from megatron_model import build_gpt_model

FIGURES_DIR = os.path.join(REPO_DIR, "docs")


# ---------------------------------------------------------------------------------------
# weight sync push: bucketed push_to_vllm vs a naive full-state-dict push
# ---------------------------------------------------------------------------------------

# Big enough that the weights (~300 MiB fp32) stand well clear of allocator noise.
WEIGHT_SYNC_SIZES = dict(hidden_size=1024, num_layers=4, num_heads=16, num_kv_heads=4, head_dim=64,
                         ffn_hidden_size=4096, num_mtp_layers=1)
WEIGHT_SYNC_BUCKET_BYTES = 32 * 2**20
WEIGHT_SYNC_REPEATS = 5
MIB = 2**20


def status_bytes(field):
    """A memory field of /proc/self/status (VmRSS: resident now, VmHWM: resident peak), in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def seconds_and_peak_bytes(push):
    """(seconds, peak resident bytes above the start) of one call of `push`.

    The peak is floored at 0: resident memory can end below the start when the allocator
    returns pages freed during the call.
    """
    # Writing 5 to clear_refs resets the process's resident high-water mark (Linux >= 4.0).
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    start_bytes = status_bytes("VmRSS")
    start = time.perf_counter()
    push()
    return time.perf_counter() - start, max(0, status_bytes("VmHWM") - start_bytes)


def naive_push(model, llm):
    """The baseline: materialise the whole HF state dict, then hand it to vLLM in one piece per model.

    Without tensor parallelism `megatron_to_hf` yields views of the parameters; the copy
    here stands for the one any real full-state-dict export makes (tensor-parallel
    gather, device-to-host move, dtype cast).
    """
    for layers, start in (("main", llm.start_weight_update), ("mtp", llm.start_draft_weight_update)):
        state_dict = {name: tensor.clone() for name, tensor in hf_weights.megatron_to_hf(model, layers)}
        start()
        llm.update_weights({"update_info": {"weights": list(state_dict.items())}})
        llm.finish_weight_update()
        del state_dict


def measure_weight_sync_push(threads):
    """Runs in a spawned process: (seconds, peak bytes) per repeat for both pushes, and the model size.

    Tiny MiMo scaled to hidden 1024 / 4 layers + 1 MTP layer (fp32), tensor parallel 1, an
    in-process vLLM-CPU engine with MTP drafting. The two pushes alternate.
    """
    from vllm import LLM  # after VLLM_ENV is in the environment
    torch.set_num_threads(threads)
    cpu_backend.init_distributed()
    cpu_backend.init_model_parallel(tensor_parallel=1)
    with tempfile.TemporaryDirectory(prefix="bench-weight-sync-") as directory:
        checkpoint = tiny_model.build_tiny_model(directory, **WEIGHT_SYNC_SIZES)
        model = build_gpt_model(checkpoint)
        hf_weights.load_hf_into_megatron(model, checkpoint)
        llm = LLM(model=checkpoint, dtype="float32", max_model_len=256, seed=0, enforce_eager=True,
                  kv_cache_memory_bytes=2**26, speculative_config={"method": "mtp", "num_speculative_tokens": 1},
                  weight_transfer_config=vllm_sync.in_process_weight_transfer_config())
        model_bytes = sum(tensor.numel() * tensor.element_size() for _, tensor in hf_weights.megatron_to_hf(model))
        bucketed, naive = [], []
        for _ in range(WEIGHT_SYNC_REPEATS):
            bucketed.append(seconds_and_peak_bytes(
                lambda: vllm_sync.push_to_vllm(model, llm, WEIGHT_SYNC_BUCKET_BYTES)))
            naive.append(seconds_and_peak_bytes(lambda: naive_push(model, llm)))
    return bucketed, naive, model_bytes


def row_weight_sync_push():
    # The fastest time is the one least disturbed by other processes; the peak is a median.
    bucketed, naive, model_bytes = run_in_processes(measure_weight_sync_push, args=(torch.get_num_threads(),),
                                                    env=VLLM_ENV)[0]
    push_ms = 1000 * min(seconds for seconds, _ in bucketed)
    naive_ms = 1000 * min(seconds for seconds, _ in naive)
    push_peak = statistics.median(peak for _, peak in bucketed)
    naive_peak = statistics.median(peak for _, peak in naive)
    return {
        "row": "weight sync push",
        "ours_ms": push_ms,
        "baseline_ms": naive_ms,
        "speedup": naive_ms / push_ms,
        "notes": (f"{model_bytes / MIB:.0f} MiB fp32 model, {WEIGHT_SYNC_BUCKET_BYTES // MIB} MiB buckets, "
                  f"min of {WEIGHT_SYNC_REPEATS}; peak extra RSS {push_peak / MIB:.0f} MiB vs naive "
                  f"{naive_peak / MIB:.0f} MiB (ratio {push_peak / max(naive_peak, 1):.2f})"),
    }


# Processes of a train_grpo.py run (torchrun's), each with its own vLLM engine.
RUN_PROCESSES = 2


def train_grpo_run(out, flags):
    """train_grpo.py under torchrun (RUN_PROCESSES processes) into `out` unless it finished
    there before; returns its metrics.jsonl records."""
    if not os.path.exists(os.path.join(out, "final", "model.safetensors")):
        print(f"training {out}: train_grpo.py {' '.join(flags)}", file=sys.stderr, flush=True)
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(RUN_PROCESSES),
                        "train_grpo.py",
                        "--out", out, "--resume", "never", *flags], cwd=REPO_DIR, check=True)
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


# ---------------------------------------------------------------------------------------
# spec_rollout: MTP drafting vs none, on a checkpoint train_grpo.py trained
# ---------------------------------------------------------------------------------------

# `torchrun --nproc_per_node 2 train_grpo.py --task count --steps 80` writes this (cached:
# trained once when missing); its policy counts and its MTP head drafts it.
SPEC_TRAIN_FLAGS = ("--task", "count", "--steps", "80")
SPEC_RUN_DIR = os.path.join(REPO_DIR, "runs", "bench-count")
SPEC_CONCURRENCIES = (1, 8, 64, 256)
SPEC_MAX_DRAFT_TOKENS = 3
SPEC_NEW_TOKENS = 64
SPEC_TEMPERATURE = 1.0
SPEC_REPEATS = 9
SPEC_SEED_STRIDE = 1_000_003
# Room for 256 sequences of 70 tokens in each of the five engines' KV caches.
SPEC_KV_CACHE_BYTES = 2**28
SPEC_HEATMAP = os.path.join(FIGURES_DIR, "spec_rollout_cpu.png")
SPEC_PROCESS_TIMEOUT_SECONDS = 3600


def spec_checkpoint(checkpoint):
    """`checkpoint`, or the cached final policy of SPEC_TRAIN_FLAGS' run (trained when missing)."""
    if checkpoint is not None:
        return checkpoint
    train_grpo_run(SPEC_RUN_DIR, SPEC_TRAIN_FLAGS)
    return os.path.join(SPEC_RUN_DIR, "final")


def spec_engines(checkpoint):
    """(fixed: {k: engine drafting k, 0: none}, the dynamic drafting engine auto switches,
    meters by k, the dynamic engine's meter)."""
    from vllm import LLM
    options = dict(model=checkpoint, dtype="float32", enforce_eager=True, seed=0, disable_log_stats=False,
                   max_model_len=1024, kv_cache_memory_bytes=SPEC_KV_CACHE_BYTES)

    def drafting(config):
        return LLM(**options, speculative_config=config, per_request_spec_decode_metrics="summary")

    fixed = {0: LLM(**options)}
    for draft_tokens in range(1, SPEC_MAX_DRAFT_TOKENS + 1):
        fixed[draft_tokens] = drafting(spec_config.build_mtp_speculative_config("mtp", draft_tokens))
    dynamic = drafting(spec_config.dynamic_speculative_config(
        spec_config.build_mtp_speculative_config("mtp", SPEC_MAX_DRAFT_TOKENS)))
    meters = {k: spec_config.SpecDecodeMeter(engine) for k, engine in fixed.items() if k}
    return fixed, dynamic, meters, spec_config.SpecDecodeMeter(dynamic)


def seeded_params(count, rollout):
    """One seed per (rollout, sequence): every engine's rollout number r draws the same
    random numbers, so two engines at the same k sample the same tokens and accept the
    same drafts. A sampled digit off the count makes the drafts after it miss: at 8
    sequences one such rollout in four ran 25-50% slower, unseeded."""
    from vllm import SamplingParams
    return [SamplingParams(temperature=SPEC_TEMPERATURE, max_tokens=SPEC_NEW_TOKENS, ignore_eos=True,
                           seed=rollout * SPEC_SEED_STRIDE + sequence) for sequence in range(count)]


def auto_draft_tokens(fixed, dynamic, dynamic_meter, prompts):
    """auto as train_grpo runs it (draft_tuner's plan and after_rollout): rollouts at the
    variant the tuner names until it settles (its first tries measure the acceptance, the
    check is for later); returns
    (the k it settles on at this concurrency, which `dynamic` is left set to, its draft
    layer idle where no band drafts; each try's variant at this concurrency in order,
    "plain" or a k; the tuner)."""
    from vllm import SamplingParams
    check_params = SamplingParams(temperature=SPEC_TEMPERATURE, max_tokens=draft_tuner.ACCEPTANCE_CHECK_TOKENS,
                                  ignore_eos=True)

    def check():
        spec_config.set_draft_tokens(dynamic, SPEC_MAX_DRAFT_TOKENS)
        return dynamic_meter.read(dynamic.generate(prompts, check_params, use_tqdm=False))

    tuner = draft_tuner.DraftTuner(SPEC_MAX_DRAFT_TOKENS, len(spec_config.BAND_EDGES))
    band_meter = spec_config.BandMeter(dynamic)
    # Neither a second check nor a second round of tries falls in the rollouts measured here.
    planning = dict(check_every=10**9, tune_every=10**9)
    schedule, _ = rollout.plan_draft_tokens(tuner, dynamic, 1, check, drafting=False, **planning)
    tried, own_band = [], spec_config.band_of(len(prompts))  # every engine step here decodes all the prompts
    while tuner.exploring():
        tried.append(draft_tuner.PLAIN if schedule is None else schedule[own_band])
        band_meter.read()
        _, outputs = rollout_tokens_per_second(dynamic, prompts, seeded_params(len(prompts), SPEC_REPEATS + len(tried)))
        drafting = schedule is not None and any(schedule)
        tuner.after_rollout(schedule, {band: (counts["tokens"], counts["seconds"])
                                       for band, counts in band_meter.read().items()},
                            dynamic_meter.read(outputs) if drafting else None)
        schedule, _ = rollout.plan_draft_tokens(tuner, dynamic, 1 + len(tried), check, drafting=drafting, **planning)
    return (schedule[own_band] if schedule else 0), tried, tuner


def measure_spec_rollout(checkpoint, threads):
    """Runs in a spawned process: per concurrency B, tokens/s of the same rollout (the
    count task's training prompts, temperature 1, SPEC_NEW_TOKENS tokens, no EOS) with
    k = 0 (an engine without drafting), k = 1..3 (an engine each) and auto (one dynamic
    drafting engine, k chosen by `auto_draft_tokens`), each the median of
    SPEC_REPEATS interleaved runs; the k = 3 engine's acceptance per depth; auto's tries,
    choice and seconds to choose."""
    from transformers import AutoTokenizer
    torch.set_num_threads(threads)
    spec_config.fix_cpu_draft_sampling()
    fixed, dynamic, meters, dynamic_meter = spec_engines(checkpoint)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    training_prompts = tasks.TASKS["count"]["train"]
    results, started = {}, time.perf_counter()
    for concurrency in SPEC_CONCURRENCIES:
        prompts = [{"prompt_token_ids": tokenizer.encode(f"count:{training_prompts[i % len(training_prompts)]}")}
                   for i in range(concurrency)]
        # As in training, the engine has rolled out at this concurrency before (its first
        # rollout is slower).
        rollout_tokens_per_second(dynamic, prompts, seeded_params(concurrency, 0))
        start = time.perf_counter()
        auto, tried, tuner = auto_draft_tokens(fixed, dynamic, dynamic_meter, prompts)
        tune_seconds = time.perf_counter() - start
        runs = dict(fixed, auto=dynamic)
        speeds = {name: [] for name in runs}
        for repeat in range(SPEC_REPEATS + 1):  # the first round warms up
            for name, engine in runs.items():
                speed, outputs = rollout_tokens_per_second(engine, prompts, seeded_params(concurrency, repeat))
                counts = meters[name].read(outputs) if name in meters else None
                if repeat:
                    speeds[name].append(speed)
                if repeat and name == SPEC_MAX_DRAFT_TOKENS:
                    by_depth = draft_tuner.acceptance_by_depth(counts)
        results[concurrency] = {"tokens_per_s": {name: statistics.median(v) for name, v in speeds.items()},
                                "acceptance_by_depth": by_depth, "auto": auto,
                                "auto_tried": tried, "auto_realized": auto_band_speedups(tuner, concurrency),
                                "tune_s": tune_seconds}
        print(f"spec_rollout: {concurrency} seqs measured, {time.perf_counter() - started:.0f} s so far", file=sys.stderr,
              flush=True)
    return results


def auto_band_speedups(tuner, concurrency):
    """The tries' mean tokens/s at `concurrency`'s band, per variant (plain, k = 0, 1, ...),
    relative to the plain engine's; None where a variant was not tried."""
    band = spec_config.band_of(concurrency)
    plain = tuner.band_speeds(draft_tuner.PLAIN)[band] if draft_tuner.PLAIN in tuner.realized else None
    if not plain:
        return None
    return {str(variant): (tuner.band_speeds(variant)[band] or 0.0) / plain for variant in tuner.realized}


def rollout_tokens_per_second(engine, prompts, params):
    """(new tokens per second of one rollout of `prompts`, its RequestOutputs)."""
    start = time.perf_counter()
    outputs = engine.generate(prompts, params, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outputs) / (time.perf_counter() - start), outputs


def plot_spec_heatmap(results, path):
    """Tokens/s relative to no drafting: a row per k (and auto), a column per concurrency."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = list(range(SPEC_MAX_DRAFT_TOKENS + 1)) + ["auto"]
    ratios = [[results[b]["tokens_per_s"][name] / results[b]["tokens_per_s"][0] for b in SPEC_CONCURRENCIES]
              for name in names]
    figure, axis = plt.subplots(figsize=(6, 3.6))
    image = axis.imshow(ratios, cmap="RdYlGn", vmin=0.5, vmax=2.5, aspect="auto")
    for row, values in enumerate(ratios):
        for column, value in enumerate(values):
            label = f"{value:.2f}x" + (f"\nk={results[SPEC_CONCURRENCIES[column]]['auto']}" if names[row] == "auto" else "")
            axis.text(column, row, label, ha="center", va="center", fontsize=8)
    axis.set_xticks(range(len(SPEC_CONCURRENCIES)), [str(b) for b in SPEC_CONCURRENCIES])
    axis.set_yticks(range(len(names)), [f"k={name}" if name != "auto" else "auto" for name in names])
    axis.set_xlabel("concurrent sequences")
    axis.set_title("rollout tokens/s vs no drafting (MTP draft, 16-layer tiny MiMo, CPU)", fontsize=9)
    figure.colorbar(image)
    figure.tight_layout()
    figure.savefig(path, dpi=100)


def row_spec_rollout(checkpoint=None):
    checkpoint = spec_checkpoint(checkpoint)
    results = run_in_processes(measure_spec_rollout, args=(checkpoint, torch.get_num_threads()), env=VLLM_ENV,
                               timeout=SPEC_PROCESS_TIMEOUT_SECONDS)[0]
    plot_spec_heatmap(results, SPEC_HEATMAP)
    rows = []
    for concurrency, result in results.items():
        speeds = result["tokens_per_s"]
        best = max(range(1, SPEC_MAX_DRAFT_TOKENS + 1), key=lambda k: speeds[k])
        best_fixed = max(range(SPEC_MAX_DRAFT_TOKENS + 1), key=lambda k: speeds[k])
        rows.append({
            "row": f"spec_rollout {concurrency} seqs", "ours_ms": None, "baseline_ms": None,
            "speedup": speeds[best] / speeds[0],
            "notes": ("tokens/s k=0..3: " + " / ".join(f"{speeds[k]:.0f}" for k in range(SPEC_MAX_DRAFT_TOKENS + 1))
                      + f"; best k={best} {speeds[best] / speeds[0]:.2f}x no drafting; auto: "
                      + f"tried k={','.join(map(str, result['auto_tried'])) or '-'} (fastest "
                      + (", ".join(f"{variant} {speed:.2f}" for variant, speed in result["auto_realized"].items())
                         if result["auto_realized"] else "-")
                      + f"x), chose k={result['auto']} in {result['tune_s']:.1f} s: "
                      f"{speeds['auto']:.0f} tok/s, {speeds['auto'] / speeds[best_fixed]:.2f}x the best fixed k, "
                      f"{speeds['auto'] / speeds[0]:.2f}x no drafting; acceptance by depth (k=3) "
                      + "/".join(f"{a:.2f}" for a in result["acceptance_by_depth"]))})
    rows.append({"row": "spec_rollout heat map", "ours_ms": None, "baseline_ms": None, "speedup": None,
                 "notes": f"{SPEC_HEATMAP} (checkpoint {checkpoint})"})
    return rows


# ---------------------------------------------------------------------------------------
# draft_training: the MTP head trained online vs frozen vs no drafting, end to end
# ---------------------------------------------------------------------------------------

# The initial policy counts in twos, half learnt (45 steps: entropy 1.9 nats per token), its
# MTP head trained alongside: a head that drafts the initial policy as well as its entropy
# allows. RL then teaches counting in ones, a move away from that head like the one an RL
# run makes from its SFT model (from a fully learnt two-step policy, entropy 0.1, RL did
# not find the one-step rule in 100 steps). The three runs start from the same checkpoint
# and seed, at a concurrency where drafting pays (--prompts-per-step 8: 64 per engine). The
# initial policy rolls out without drafting (its head trains all the same), so it depends
# on the seed alone: under auto its samples would depend on what the timings chose.
DRAFT_STAGE1_FLAGS = ("--task", "count", "--count-step", "2", "--steps", "45", "--no-mtp-rollout")
DRAFT_STAGE2_FLAGS = ("--task", "count", "--steps", "80", "--prompts-per-step", "8", "--num-speculative-tokens", "3")
DRAFT_VARIANTS = {"online": (), "frozen": ("--no-mtp-train",), "none": ("--no-mtp-rollout",)}
DRAFT_RUN_DIR = os.path.join(REPO_DIR, "runs", "bench-draft-training")
DRAFT_LAST_FRACTION = 0.2
DRAFT_REWARD_TARGET = 0.9
DRAFT_PLOT = os.path.join(FIGURES_DIR, "draft_training_cpu.png")


def plot_draft_training(runs, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    figure, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for name, records in runs.items():
        steps = [r["step"] for r in records]
        axes[0].plot(steps, [r["reward_mean"] for r in records], label=name)
        axes[1].plot(steps, [r["acceptance_rate"] for r in records], label=name)
        axes[2].plot(steps, [r["rollout_tokens_per_s"] for r in records], label=name)
    for axis, label in zip(axes, ("mean reward", "draft acceptance (3 draft tokens)", "rollout tokens/s")):
        axis.set_xlabel("step")
        axis.set_ylabel(label)
        axis.grid(alpha=0.3)
        axis.legend()
    figure.suptitle("count in ones, from a policy that counts in twos: MTP head trained online / frozen / no drafting",
                    fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=100)


def row_draft_training():
    stage1 = train_grpo_run(os.path.join(DRAFT_RUN_DIR, "stage1"), DRAFT_STAGE1_FLAGS)
    initial = os.path.join(DRAFT_RUN_DIR, "stage1", "final")
    runs = {name: train_grpo_run(os.path.join(DRAFT_RUN_DIR, name), ("--model", initial, *DRAFT_STAGE2_FLAGS, *extra))
            for name, extra in DRAFT_VARIANTS.items()}
    plot_draft_training(runs, DRAFT_PLOT)
    rows = []
    for name, records in runs.items():
        last = records[-max(1, round(DRAFT_LAST_FRACTION * len(records))):]
        accepted = [r["acceptance_rate"] for r in last if r["acceptance_rate"] is not None]
        reached = next((r["step"] for r in records if r["reward_mean"] >= DRAFT_REWARD_TARGET), None)
        rows.append({
            "row": f"draft_training {name}", "ours_ms": 1000 * statistics.mean(r["rollout_s"] for r in records),
            "baseline_ms": None, "speedup": None,
            "notes": (f"rollout {statistics.mean(r['rollout_tokens_per_s'] for r in records):.0f} tok/s mean over "
                      f"{len(records)} steps; acceptance first step "
                      + (f"{records[0]['acceptance_rate']:.3f}" if records[0]["acceptance_rate"] is not None else "-")
                      + f", last {len(last)} steps " + (f"{statistics.mean(accepted):.3f}" if accepted else "-")
                      + f"; reward {records[-1]['reward_mean']:.3f} at the last step, >= {DRAFT_REWARD_TARGET} from "
                      f"step {reached}; initial policy (count in twos) reward {stage1[-1]['reward_mean']:.3f}, "
                      f"acceptance {stage1[-1]['acceptance_rate']}")})
    rows.append({"row": "draft_training plot", "ours_ms": None, "baseline_ms": None, "speedup": None,
                 "notes": DRAFT_PLOT})
    return rows


# ---------------------------------------------------------------------------------------
# rl_drafting: one RL run with drafting (auto) against the same run without, taking turns
# ---------------------------------------------------------------------------------------

# The tail task (response lengths lognormal, as real RL's) from its supervised warm start
# (warm_start.py, built once before the timed runs): the same run, seed and flags with
# drafting (auto) and with --no-mtp-rollout, RL_ROUNDS times, their order swapped each round.
# The oracle, in the first round: the same run at each fixed k; per band of live batch sizes
# the fastest of them and none, in hindsight, times the none run's tokens in that band.
RL_FLAGS = ("--task", "tail")
RL_VARIANTS = {"drafting": (), "none": ("--no-mtp-rollout",)}
RL_ORACLE_VARIANTS = {f"k={k}": ("--num-speculative-tokens", str(k))
                      for k in range(1, tasks.TASKS["tail"]["max_draft_tokens"] + 1)}
RL_ROUNDS = 3
RL_RUN_DIR = os.path.join(REPO_DIR, "runs", "bench-rl-drafting")
RL_PLOT = os.path.join(FIGURES_DIR, "rl_drafting_cpu.png")


def rl_phase_seconds(records, phases):
    return sum(r[f"{phase}_s"] for r in records for phase in phases)


def rl_band_totals(records):
    """{band label: (tokens, seconds)} summed over a run's rollouts (every engine's)."""
    totals = {}
    for record in records:
        for label, band in (record.get("bands") or {}).items():
            tokens, seconds = totals.get(label, (0, 0.0))
            totals[label] = (tokens + band["tokens"], seconds + band["seconds"])
    return totals


def rl_equal_work_gain(drafting, none):
    """(the drafting run's engine seconds, the none run's on the same work, the ratio): a
    drafting run samples other responses than none (rejection sampling draws its own random
    numbers), so the two runs' rollouts do different work, the longest responses most. The
    drafting run's tokens per band at the none run's seconds per token in that band is
    what none would have taken on the drafting run's responses. A band none never decoded
    has no price: both sums leave it out."""
    drafted, plain = rl_band_totals(drafting), rl_band_totals(none)
    priced = {label: counts for label, counts in drafted.items() if plain.get(label, (0, 0.0))[0]}
    engine = sum(seconds for _, seconds in priced.values())
    equivalent = sum(tokens * plain[label][1] / plain[label][0] for label, (tokens, _) in priced.items())
    return engine, equivalent, equivalent / engine


def rl_oracle_speedup(none, fixed_runs, engines):
    """The rollout phase's gain of the best fixed k per band in hindsight: the none run's
    rollout phase over the same with each band's seconds at the fastest speed (tokens/s)
    any of `fixed_runs` (k = 1, 2, ...) or none ran that band at; at least each fixed run's
    own measured gain (one k everywhere is a per-band schedule too). The bands' seconds are
    summed over the `engines` engines that decode side by side, and the estimate saves
    their mean, while the phase waits for the slowest engine: a fixed run that drafts in
    every band can measure more than the estimate."""
    phase = rl_phase_seconds(none, ("tune", "rollout"))
    saved = 0.0
    speeds = [rl_band_totals(records) for records in fixed_runs]
    for label, (tokens, seconds) in rl_band_totals(none).items():
        fastest = max([tokens / seconds] + [run[label][0] / run[label][1] for run in speeds
                                            if label in run and run[label][1] > 0])
        saved += seconds - tokens / fastest
    measured = [phase / rl_phase_seconds(records, ("tune", "rollout")) for records in fixed_runs]
    return max([phase / (phase - saved / engines)] + measured)


# auto replayed on the first round's measured bands, many seeds: DraftTuner as train_grpo
# drives it, each try's band measured by a random step of the run at that band's k (PLAIN
# and k = 0 from the none run, k = 0 paying REPLAY_K0_COST more for the draft layer's
# forward), the rollouts after the tries at each band's pooled speed. It separates the
# choice from the machine's drift, which moves whole runs by as much as the choices differ.
REPLAY_SEEDS = 40
REPLAY_K0_COST = 1.05


def rl_tuner_replay(none, fixed_runs, seeds=REPLAY_SEEDS):
    """(auto's mean gain in rollout time over PLAIN across `seeds` replays of len(none)
    rollouts, tries included; the per-band oracle's gain at the pooled speeds). `none` and
    `fixed_runs` (k = 1, 2, ...) are records; each rollout's time is its bands' seconds."""
    import random
    plain = [(record["bands"], 1.0) for record in none if record.get("bands")]
    runs = {draft_tuner.PLAIN: plain, 0: [(bands, REPLAY_K0_COST) for bands, _ in plain]}
    runs.update({k: [(r["bands"], 1.0) for r in records if r.get("bands")] for k, records in enumerate(fixed_runs, 1)})
    labels = [spec_config.band_label(band) for band in range(len(spec_config.BAND_EDGES))]
    band_totals = {draft_tuner.PLAIN: rl_band_totals(none), 0: rl_band_totals(none),
                   **{k: rl_band_totals(records) for k, records in enumerate(fixed_runs, 1)}}
    pooled = {k: [totals[label][0] / (totals[label][1] * (REPLAY_K0_COST if k == 0 else 1.0)) if label in totals
                  else None for label in labels] for k, totals in band_totals.items()}
    tokens = [band_totals[draft_tuner.PLAIN].get(label, (0, 0.0))[0] / len(plain) for label in labels]

    def seconds(schedule):
        return sum(count / (pooled[draft_tuner.PLAIN if schedule is None else schedule[band]][band] or 1.0)
                   for band, count in enumerate(tokens) if count)

    acceptance = rl_acceptance_by_depth(fixed_runs[-1])
    statistics_at_k = {"num_drafts": 10**6, "num_draft_tokens": 10**6 * len(acceptance),
                       "accepted_per_position": [round(10**6 * a) for a in acceptance]}
    gains = []
    for seed in range(seeds):
        rng, tuner, total = random.Random(seed), draft_tuner.DraftTuner(len(fixed_runs), len(labels)), 0.0
        tuner.observe(statistics_at_k)
        tuner.try_each()
        for _ in range(len(none)):
            schedule = tuner.choose()
            if not tuner.exploring():
                total += seconds(schedule)
                continue
            counts = {}
            for band, label in enumerate(labels):
                rows = [(b[label], cost) for b, cost in runs[draft_tuner.PLAIN if schedule is None else schedule[band]]
                        if label in b]
                if rows and tokens[band]:
                    band_counts, cost = rng.choice(rows)
                    counts[band] = (band_counts["tokens"], band_counts["seconds"] * cost)
            tuner.record(counts)
            total += sum(seconds for _, seconds in counts.values())
        gains.append(len(none) * seconds(None) / total)
    oracle = [max((k for k in pooled if k != draft_tuner.PLAIN and pooled[k][band]), key=lambda k: pooled[k][band],
                  default=0) for band in range(len(labels))]
    return statistics.mean(gains), seconds(None) / min(seconds(oracle), seconds(None))


def rl_acceptance_by_depth(records):
    """The mean A_1..A_k over a run's drafting rollouts at their deepest k; [] without."""
    rows = [r["acceptance_by_depth"] for r in records if r["acceptance_by_depth"]]
    depth = max((len(row) for row in rows), default=0)
    return [statistics.mean(row[i] for row in rows if len(row) > i) for i in range(depth)]


def plot_rl_drafting(rounds, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    figure, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for number, runs in enumerate(rounds, 1):
        for name, records in runs.items():
            style = dict(color="C0" if name == "drafting" else "C1", alpha=0.4 + 0.2 * number,
                         label=f"{name}, round {number}")
            steps = [r["step"] for r in records]
            axes[0].plot(steps, [r["reward_mean"] for r in records], **style)
            evaluated = [r for r in records if "eval_accuracy" in r]
            axes[1].plot([r["step"] for r in evaluated], [r["eval_accuracy"] for r in evaluated], marker="o", **style)
            axes[2].plot(steps, [r["tune_s"] + r["rollout_s"] for r in records], **style)
    for axis, label in zip(axes, ("mean reward", "held-out accuracy", "rollout + tune seconds")):
        axis.set_xlabel("step")
        axis.set_ylabel(label)
        axis.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    figure.suptitle(f"tail task, 2 processes, {tasks.TASKS['tail']['prompts_per_step']} prompts x "
                    f"{grpo_loss.RewardConfig.group_size} completions per engine, from its warm start: drafting by "
                    "live batch size (auto) vs none", fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=100)


def rl_round(number, variants):
    """One round: each of `variants` (name -> flags) run fresh, in this round's order;
    returns ({name: its records}, {name: its whole process's seconds, launch to exit})."""
    names = list(variants) if number % 2 else list(reversed(variants))
    runs, walls = {}, {}
    for name in names:
        out = os.path.join(RL_RUN_DIR, f"round{number}", name)
        shutil.rmtree(out, ignore_errors=True)
        started = time.perf_counter()
        runs[name] = train_grpo_run(out, (*RL_FLAGS, *variants[name]))
        walls[name] = time.perf_counter() - started
    return runs, walls


def rl_tokens_per_verify_step(records):
    """1 + A_1 + ... + A_k over a run's drafting rollouts at their deepest k (each A_i
    unconditional: the share of verify steps whose first i drafts were all accepted)."""
    return 1 + sum(rl_acceptance_by_depth(records))


def rl_round_row(number, runs, walls, oracle):
    drafting, none = runs["drafting"], runs["none"]
    rollout_phase = [rl_phase_seconds(records, ("tune", "rollout")) for records in (drafting, none)]
    step = [rl_phase_seconds(records, run_log.STEP_PHASES) for records in (drafting, none)]
    train = [rl_phase_seconds(records, ("train",)) for records in (drafting, none)]
    bands = [rl_band_totals(records) for records in (drafting, none)]
    gain = rollout_phase[1] / rollout_phase[0]
    engine, equivalent, equal_work_gain = rl_equal_work_gain(drafting, none)
    last = drafting[-1]
    return {"row": f"rl_drafting round {number}", "ours_ms": 1000 * step[0], "baseline_ms": 1000 * step[1],
            "speedup": step[1] / step[0],
            "notes": (f"whole process {walls['drafting']:.0f} s vs {walls['none']:.0f} s: "
                      f"{walls['none'] / walls['drafting']:.2f}x; "
                      f"rollout phase (tune + rollout) {rollout_phase[0]:.1f} s vs {rollout_phase[1]:.1f} s: "
                      f"{gain:.2f}x (the per-band oracle {oracle:.2f}x: auto has {(gain - 1) / (oracle - 1):.0%} of its "
                      f"gain); engine steps at equal work (the drafting run's tokens per band at none's speed "
                      f"there) {engine:.1f} s vs {equivalent:.1f} s: {equal_work_gain:.2f}x; "
                      f"step {step[0]:.1f} s vs {step[1]:.1f} s; train phase {train[0]:.1f} s vs {train[1]:.1f} s "
                      f"({train[1] / train[0]:.2f}x: like work, the same prompts and about as many tokens, so far off "
                      f"1.00 is the machine's drift between the two runs); reward {drafting[-1]['reward_mean']:.3f} vs "
                      f"{none[-1]['reward_mean']:.3f} at the last step; held-out accuracy "
                      + " -> ".join(f"{r['eval_accuracy']:.2f}" for r in drafting if "eval_accuracy" in r) + " vs "
                      + " -> ".join(f"{r['eval_accuracy']:.2f}" for r in none if "eval_accuracy" in r)
                      + f"; {sum(1 for r in drafting if r['draft_tokens'])} of {len(drafting)} rollouts drafted, "
                      "acceptance by depth " + "/".join(f"{a:.2f}" for a in rl_acceptance_by_depth(drafting))
                      + f", {rl_tokens_per_verify_step(drafting):.2f} tokens per verify step; last schedule "
                      f"{last['draft_schedule']}; seconds per band (drafting/none): "
                      + ", ".join(f"{label} {bands[0].get(label, (0, 0))[1]:.1f}/{bands[1].get(label, (0, 0))[1]:.1f}"
                                  for label in sorted(set(bands[0]) | set(bands[1]),
                                                      key=lambda label: int(label.split("-")[0].rstrip("+")))))}


def row_rl_drafting():
    # The warm start is built (once) before any timed run: a step of the task, run afresh each
    # time, since a kept run would skip it while a changed warm start still waits to be built.
    warm = os.path.join(RL_RUN_DIR, "warm")
    shutil.rmtree(warm, ignore_errors=True)
    train_grpo_run(warm, (*RL_FLAGS, "--steps", "1", "--no-mtp-rollout"))
    rounds, walls = zip(*(rl_round(number, dict(RL_VARIANTS, **(RL_ORACLE_VARIANTS if number == 1 else {})))
                          for number in range(1, RL_ROUNDS + 1)))
    oracle = rl_oracle_speedup(rounds[0]["none"], [rounds[0][name] for name in RL_ORACLE_VARIANTS], RUN_PROCESSES)
    plot_rl_drafting([{name: runs[name] for name in RL_VARIANTS} for runs in rounds], RL_PLOT)
    rows = [rl_round_row(number, runs, round_walls, oracle)
            for number, (runs, round_walls) in enumerate(zip(rounds, walls), 1)]
    replayed, replayed_oracle = rl_tuner_replay(rounds[0]["none"], [rounds[0][name] for name in RL_ORACLE_VARIANTS])
    rows.append({"row": "rl_drafting auto replayed", "ours_ms": None, "baseline_ms": None, "speedup": replayed,
                 "notes": f"DraftTuner replayed on round 1's bands, {REPLAY_SEEDS} seeds: {replayed:.2f}x PLAIN's "
                          f"rollout time, tries included; the per-band oracle at the pooled speeds "
                          f"{replayed_oracle:.2f}x: {(replayed - 1) / (replayed_oracle - 1):.0%} of its gain"})
    deepest = list(RL_ORACLE_VARIANTS)[-1]
    fixed = rounds[0][deepest]
    engine, equivalent, equal_work_gain = rl_equal_work_gain(fixed, rounds[0]["none"])
    rows.append({"row": f"rl_drafting fixed {deepest}", "ours_ms": None, "baseline_ms": None, "speedup": None,
                 "notes": f"engine steps at equal work {engine:.1f} s vs {equivalent:.1f} s: {equal_work_gain:.2f}x "
                          "(round 1's none); acceptance by depth "
                          + "/".join(f"{a:.2f}" for a in rl_acceptance_by_depth(fixed))
                          + f", {rl_tokens_per_verify_step(fixed):.2f} tokens per verify step"})
    rows.append({"row": "rl_drafting plot", "ours_ms": None, "baseline_ms": None, "speedup": None, "notes": RL_PLOT})
    return rows
