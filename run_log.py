"""What a run shows and keeps: the console, metrics.jsonl, TensorBoard, W&B and the plots.

    hide_known_warnings(verbose=False)             # before megatron-core and vLLM import
    timer = PhaseTimer(); with timer("rollout"): ...
    record = step_record(step, samples, rewards, ..., timer.seconds)
    writer = open_tensorboard(out, start_step); wandb_run = open_wandb(out, project, config, start_step)
    log_step(record, metrics_path, writer, steps, seconds_so_far, steps_done, wandb_run)
    print(summary(records, seconds))
    plot_curves(records, "curves.png")

A quiet console: the stack's known-harmless warnings (megatron-core and vLLM on a machine
without Apex, Transformer Engine or Triton; vLLM's notes on its own defaults) and vLLM's
INFO lines and periodic engine statistics are hidden unless verbose; every error and any
other warning still shows. Each step is one line with its rate and ETA; metrics.jsonl
holds every value of the step (one JSON object per line), TensorBoard and Weights &
Biases the numbers, under the same names (`scalar_metrics`) at the same step.
Imports the standard library and torch; tensorboard, wandb and matplotlib where used.
"""

import contextlib
import json
import logging
import math
import os
import re
import sys
import time
import warnings

# Python warnings megatron-core and vLLM raise on a CPU-only or Apex-less machine: each
# names a fallback this project chose (torch norms and optimizers, local multi-tensor ops).
KNOWN_PYTHON_WARNINGS = (
    r"Transformer Engine and Apex are not installed",
    r"Apex is not installed",
    r"full scope is deprecated",  # megatron's own default cuda_graph_scope
    r"The 'megatron.core.transformer.custom_layers.transformer_engine'",
    r"`torch.distributed.reduce_op` is deprecated",  # raised inside vLLM's kernel registry
    # megatron-core's sequence-parallel collectives (MoE models under --tp > 1), and its
    # distributed optimizer's gradient reduce-scatter and weight all-gather.
    r"`torch.distributed.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated",
    # The distributed optimizer's fp32 main weights are views of its buffer, and megatron
    # asks each for a .grad.
    r"The .grad attribute of a Tensor that is not a leaf Tensor is being accessed",
    r"When using sequence parallelism it is recommended to set the environment variable CUDA_DEVICE_MAX_CONNECTIONS",
)
# vLLM warnings about its CPU build and the engine options this project sets on purpose.
KNOWN_VLLM_WARNINGS = (
    r"Triton is (installed, but doesn't include|not installed)",
    r"Model Runner V2 requires Triton",
    r"CPU backend doesn't allow to use `torch.set_num_threads`",
    r"\S+ is not found in LD_PRELOAD",
    r"Speculative decoding on CPU without Intel OpenMP",
    r"Kernel \S+ is already registered",
    r"Unknown vLLM environment variable detected: VLLM_DIST_IDENT",
    r"Enabling num_speculative_tokens > 1 will run multiple times",
    r"min_p and logit_bias parameters won't work with speculative decoding",
    r"max_num_scheduled_tokens is set to",
    r"Inductor compilation was disabled",
    r"Enforce eager set, disabling torch.compile",
    r"The global random seed is set to",
    r"sleep mode is not supported on CPU",
    # Said on CPUs with AVX-512 BF16 for every model; only Mamba-style models hold an SSM cache.
    r"Reset SSM cache type to float32 for accelerated GDN mamba backend",
)
VLLM_LOGGER = "vllm"
# The phases a step's tokens/s counts (evaluation is not part of producing the update).
STEP_PHASES = ("tune", "rollout", "train", "sync")
# Where a run keeps its W&B run id (wandb writes its own files under OUT/wandb), so that a
# resumed run goes on logging to the same W&B run.
WANDB_RUN_ID_FILE = os.path.join("wandb", "run_id")


class _KnownWarnings(logging.Filter):
    def filter(self, record):
        return record.levelno > logging.WARNING or not any(
            re.match(pattern, record.getMessage()) for pattern in KNOWN_VLLM_WARNINGS)


def hide_known_warnings(verbose):
    """Unless `verbose`: hide KNOWN_PYTHON_WARNINGS, and give vLLM one handler on stderr at
    WARNING that drops KNOWN_VLLM_WARNINGS. Call before vLLM is imported (vLLM configures
    its own logging on import only while VLLM_CONFIGURE_LOGGING is unset)."""
    if verbose:
        return
    for pattern in KNOWN_PYTHON_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern)
    os.environ["VLLM_CONFIGURE_LOGGING"] = "0"
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("vLLM %(levelname)s %(message)s"))
    handler.addFilter(_KnownWarnings())
    logger = logging.getLogger(VLLM_LOGGER)
    logger.handlers[:] = [handler]
    logger.setLevel(logging.WARNING)
    logger.propagate = False


class PhaseTimer:
    """Wall seconds per phase of one step: `with timer("rollout"): ...`; `timer.seconds` by name."""

    def __init__(self):
        self.seconds = {}

    @contextlib.contextmanager
    def __call__(self, phase):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - start


def step_record(step, samples, rewards, train_metrics, draft_metrics, eval_metrics, seconds):
    """One line of metrics.jsonl: every value of the step by name (eval_* on eval steps only).
    rewards: [N] fp32 tensor, one per sample; seconds: {phase: wall seconds}."""
    lengths = sorted(len(s["response_ids"]) for s in samples)
    response_tokens = sum(lengths)
    return {
        "step": step,
        "reward_mean": rewards.mean().item(), "reward_std": rewards.std().item(),
        "accuracy": (rewards == 1).float().mean().item(),
        "response_length": response_tokens / len(samples),
        # A rollout lasts as long as its longest responses: the tail, not the mean.
        "response_length_median": lengths[(len(lengths) - 1) // 2],
        "response_length_p90": lengths[math.ceil(0.9 * len(lengths)) - 1],
        "response_length_max": lengths[-1],
        **train_metrics,
        **draft_metrics,
        **eval_metrics,
        **{f"{phase}_s": value for phase, value in seconds.items()},
        "rollout_tokens_per_s": response_tokens / seconds["rollout"],
        "tokens_per_s": response_tokens / sum(seconds[phase] for phase in STEP_PHASES),
    }


def open_tensorboard(out, start_step):
    """A TensorBoard writer on OUT/tensorboard. A resumed run hides what an earlier run
    logged past `start_step`, as metrics.jsonl drops it."""
    from torch.utils.tensorboard import SummaryWriter
    return SummaryWriter(os.path.join(out, "tensorboard"), purge_step=start_step + 1 if start_step else None)


def scalar_metrics(record):
    """{name: number}: every number of the record but its step, under its metrics.jsonl
    name; what TensorBoard and W&B both get (strings, None and lists have no curve)."""
    return {name: value for name, value in record.items()
            if name != "step" and isinstance(value, (int, float)) and not isinstance(value, bool)}


def write_tensorboard(writer, record):
    """The record's scalar_metrics at its step, as add_scalar writes each (its simple_value)
    but in one event: an event per value cost rank 0 milliseconds a step, which every other
    rank waited for. Flushed, so a crash loses no finished step."""
    from tensorboard.compat.proto.summary_pb2 import Summary
    values = [Summary.Value(tag=name, simple_value=float(value)) for name, value in scalar_metrics(record).items()]
    writer.file_writer.add_summary(Summary(value=values), record["step"])
    writer.flush()


def open_wandb(out, project, config, start_step):
    """A Weights & Biases run in `project` with the run's settings (`config`, a dict) and its
    files under OUT/wandb; None without a project. A resumed run (`start_step` > 0) goes on
    in the W&B run OUT recorded (WANDB_RUN_ID_FILE). W&B's steps only increase: where the
    earlier run logged past `start_step`, W&B's server keeps those values and drops the
    replayed steps' (metrics.jsonl and TensorBoard keep the new ones). WANDB_MODE=offline
    logs without a network, for `wandb sync` later."""
    if project is None:
        return None
    import wandb  # only a run that asks for W&B needs it
    id_path = os.path.join(out, WANDB_RUN_ID_FILE)
    resumed_id = None
    if start_step and os.path.isfile(id_path):
        with open(id_path) as f:
            resumed_id = f.read().strip()
    run = wandb.init(project=project, dir=out, config=config, id=resumed_id,
                     resume="allow" if resumed_id else None)
    os.makedirs(os.path.dirname(id_path), exist_ok=True)
    with open(id_path, "w") as f:
        f.write(run.id)
    return run


def step_line(record, steps, eta_seconds):
    """The console line of one step: reward, drafting, losses, clip, eval, time and ETA."""
    accept = f"{record['acceptance_rate']:.2f}" if record["acceptance_rate"] is not None else "-"
    if record.get("mtp_acceptance") is not None:
        # The trainer's estimate of a sampled draft's acceptance at depth 1, drafting or not.
        accept += f" est {record['mtp_acceptance']:.2f}"
    evaluated = (f"eval acc {record['eval_accuracy']:.2f} reward {record['eval_reward_mean']:.3f} "
                 if "eval_accuracy" in record else "")
    return (f"step {record['step']}/{steps} reward {record['reward_mean']:.3f} acc {record['accuracy']:.2f} "
            f"{draft_column(record)} accept {accept} mtp {record['mtp_loss']:.3f} ent {record['entropy']:.2f} "
            f"mismatch {record['logprob_mismatch_mean']:.1e} gnorm {record['grad_norm']:.2f} "
            f"clip {record['clip_fraction']:.3f} len {record['response_length_median']}/"
            f"{record['response_length_p90']}/{record['response_length_max']} {evaluated}"
            f"| {sum(record[f'{p}_s'] for p in STEP_PHASES):.1f}s/step ({record['tune_s']:.1f} tune, "
            f"{record['rollout_s']:.1f} roll {record['rollout_tokens_per_s']:.0f} tok/s, {record['train_s']:.1f} "
            f"train, {record['sync_s']:.1f} sync) eta {eta_seconds / 60:.1f} min")


def draft_column(record):
    """"k 3" where the rollout drafted 3 tokens in every band it ran, "k 0>3" where it began
    crowded at k = 0 and ended in its tail at k = 3 (the k of its most and fewest sequences)."""
    ks = [counts["k"] for counts in (record.get("bands") or {}).values()]
    if not ks or ks[0] == ks[-1]:
        return f"k {record['draft_tokens']}"
    return f"k {ks[-1]}>{ks[0]}"


def log_step(record, metrics_path, writer, steps, seconds_so_far, steps_done, wandb_run=None):
    """Append the record to metrics.jsonl (and TensorBoard, `writer` not None; W&B,
    `wandb_run` not None: the same scalar_metrics at the same step) and print its line,
    with the ETA from this process's steps so far."""
    with open(metrics_path, "a") as f:
        f.write(json.dumps(record) + "\n")
    if writer is not None:
        write_tensorboard(writer, record)
    if wandb_run is not None:
        wandb_run.log(scalar_metrics(record), step=record["step"])
    print(step_line(record, steps, seconds_so_far / steps_done * (steps - record["step"])), flush=True)


def minutes(seconds):
    return f"{int(seconds // 60)} min {seconds % 60:.0f} s" if seconds >= 60 else f"{seconds:.1f} s"


def summary(records, seconds, steps_done):
    """The closing lines: time, reward, held-out accuracy and drafting of the run."""
    last, evaluated = records[-1], [r for r in records if "eval_accuracy" in r]
    drafted = sum(1 for r in records if r["draft_tokens"])
    reached = next((r["step"] for r in records if r["reward_mean"] >= 0.9), None)
    lines = [f"done: {steps_done} steps in {minutes(seconds)} ({seconds / max(steps_done, 1):.2f} s/step); "
             f"reward {last['reward_mean']:.3f} at step {last['step']}"
             + (f", 0.9 first at step {reached}" if reached else ", never 0.9")
             + (f"; held-out accuracy {evaluated[-1]['eval_accuracy']:.2f}" if evaluated else "")]
    tries = sum(1 for r in records if "tried_band_speeds" in r)
    lines.append(f"drafting: {drafted} of {len(records)} rollouts drafted"
                 + (f"; {tries} rollouts were auto's tries of each k" if tries else "")
                 + f"; {draft_column(last)} at the last"
                 + (f", acceptance {last['acceptance_rate']:.2f}" if last["acceptance_rate"] is not None else ""))
    return "\n".join(lines)


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_curves(records, path):
    """Reward, draft acceptance and the held-out evaluation over steps, into a PNG."""
    plt = _pyplot()
    steps = [r["step"] for r in records]
    figure, axis = plt.subplots(figsize=(7, 4))
    axis.plot(steps, [r["reward_mean"] for r in records], label="mean reward")
    if any(r.get("acceptance_rate") is not None for r in records):
        axis.plot(steps, [r.get("acceptance_rate") for r in records], label="MTP draft acceptance")
    checked = [r for r in records if r.get("check_acceptance_by_depth")]
    if checked:
        axis.plot([r["step"] for r in checked], [r["check_acceptance_by_depth"][0] for r in checked], "s",
                  label="draft acceptance, first depth (auto's checks)")
    evaluated = [r for r in records if "eval_accuracy" in r]
    for name, label in (("eval_reward_mean", "held-out mean reward (greedy)"),
                        ("eval_accuracy", "held-out accuracy (greedy)")):
        axis.plot([r["step"] for r in evaluated], [r[name] for r in evaluated], marker="o", label=label)
    axis.set_xlabel("step")
    axis.set_ylim(0, 1.05)
    axis.grid(alpha=0.3)
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)


def plot_acceptance_against_entropy(records, path):
    """Draft acceptance (position 1: the share of verify steps that accepted the first
    draft, from the rollout or auto's acceptance check) against the policy's entropy, a
    point per step, coloured by step; False (nothing drawn) when no step measured it."""
    points = [(r["entropy"], (r.get("acceptance_by_depth") or r.get("check_acceptance_by_depth"))[0], r["step"])
              for r in records if r.get("acceptance_by_depth") or r.get("check_acceptance_by_depth")]
    if not points:
        return False
    plt = _pyplot()
    figure, axis = plt.subplots(figsize=(5, 4))
    entropy, acceptance, steps = zip(*points)
    scatter = axis.scatter(entropy, acceptance, c=steps, cmap="viridis", s=12)
    figure.colorbar(scatter, label="step")
    axis.set_xlabel("policy entropy (nats per token)")
    axis.set_ylabel("draft acceptance, first position")
    axis.set_ylim(0, 1.05)
    axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    return True
