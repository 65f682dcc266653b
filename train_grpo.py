"""GRPO on Megatron-Core with colocated vLLM rollouts drafted by the model's own MTP head.

One process per device under torchrun. Each process holds a Megatron-Core policy shard
(tensor parallel --tp, context parallel --cp, data parallel = the rest) and a vLLM engine
on the same device (rollout tensor parallel --rollout-tp). Each step, one call per phase
in `main`'s loop:

    prompts -> (tune: how many tokens to draft) -> vLLM (rollout, MTP drafts) -> rewards
            -> GRPO advantages -> cp_thd packs -> forward (Megatron) -> PPO loss (+ MTP loss)
            -> megatron-core Adam -> vllm_sync -> vLLM (the draft checked against Megatron's)

    torchrun --nproc_per_node 2 train_grpo.py                       # CPU: tiny model, repeat task
    torchrun --nproc_per_node 2 train_grpo.py --task count          # CPU: 16-layer model, long answers
    torchrun --nproc_per_node 8 train_grpo.py --model DIR --tp 2 --cp 2 --rollout-tp 2

Where each concern lives: tasks.py (built-in tasks, data files, rewards), rollout.py (vLLM
engines), draft_tuner.py (how many tokens to draft), grpo_loss.py (advantages, aggregation,
PPO loss), trainer.py (the Megatron train step), forward.py (Megatron log-probs),
vllm_sync.py (Megatron -> vLLM), hf_weights.py (Megatron <-> HF), checkpoint.py (save, resume,
signals, the --out lock), run_log.py (console, metrics.jsonl, TensorBoard, plots).
Metrics: OUT/metrics.jsonl, TensorBoard under OUT/tensorboard, curves.png and
acceptance_vs_entropy.png at the end; the trained policy as a HF checkpoint in OUT/final.
"""

import argparse
import dataclasses
import importlib.util
import math
import os
import random
import re
import signal
import sys
import time

import run_log

if __name__ == "__main__":
    # The stack's known-harmless warnings are raised while it imports, before the flags are
    # parsed: --verbose is read here for them (parse_args reads it again, with the rest).
    run_log.hide_known_warnings(verbose="--verbose" in sys.argv[1:])

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from megatron.core import parallel_state  # noqa: E402

import checkpoint  # noqa: E402
import draft_tuner  # noqa: E402
import grpo_loss  # noqa: E402
import hf_weights  # noqa: E402
import mtp_patch  # noqa: E402
import rollout  # noqa: E402
import spec_config  # noqa: E402
import tasks  # noqa: E402
import tiny_model  # noqa: E402
import trainer  # noqa: E402
from cpu_backend import cuda_on_cpu, init_distributed, init_model_parallel  # noqa: E402
from megatron_model import (DEFAULT_MTP_LOSS_SCALING_FACTOR, SUPPORTED_ARCHITECTURES, load_hf_config,  # noqa: E402
                            transformer_engine_usable)

DATA_LR = 3e-4
# A data file's default response limit: short answers (a number); reasoning needs --max-new-tokens.
DATA_MAX_NEW_TOKENS = 3
DEFAULT_MAX_POSITIONS = 4096
# DAPO's dynamic sampling: how many rollouts a step may take to fill its batch by default.
DEFAULT_SAMPLING_ROUNDS = 4
BUILTIN_MODELS_DIR = "runs"
# What a resumed run may set otherwise than its checkpoint: how it runs, drafts, saves and
# logs, its length and the optimizer's step size. Any other flag makes it another run.
RESUME_MAY_CHANGE = ("steps", "out", "resume", "save_every", "keep_checkpoints", "eval_every", "tensorboard",
                     "verbose", "wandb_project", "lr", "grad_clip", "micro_batches", "mtp_rollout",
                     "num_speculative_tokens", "max_speculative_tokens", "tune_every", "acceptance_check_every",
                     "check_draft_every", "spec_config", "gpu_memory_utilization", "kv_cache_bytes", "shared_prefix")


def usage_error(message):
    """The SystemExit for bad input: rank 0 prints `message`, every process exits non-zero."""
    return SystemExit(f"train_grpo.py: {message}" if int(os.environ.get("RANK", "0")) == 0 else 2)


class _ArgumentParser(argparse.ArgumentParser):
    def error(self, message):
        # argparse's own checks (types, bounds, choices) speak once, on rank 0, like ours.
        raise usage_error(f"{message} (--help lists every flag)")


# ---------------------------------------------------------------------------------------
# Flags: each bound next to its flag; every one checked before any process group exists
# ---------------------------------------------------------------------------------------

def number(kind, at_least=None, above=None, below=None, at_most=None, why=""):
    """An argparse `type=`: a finite `kind` (int or float) within the bounds given."""
    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: expected {'an int' if kind is int else 'a number'}") from None
        bounds = [(at_least, ">=", value >= (at_least or 0)), (above, ">", value > (above or 0)),
                  (below, "<", value < (below or 0)), (at_most, "<=", value <= (at_most or 0))]
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{text}: expected a finite number")
        for bound, sign, inside in bounds:
            if bound is not None and not inside:
                raise argparse.ArgumentTypeError(f"{value}: expected a number {sign} {bound}{why}")
        return value
    return parse


def draft_tokens_flag(value):
    """--num-speculative-tokens: "auto" or an int >= 1."""
    if value == "auto":
        return value
    if not re.fullmatch(r"\d+", value) or int(value) < 1:
        raise argparse.ArgumentTypeError(f"{value!r}: expected auto or an int >= 1")
    return int(value)


POSITIVE_INT, COUNT = number(int, at_least=1), number(int, at_least=0)
POSITIVE, NON_NEGATIVE = number(float, above=0), number(float, at_least=0)


def add_data_flags(p):
    p.add_argument("--model", default=None,
                   help="HF checkpoint dir of a MiMo, DeepSeek-V3 or GLM-4.5 model with MTP layers; default: the "
                        "built-in model of --builtin-model")
    p.add_argument("--builtin-model", choices=sorted(tiny_model.BUILTIN_MODELS), default=None,
                   help="the built-in model (written once under runs/) used without --model; default: the task's "
                        "(" + ", ".join(f"{task}: {spec['model']}" for task, spec in tasks.TASKS.items()) + ")")
    p.add_argument("--task", choices=sorted(tasks.TASKS), default="repeat",
                   help="built-in task without --data: repeat ('repeat:c' -> 'ccc', per-letter credit) or count "
                        f"('count:7' -> the next {tasks.TASKS['count']['length']} digits counting up mod 10, "
                        "'8901...', credit for each digit that follows the one before)")
    p.add_argument("--count-step", type=number(int, at_least=1, at_most=tasks.MAX_COUNT_STEP), default=1,
                   help="--task count counts in steps of this many mod 10 (2: 'count:7' -> '9135...'); a policy "
                        "trained on one step and then on another is a policy that moves away from its MTP draft")
    p.add_argument("--data", default=None,
                   help="examples, .jsonl or .parquet: {prompt, answer} rows, or verl's layout (prompt as chat "
                        "messages, answer under reward_model.ground_truth); default: the built-in --task")
    p.add_argument("--prompt-key", default=tasks.DEFAULT_PROMPT_KEY,
                   help="--data field holding the prompt (a string or a list of {role, content} chat messages); "
                        "a dotted path reaches into nested fields")
    p.add_argument("--answer-key", default=None,
                   help="--data field holding the answer, a dotted path reaches into nested fields; default: "
                        + " or ".join(tasks.DEFAULT_ANSWER_KEYS))
    p.add_argument("--eval-data", default=None,
                   help="held-out examples in --data's formats and keys; default: the built-in task's held-out "
                        f"prompts, or with --data a fixed {tasks.EVAL_HOLDOUT_FRACTION:.0%}% of it (at most "
                        f"{tasks.EVAL_HOLDOUT_MAX}) that training never samples")
    p.add_argument("--eval-every", type=POSITIVE_INT, default=25,
                   help="greedy accuracy and mean reward on the held-out set every N steps (and after the last)")
    p.add_argument("--reward", default=None, metavar="FILE.py:FUNCTION|math",
                   help="your reward: FUNCTION(prompt: str, response: str, answer: str) -> float or a list of "
                        "per-token floats; or math: the final answer (GSM8K's '#### 72', \\boxed{}, fractions, "
                        "LaTeX) checked against the answer's with math-verify; default: per-character credit "
                        "(built-in task), exact match (--data)")


def add_output_flags(p):
    p.add_argument("--out", default="runs/grpo",
                   help="metrics.jsonl, curves.png, tensorboard/ event files, checkpoints, final HF dir")
    p.add_argument("--tensorboard", action=argparse.BooleanOptionalAction, default=True,
                   help="also write every metric to TensorBoard event files under OUT/tensorboard")
    p.add_argument("--wandb-project", default=None,
                   help="also log every metric to Weights & Biases under this project (WANDB_MODE=offline keeps it "
                        "on disk)")
    p.add_argument("--verbose", action="store_true",
                   help="show vLLM's INFO logs and periodic engine statistics, and the stack's known-harmless "
                        "warnings (hidden by default)")
    p.add_argument("--resume", default="auto",
                   help="auto: continue from the newest complete checkpoint in OUT/checkpoints if there is one, "
                        "else start fresh (so torchrun --max-restarts survives a killed worker); never: start fresh "
                        "(refused if OUT holds checkpoints); or a checkpoint dir (OUT/checkpoints/step_N, or a run's "
                        "OUT/checkpoints for its newest)")
    p.add_argument("--save-every", type=POSITIVE_INT, default=50, help="checkpoint every N steps (and at the end)")
    p.add_argument("--keep-checkpoints", type=POSITIVE_INT, default=2,
                   help="how many of the newest checkpoints to keep")


def add_layout_flags(p):
    p.add_argument("--steps", type=POSITIVE_INT, default=150, help="training steps (one rollout batch each)")
    p.add_argument("--seed", type=int, default=0, help="seed of data, init and sampling")
    p.add_argument("--tp", type=POSITIVE_INT, default=1, help="Megatron tensor parallel size")
    p.add_argument("--cp", type=POSITIVE_INT, default=1, help="Megatron context parallel size")
    p.add_argument("--ep", type=POSITIVE_INT, default=1,
                   help="Megatron expert parallel size: an MoE model's routed experts split over this many "
                        "data-parallel ranks (1: every rank holds every expert)")
    p.add_argument("--routing-replay", action=argparse.BooleanOptionalAction, default=None,
                   help="MoE models: Megatron's routers use the experts vLLM routed each token to in the rollout "
                        "(rollout routing replay, R3) instead of their own; off, the share of tokens whose experts "
                        "agree is logged as routing_agreement (default: on for an MoE model; it costs no measurable "
                        "time and cut the worst token's vLLM-Megatron mismatch 40x)")
    p.add_argument("--rollout-tp", type=POSITIVE_INT, default=1, help="vLLM tensor parallel size")
    p.add_argument("--prompts-per-step", type=POSITIVE_INT, default=16, help="prompts per data-parallel rank per step")
    p.add_argument("--group-size", type=number(int, at_least=2, why=" (GRPO baselines each completion against the "
                                                                  "others of its prompt)"), default=8,
                   help="completions per prompt (the GRPO group)")
    p.add_argument("--max-new-tokens", type=POSITIVE_INT, default=None,
                   help="response length limit (a built-in task always samples exactly this many); default: the "
                        "built-in task's answer length, " + ", ".join(f"{task} {spec['length']}"
                                                                      for task, spec in tasks.TASKS.items())
                        + ", or with --data " + str(DATA_MAX_NEW_TOKENS))
    p.add_argument("--temperature", type=number(float, above=0, why=" (greedy decoding would give every completion "
                                                                     "of a group the same answer)"), default=1.0,
                   help="rollout sampling temperature (> 0)")
    p.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=None,
                   help="bf16 weights and rollout (default: on with CUDA, off on CPU)")
    p.add_argument("--gpu-memory-utilization", type=number(float, above=0, at_most=1), default=0.3,
                   help="vLLM's share of GPU memory")
    p.add_argument("--kv-cache-bytes", type=POSITIVE_INT, default=2**28, help="vLLM KV cache size on CPU")


def add_loss_flags(p):
    p.add_argument("--lr", type=POSITIVE, default=None,
                   help="Adam learning rate; default: the built-in task's, " + ", ".join(
                       f"{task} {spec['lr']:g}" for task, spec in tasks.TASKS.items()) + f", or with --data {DATA_LR:g}")
    p.add_argument("--shared-prefix", action=argparse.BooleanOptionalAction, default=None,
                   help="train on each group's prompt once, its completions attending to it (the same loss and "
                        "gradients on fewer tokens; default: on where the attention runs it: cp 1 without "
                        "Transformer Engine)")
    p.add_argument("--micro-batches", type=POSITIVE_INT, default=1,
                   help="gradient accumulation micro-batches per optimizer step (per mini-batch)")
    p.add_argument("--mini-batches", type=POSITIVE_INT, default=1,
                   help="optimizer steps per pass over the rollout batch; > 1 (or --ppo-epochs > 1) makes the PPO "
                        "ratio move and the clip act")
    p.add_argument("--ppo-epochs", type=POSITIVE_INT, default=1, help="passes over each rollout batch")
    p.add_argument("--grad-clip", type=POSITIVE, default=1.0, help="global gradient-norm clip")
    p.add_argument("--advantage", choices=grpo_loss.ADVANTAGE_MODES, default="grpo",
                   help="group baseline: mean/std (GRPO), mean only (Dr. GRPO), leave-one-out mean")
    p.add_argument("--loss-agg", choices=grpo_loss.LOSS_AGGREGATIONS, default="token-mean",
                   help="how per-token losses are averaged")
    p.add_argument("--clip-low", type=number(float, at_least=0, below=1), default=0.2, help="PPO ratio clip below 1")
    p.add_argument("--clip-high", type=NON_NEGATIVE, default=0.28, help="PPO ratio clip above 1")
    p.add_argument("--dual-clip", type=number(float, above=1, why=" (it bounds the loss of negative advantages from "
                                                                   "below at dual-clip x advantage)"), default=3.0,
                   help="dual-clip bound for negative advantages (> 1)")
    p.add_argument("--loss", choices=grpo_loss.POLICY_LOSSES, default="ppo",
                   help="policy loss: ppo (token ratio, clipped), gspo (the sequence's ratio, geometric mean of its "
                        "tokens', clipped per sequence; no dual clip; pair with --loss-agg seq-mean-token-mean), "
                        "cispo (REINFORCE on every token, weighted by the stop-gradient ratio capped at "
                        "1 + --clip-high)")
    p.add_argument("--tis-cap", type=NON_NEGATIVE, default=2.0,
                   help="truncated importance sampling: weight min(p_megatron / p_vllm, cap); 0 disables")
    p.add_argument("--rollout-mask", choices=grpo_loss.ROLLOUT_MASK_LEVELS, default="off",
                   help="masked importance sampling against vLLM: drop the policy loss of tokens (token) or whole "
                        "sequences (sequence: the geometric mean of their tokens') whose p_megatron / p_vllm leaves "
                        "[--rollout-mask-low, --rollout-mask-high]")
    p.add_argument("--rollout-mask-low", type=POSITIVE, default=0.5, help="--rollout-mask's lower bound on the ratio")
    p.add_argument("--rollout-mask-high", type=POSITIVE, default=2.0, help="--rollout-mask's upper bound on the ratio")
    p.add_argument("--kl-coef", type=NON_NEGATIVE, default=0.0,
                   help="k3 KL to the initial policy (0: no reference model)")
    p.add_argument("--entropy-coef", type=NON_NEGATIVE, default=0.02,
                   help="entropy bonus (keeps a random-init policy from collapsing onto one answer)")


def add_sampling_flags(p):
    p.add_argument("--dynamic-sampling", action="store_true",
                   help="DAPO's dynamic sampling: drop the groups whose rewards are all equal (no advantage) and "
                        "roll out more prompts until the batch is full of informative groups, at most "
                        "--max-sampling-rounds rollouts per step (then the dropped groups fill it)")
    p.add_argument("--max-sampling-rounds", type=POSITIVE_INT, default=None,
                   help=f"--dynamic-sampling: rollouts per step at most (default {DEFAULT_SAMPLING_ROUNDS})")
    p.add_argument("--overlong-filter", action="store_true",
                   help="truncated completions (no end-of-sequence token within --max-new-tokens) stay out of the "
                        "loss (--data only: the built-in tasks always sample --max-new-tokens)")
    p.add_argument("--overlong-buffer", type=COUNT, default=0,
                   help="DAPO's soft overlong punishment: the reward falls linearly by up to --overlong-penalty over "
                        "the last N tokens before --max-new-tokens (0: off; --data only)")
    p.add_argument("--overlong-penalty", type=NON_NEGATIVE, default=1.0,
                   help="the reward taken from a completion of --max-new-tokens tokens under --overlong-buffer")


def add_mtp_flags(p):
    p.add_argument("--mtp-train", action=argparse.BooleanOptionalAction, default=True,
                   help="train the MTP head (its loss rides on the policy's backward pass)")
    p.add_argument("--mtp-rollout", action=argparse.BooleanOptionalAction, default=None,
                   help="draft with the MTP head in vLLM (speculative decoding); default: on when the model "
                        "has MTP layers")
    p.add_argument("--mtp-loss-scale", type=NON_NEGATIVE, default=1.0,
                   help=f"multiplies megatron's MTP loss weight: the MTP loss enters the gradient with weight "
                        f"{DEFAULT_MTP_LOSS_SCALING_FACTOR} x this / MTP layers")
    p.add_argument("--num-speculative-tokens", type=draft_tokens_flag, default="auto",
                   help="MTP draft tokens per verify step, or auto: the k in 0..--max-speculative-tokens (0: no "
                        "drafting) whose rollouts run fastest: every --tune-every steps, and when the acceptance "
                        "rose far (or fell far while drafting), the next rollouts try in turn k = 0 and every k that "
                        "could pay, and the fastest stays")
    p.add_argument("--max-speculative-tokens", type=POSITIVE_INT, default=3, help="the deepest k auto considers")
    p.add_argument("--tune-every", type=POSITIVE_INT, default=50,
                   help="auto: every N steps (and at the first) the rollouts try each k that could pay again, in "
                        "turns, on the current weights")
    p.add_argument("--acceptance-check-every", type=POSITIVE_INT, default=5,
                   help="auto, while no rollout drafts: every N steps measure the draft's acceptance at every depth "
                        f"on {draft_tuner.ACCEPTANCE_CHECK_PROMPTS} of the step's prompts per engine")
    p.add_argument("--check-draft-every", type=COUNT, default=1,
                   help="every N weight pushes, check that vLLM's MTP draft holds exactly Megatron's MTP weights and "
                        "stop naming the tensor when not (0: never)")
    p.add_argument("--spec-config", default=None, help="JSON object merged into vLLM's speculative_config")


def build_parser():
    p = _ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for add_flags in (add_data_flags, add_output_flags, add_layout_flags, add_loss_flags, add_sampling_flags,
                      add_mtp_flags):
        add_flags(p)
    return p


def parse_args(argv=None):
    """The flags as given (None where a default is derived: see `resolve`)."""
    return build_parser().parse_args(argv)


def builtin_model(args):
    """(name, config.json dict) of the built-in model a run without --model uses."""
    name = args.builtin_model or tasks.TASKS[args.task]["model"]
    return name, tiny_model.builtin_config(name)[1]


def write_builtin_model(name):
    """The built-in model `name` (tiny_model.BUILTIN_MODELS) written under BUILTIN_MODELS_DIR
    unless it is there already; returns its directory."""
    family, sizes = tiny_model.BUILTIN_MODELS[name]
    directory = os.path.join(BUILTIN_MODELS_DIR, f"{name}-{family}" if name != family else name)
    return tiny_model.build_tiny_model(directory, family, **sizes)


def model_config(args):
    """The model's config.json as a dict (the built-in model's without --model)."""
    return builtin_model(args)[1] if args.model is None else load_hf_config(args.model)


def layout_problems(args, world_size):
    problems = []
    if world_size % (args.tp * args.cp):
        problems.append(f"--tp {args.tp} x --cp {args.cp} = {args.tp * args.cp}: expected a divisor of the world "
                        f"size {world_size}")
    if args.ep > 1 and world_size % (args.tp * args.ep):
        problems.append(f"--tp {args.tp} x --ep {args.ep} = {args.tp * args.ep}: expected a divisor of the world "
                        f"size {world_size}")
    if world_size % args.rollout_tp:
        problems.append(f"--rollout-tp {args.rollout_tp}: expected a divisor of the world size {world_size}")
    sequences = args.prompts_per_step * args.group_size
    if sequences % (args.mini_batches * args.micro_batches):
        problems.append(f"--mini-batches {args.mini_batches} x --micro-batches {args.micro_batches}: expected a "
                        f"divisor of the {sequences} sequences per step (--prompts-per-step x --group-size)")
    if args.model is not None and not os.path.isfile(os.path.join(args.model, "config.json")):
        problems.append(f"--model {args.model!r}: no config.json there; expected a Hugging Face checkpoint dir")
    if args.model is not None and args.builtin_model is not None:
        problems.append(f"--builtin-model {args.builtin_model}: only used without --model (this run has --model "
                        f"{args.model!r})")
    if args.tensorboard and importlib.util.find_spec("tensorboard") is None:
        problems.append("--tensorboard: the tensorboard package is not installed; pip install tensorboard or pass "
                        "--no-tensorboard")
    try:
        deepest = args.max_speculative_tokens if args.num_speculative_tokens == "auto" else args.num_speculative_tokens
        spec_config.build_mtp_speculative_config("mtp", deepest, args.spec_config)
    except (TypeError, ValueError, RuntimeError) as error:
        problems.append(f"--spec-config {args.spec_config!r}: {error}")
    return problems + checkpoint.out_problems(args.out, args.resume)


def data_problems(args):
    problems = []
    if args.data is not None and args.task != "repeat":
        problems.append(f"--task {args.task}: a built-in task, not used with --data {args.data!r}")
    if args.count_step != 1 and (args.data is not None or args.task != "count"):
        problems.append(f"--count-step {args.count_step}: only read with --task count")
    formats = " or ".join(tasks.DATA_FORMATS)
    for flag, path in (("--data", args.data), ("--eval-data", args.eval_data)):
        if path is not None and not os.path.isfile(path):
            problems.append(f"{flag} {path!r}: no such file; expected a {formats} file of examples")
        elif path is not None and not path.endswith(tasks.DATA_FORMATS):
            problems.append(f"{flag} {path!r}: extension {os.path.splitext(path)[1] or '(none)'!r} is not read; "
                            f"expected {formats}")
        # Packages only some runs import: missing, they would stop the run after the model loads.
        elif path is not None and path.endswith(".parquet") and importlib.util.find_spec("pyarrow") is None:
            problems.append(f"{flag} {path!r}: reading Parquet needs pyarrow; pip install pyarrow")
    for flag, key, default in (("--prompt-key", args.prompt_key, tasks.DEFAULT_PROMPT_KEY),
                               ("--answer-key", args.answer_key, None)):
        if key is not None and not all(key.split(".")):
            problems.append(f"{flag} {key!r}: expected a field name or a dotted path such as "
                            f"{tasks.DEFAULT_ANSWER_KEYS[-1]}")
        elif key != default and args.data is None:
            problems.append(f"{flag} {key!r}: only read with --data (the built-in task has its own examples)")
    if args.reward is not None:
        try:
            tasks.load_reward_function(args.reward)
        except tasks.InputError as error:
            problems.append(str(error))
    return problems


def sampling_problems(args):
    """The recipe's flags: each read only where it means something."""
    problems = []
    if args.max_sampling_rounds is not None and not args.dynamic_sampling:
        problems.append(f"--max-sampling-rounds {args.max_sampling_rounds}: only read with --dynamic-sampling")
    overlong = [flag for flag, on in (("--overlong-filter", args.overlong_filter),
                                      (f"--overlong-buffer {args.overlong_buffer}", args.overlong_buffer)) if on]
    if overlong and args.data is None:
        problems.append(f"{' and '.join(overlong)}: the built-in task samples exactly --max-new-tokens tokens "
                        "(its end-of-sequence token is ignored), so nothing is overlong; expected --data")
    max_new_tokens = args.max_new_tokens or DATA_MAX_NEW_TOKENS
    if args.data is not None and args.overlong_buffer > max_new_tokens:
        problems.append(f"--overlong-buffer {args.overlong_buffer}: expected at most --max-new-tokens "
                        f"{max_new_tokens}")
    if args.rollout_mask_low > args.rollout_mask_high:
        problems.append(f"--rollout-mask-low {args.rollout_mask_low} > --rollout-mask-high "
                        f"{args.rollout_mask_high}: expected low <= high")
    if args.wandb_project is not None and importlib.util.find_spec("wandb") is None:
        problems.append(f"--wandb-project {args.wandb_project}: the wandb package is not installed; pip install "
                        "wandb or leave the flag out")
    return problems


def model_description(args):
    """The model as messages name it: --model's path, or the built-in model's name."""
    return args.model or f"the built-in {builtin_model(args)[0]} model"


def model_problems(args, hf_config):
    """Flags that must fit the model's config.json."""
    where = model_description(args)
    architectures = hf_config.get("architectures") or []
    if not set(architectures) & set(SUPPORTED_ARCHITECTURES):
        return [f"--model {args.model!r}: architecture {', '.join(architectures) or '(none in config.json)'} is not "
                f"one this project builds; expected {' or '.join(SUPPORTED_ARCHITECTURES)}"]
    problems = []
    experts = hf_config.get("n_routed_experts")
    if args.ep > 1 and not experts:
        problems.append(f"--ep {args.ep}: {where} has no experts; expected --ep 1")
    if args.routing_replay is True and not experts:
        problems.append(f"--routing-replay: {where} has no experts to route; leave the flag out")
    elif experts and experts % args.ep:
        problems.append(f"--ep {args.ep}: expected a divisor of {where}'s {experts} routed experts")
    obstacle = shared_prefix_obstacle(args, hf_config)
    if args.shared_prefix and obstacle:
        problems.append(f"--shared-prefix: {obstacle}; leave the flag out")
    if args.mtp_rollout and not hf_config.get("num_nextn_predict_layers", 0):
        problems.append(f"--mtp-rollout: {where} has no MTP layers (num_nextn_predict_layers is 0); "
                        "pass --no-mtp-rollout")
    kv_heads = hf_config.get("num_key_value_heads", hf_config["num_attention_heads"])
    for flag, size in (("--tp", args.tp), ("--rollout-tp", args.rollout_tp)):
        if kv_heads % size:
            problems.append(f"{flag} {size}: expected a divisor of {where}'s {kv_heads} key/value heads")
    return problems


def shared_prefix_obstacle(args, hf_config):
    """Why the shared-prefix layout cannot run with these flags and this model, or None:
    --shared-prefix is refused with it, and its default is on without."""
    if args.cp > 1:
        return f"its layout is context parallel size 1 (this run has --cp {args.cp})"
    if hf_config.get("n_routed_experts") and args.tp > 1:
        return (f"{model_description(args)} is an MoE model, which trains under --tp {args.tp} with sequence "
                "parallelism, and the layout has none")
    if transformer_engine_usable():
        return "Transformer Engine's attention, which this GPU runs, has no shared-prefix mask"
    return None


def flag_problems(args, world_size):
    """Every problem across the flags (each bound is argparse's), each naming the flag, its
    value and what is expected; the model's are checked once the others hold."""
    problems = layout_problems(args, world_size) + data_problems(args) + sampling_problems(args)
    return problems or model_problems(args, model_config(args))


def resolve(args, hf_config):
    """The run's settings: a new Namespace with what is derived filled in (max_new_tokens,
    lr, mtp_rollout, mtp_train, routing_replay, bf16, max_sampling_rounds, shared_prefix and the built-in
    model's name);
    `args` is untouched."""
    has_mtp = hf_config.get("num_nextn_predict_layers", 0) > 0
    derived = {
        "max_new_tokens": args.max_new_tokens if args.max_new_tokens is not None else (
            DATA_MAX_NEW_TOKENS if args.data else tasks.TASKS[args.task]["length"]),
        "lr": args.lr if args.lr is not None else DATA_LR if args.data else tasks.TASKS[args.task]["lr"],
        "mtp_rollout": has_mtp if args.mtp_rollout is None else args.mtp_rollout,
        "mtp_train": args.mtp_train and has_mtp,
        "routing_replay": "n_routed_experts" in hf_config if args.routing_replay is None else args.routing_replay,
        "bf16": torch.cuda.is_available() if args.bf16 is None else args.bf16,
        "builtin_model": None if args.model else builtin_model(args)[0],
        "max_positions": hf_config.get("max_position_embeddings", DEFAULT_MAX_POSITIONS),
        "max_sampling_rounds": (args.max_sampling_rounds or DEFAULT_SAMPLING_ROUNDS) if args.dynamic_sampling else 1,
        "shared_prefix": (shared_prefix_obstacle(args, hf_config) is None if args.shared_prefix is None
                          else args.shared_prefix),
    }
    return argparse.Namespace(**{**vars(args), **derived})


def check_args(args, world_size):
    """Raise `usage_error` listing every problem with the flags; return the resolved settings."""
    problems = flag_problems(args, world_size)
    if problems:
        raise usage_error("\n  ".join(["bad flags:"] + problems))
    return resolve(args, model_config(args))


def resume_flag_changes(resume_dir, run_settings):
    """The flags this run sets otherwise than the checkpoint it resumes (saved in its
    meta.json): those RESUME_MAY_CHANGE allows as a description ("" for none); any other
    is a refusal naming each, then and now."""
    saved = checkpoint.read_meta(resume_dir).get("flags", {})
    changed = {name: (saved[name], value) for name, value in vars(run_settings).items()
               if name in saved and saved[name] != value}

    def described(names):
        return ", ".join(f"--{name.replace('_', '-')} {changed[name][1]} (was {changed[name][0]})" for name in names)
    refused = [name for name in changed if name not in RESUME_MAY_CHANGE]
    if refused:
        raise usage_error(f"--resume {run_settings.resume}: {resume_dir} is another run: {described(refused)}; "
                          "resume with the values it was saved with, or pass --resume never and another --out")
    return described(changed)


def load_inputs(run_settings):
    """Before any process group: (training pool, held-out set), each checked."""
    s = run_settings

    def load(path, flag):
        return tasks.load_examples(path, s.prompt_key, s.answer_key, flag) if path else None
    examples, held_out = tasks.split_examples(load(s.data, "--data"), load(s.eval_data, "--eval-data"), s.seed,
                                              s.task, s.count_step)
    if s.reward:
        tasks.try_reward(s.reward, examples[0])
    return examples, held_out


# ---------------------------------------------------------------------------------------
# Rewards and advantages
# ---------------------------------------------------------------------------------------

def sample_batch(run, step, examples_now, params):
    """The rollout phase: (samples with their advantages set, rewards [N] fp32, the first
    rollout's draft acceptance, sampling metrics and the first rollout's probe of the
    weights it sampled with: probe_text, probe_logprob, weight_version). One rollout of `examples_now`; with
    --dynamic-sampling the groups whose rewards are all equal are dropped and round r
    rolls out as many prompts again, drawn from (seed, step, r), until the batch holds as
    many informative groups as prompts, or --max-sampling-rounds rollouts ran (the dropped
    groups then fill it, in the order drawn: their advantages are 0)."""
    s, wanted = run.settings, len(examples_now)
    kept, dropped, informative_count = [], [], 0
    for sampling_round in range(s.max_sampling_rounds):
        if sampling_round:
            examples_now = tasks.sample_prompts(run.examples, step, wanted, s.seed, sampling_round)
        samples, round_acceptance, round_probe = rollout.generate(run.engines, run.policy.model, run.tokenizer,
                                                                  examples_now, step, params, s.seed, run.rank,
                                                                  sampling_round)
        if not sampling_round:
            # The drafting metrics and the probe are the step's first rollout's.
            acceptance, probe = round_acceptance, round_probe
        rows = credit_rows(samples, run.credit, s)
        means = torch.tensor([sum(row) / len(row) for row in rows])
        informative = grpo_loss.informative_groups(means, s.group_size).tolist()
        informative_count += sum(informative)
        for group, useful in enumerate(informative):
            members = slice(group * s.group_size, (group + 1) * s.group_size)
            (kept if useful or not s.dynamic_sampling else dropped).append((samples[members], rows[members]))
        if len(kept) >= wanted:
            break
    batch = (kept + dropped)[:wanted]
    samples = [sample for members, _ in batch for sample in members]
    rewards = set_advantages(samples, [row for _, rows in batch for row in rows], s)
    if torch.cuda.is_available():
        run.engines.sleep(level=sleep_level(s))
    metrics = {"sampling_rounds": sampling_round + 1,
               "informative_group_share": informative_count / ((sampling_round + 1) * wanted), **probe}
    if s.data:
        metrics["truncated_fraction"] = sum(sample["truncated"] for sample in samples) / len(samples)
    return samples, rewards, acceptance, metrics


def credit_rows(samples, credit, run):
    """Each sample's credits ([floats]: per token, or one for the sequence), with DAPO's
    soft overlong punishment (--overlong-buffer) added to each."""
    rows = [refusing(credit, sample) for sample in samples]
    if not run.overlong_buffer:
        return rows
    lengths = torch.tensor([len(sample["response_ids"]) for sample in samples])
    penalties = grpo_loss.overlong_penalty(lengths, run.max_new_tokens, run.overlong_buffer, run.overlong_penalty)
    return [[value + penalty for value in row] for row, penalty in zip(rows, penalties.tolist())]


def set_advantages(samples, rows, run):
    """Rewards [N] fp32 (each completion's mean credit); sets each sample's per-token
    advantages and, under --overlong-filter, whether it is in the loss. Per-token credits of
    unequal lengths are zero-padded for the per-position group baseline; a sequence reward
    spreads over its tokens."""
    lengths = [len(row) for row in rows]
    width = max(lengths)
    credits = torch.tensor([row + [0.0] * (width - len(row)) for row in rows])          # [N, L]
    advantages = grpo_loss.group_advantages(credits, run.group_size, run.advantage)
    for sample, advantage, length in zip(samples, advantages, lengths):
        sample["advantages"] = advantage[:length].expand(len(sample["response_ids"]))
        if run.overlong_filter:
            sample["in_loss"] = not sample["truncated"]
    # The padding adds zeros: each row's sum is its credits'.
    return credits.sum(dim=1) / torch.tensor(lengths, dtype=credits.dtype)


def refusing(function, *args):
    """`function(*args)`, a tasks.InputError (bad data, a bad reward) turned into a refusal."""
    try:
        return function(*args)
    except tasks.InputError as error:
        raise usage_error(str(error)) from None


# ---------------------------------------------------------------------------------------
# Sync, evaluation and the step's record
# ---------------------------------------------------------------------------------------

def sync_weights(engines, policy, step):
    """The sync phase: push every weight, MTP draft included, into the engine that rolled
    out (woken on a GPU; the other catches up when it is next used) and check its draft
    every --check-draft-every steps. The next rollout probes what it holds (sample_batch)."""
    checkpoint.fault_point("sync", step)
    rollout.push_weights(engines, engines.active(), policy.model, step)


def evaluate(llm, held_out, tokenizer, credit, run, rank):
    """Greedy completions of the held-out examples, scored like training's:
    {eval_accuracy (reward 1), eval_reward_mean, eval_response_length}, on every rank."""
    params = rollout.sampling_params(1, 0.0, run.max_new_tokens, ignore_eos=run.data is None)
    samples, _, _ = rollout.rollout(llm, tokenizer, held_out, params, run.rollout_tp, rank)
    rewards = torch.tensor([sum(row) / len(row) for row in (refusing(credit, sample) for sample in samples)])
    return {"eval_accuracy": (rewards == 1).float().mean().item(), "eval_reward_mean": rewards.mean().item(),
            "eval_response_length": sum(len(s["response_ids"]) for s in samples) / len(samples)}


def draft_record(engines, acceptance, checked, tried):
    """The step's drafting metrics: draft_tokens (k of the rollout, 0: none), the rollout's
    acceptance_rate, mean_acceptance_length and acceptance_by_depth ([A_1..A_k], A_i the
    share of verify steps that accepted the first i drafts; None without drafting), and
    under auto check_acceptance_by_depth (the tune phase's check, at the deepest k, on the
    steps it ran) and realized_speedups (each k's fastest try so far relative to k = 0's
    tokens/s, None where not tried yet, on the steps whose rollout was a try)."""
    record = {"draft_tokens": engines.draft_tokens,
              "acceptance_rate": acceptance["acceptance_rate"] if acceptance else None,
              "mean_acceptance_length": acceptance["mean_acceptance_length"] if acceptance else None,
              "acceptance_by_depth": draft_tuner.acceptance_by_depth(acceptance) or None}
    if checked is not None:
        record["check_acceptance_by_depth"] = draft_tuner.acceptance_by_depth(checked)
    if tried:
        record["realized_speedups"] = engines.tuner.realized_speeds()
    return record


# ---------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------

@dataclasses.dataclass
class Run:
    """Everything a step needs, built once by `start`."""
    settings: argparse.Namespace
    rank: int
    world_size: int
    device: torch.device
    tokenizer: object
    credit: object
    policy: trainer.Policy
    engines: rollout.Engines
    examples: list
    held_out: list
    start_step: int
    model_dir: str
    lock: object = None  # rank 0's hold on OUT/.lock


def header(run, args):
    """The run's first lines (rank 0): model, layout, drafting, the flags `args` sets
    away from their defaults."""
    s, defaults = run.settings, vars(parse_args([]))
    changed = [f"--{name.replace('_', '-')} {value}" for name, value in vars(args).items() if value != defaults[name]]
    dp = run.world_size // (s.tp * s.cp)
    drafting = (f"auto, k in 0..{s.max_speculative_tokens}" if s.num_speculative_tokens == "auto"
                else f"k = {s.num_speculative_tokens}") if s.mtp_rollout else "off"
    return "\n".join([
        f"train_grpo.py: {s.model or f'built-in {s.builtin_model} model ({run.model_dir})'}, "
        + (f"--data {s.data}" if s.data else f"task {s.task}") + f", {s.steps} steps, out {s.out}",
        f"layout: {run.world_size} processes x {torch.get_num_threads()} thread(s) on {run.device.type}, tp {s.tp} "
        f"cp {s.cp} dp {dp}" + (f" ep {s.ep}" if s.ep > 1 else "") + f", rollout tp {s.rollout_tp}; "
        f"{s.prompts_per_step} prompts x {s.group_size} completions per dp rank"
        + (", each prompt trained once" if s.shared_prefix else "")
        + f"; {'bf16' if s.bf16 else 'fp32'}; MTP drafting {drafting}, training {'on' if s.mtp_train else 'off'}",
        "flags: " + (" ".join(changed) or "all defaults") + (f"; resumed at step {run.start_step}" if run.start_step
                                                            else "")])


def start(run_settings, resume_dir, examples, held_out):
    """Process group, tokenizer, policy, engines and checkpoint: the run before step 1."""
    s = run_settings
    rank, world_size, device = init_distributed()
    lock = lock_out(s.out, rank)
    random.seed(s.seed)
    torch.manual_seed(s.seed)
    # The built-in model is written once and cached; only rank 0 writes it.
    model_dir = s.model or broadcast(write_builtin_model(s.builtin_model) if rank == 0 else None)
    # The one tokenizer of prompts and answers (vLLM loads the same, through transformers).
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if s.data:
        refusing(tasks.check_prompts, examples + held_out, tokenizer, s.max_positions, s.max_new_tokens)
    credit = refusing(tasks.credit_function, tokenizer, None if s.data else s.task, s.count_step, s.reward)
    init_model_parallel(tensor_parallel=s.tp, context_parallel=s.cp, expert_parallel=s.ep, seed=s.seed)
    mtp_patch.patch_megatron_mtp()
    policy = trainer.build_policy(model_dir, s)
    engines = rollout.build_engines(
        model_dir, mtp_rollout=s.mtp_rollout, num_speculative_tokens=s.num_speculative_tokens,
        max_speculative_tokens=s.max_speculative_tokens, check_draft_every=s.check_draft_every, rank=rank,
        dtype="bfloat16" if s.bf16 else "float32", rollout_tp=s.rollout_tp, seed=s.seed, temperature=s.temperature,
        max_model_len=s.max_positions, spec_overrides=s.spec_config, gpu_memory_utilization=s.gpu_memory_utilization,
        kv_cache_bytes=s.kv_cache_bytes)
    start_step = load_state(resume_dir, policy, engines, rank, s.lr) if resume_dir else 0
    return Run(s, rank, world_size, device, tokenizer, credit, policy, engines, examples, held_out, start_step,
               model_dir, lock)


def lock_out(out, rank):
    """Rank 0 holds OUT/.lock for the run (checkpoint.lock_out); every rank stops, before any
    model exists, when another run holds it."""
    lock, problem = None, None
    if rank == 0:
        try:
            lock = checkpoint.lock_out(out)
        except checkpoint.CheckpointError as error:
            problem = str(error)
    problem = broadcast(problem)
    if problem:
        raise usage_error(problem)
    return lock


def load_state(directory, policy, engines, rank, lr):
    """Restore this rank's model and optimizer state (and auto's draft tuner, when both this
    run and the checkpoint have one of the same depth); returns the step it was saved at.
    The optimizer continues at `lr` (a resumed run may change it). The engines receive the
    weights when they are next used."""
    state = checkpoint.load_rank_state(directory, rank)
    policy.model.load_state_dict(state["model"])
    with cuda_on_cpu():
        policy.optimizer.load_state_dict(state["optimizer"])
    for group in policy.optimizer.param_groups:
        group["lr"] = lr
    tuner = state.get("draft_tuner")
    if engines.tuner is not None and tuner is not None and tuner["max_tokens"] == engines.tuner.max_tokens:
        engines.tuner.load_state_dict(tuner)
    return state["step"]


def save_state(run, step):
    state = {"model": run.policy.model.state_dict(), "optimizer": run.policy.optimizer.state_dict(), "step": step}
    if run.engines.tuner is not None:
        # Its tries and acceptance: the resumed run drafts as the uninterrupted one would.
        state["draft_tuner"] = run.engines.tuner.state_dict()
    meta = dict(run_layout(run.settings, run.world_size), flags=vars(run.settings))
    refusing(checkpoint.save_checkpoint, run.settings.out, step, state, meta, run.settings.keep_checkpoints, run.rank)


def run_layout(run_settings, world_size):
    """What a checkpoint must match to be resumed: the process layout and the model (from
    the resolved settings)."""
    s = run_settings
    return {"world_size": world_size, "tp": s.tp, "cp": s.cp, "ep": s.ep, "rollout_tp": s.rollout_tp,
            "model": os.path.abspath(s.model) if s.model else f"built-in {s.builtin_model}"}


def broadcast(value):
    holder = [value]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def open_outputs(run, resume_dir, args, changed):
    """(metrics.jsonl's path, the records kept from before the start step, a TensorBoard
    writer or None, a W&B run or None); records and loggers on rank 0 only."""
    os.makedirs(run.settings.out, exist_ok=True)
    metrics_path = os.path.join(run.settings.out, "metrics.jsonl")
    if run.rank != 0:
        return metrics_path, [], None, None
    print(header(run, args), flush=True)
    if run.start_step:
        print(f"resumed from {resume_dir} (step {run.start_step})" + (f" with {changed}" if changed else ""),
              flush=True)
    writer = run_log.open_tensorboard(run.settings.out, run.start_step) if run.settings.tensorboard else None
    wandb_run = run_log.open_wandb(run.settings.out, run.settings.wandb_project, vars(run.settings), run.start_step)
    return metrics_path, checkpoint.keep_records(metrics_path, run.start_step), writer, wandb_run


def main(args):
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    s = check_args(args, world_size)
    resume_dir = refusing(checkpoint.choose_checkpoint, s.out, s.resume, run_layout(s, world_size))
    changed = resume_flag_changes(resume_dir, s) if resume_dir else ""
    examples, held_out = refusing(load_inputs, s)
    # SIGTERM / SIGINT from here on: stop after the step under way, with a checkpoint.
    stop = checkpoint.StopRequest()
    run = start(s, resume_dir, examples, held_out)
    engines, policy, tokenizer, rank = run.engines, run.policy, run.tokenizer, run.rank
    params = rollout.sampling_params(s.group_size, s.temperature, s.max_new_tokens, ignore_eos=s.data is None)
    check_params = rollout.sampling_params(s.group_size, s.temperature, draft_tuner.ACCEPTANCE_CHECK_TOKENS,
                                           ignore_eos=True)
    per_rank = s.prompts_per_step * s.group_size
    dp_rank, dp_size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    metrics_path, records, writer, wandb_run = open_outputs(run, resume_dir, args, changed)
    started = time.time()

    for step in range(run.start_step + 1, s.steps + 1):
        timer = run_log.PhaseTimer()
        # Prompts: the same examples on every rank, from (seed, step) alone
        examples_now = tasks.sample_prompts(examples, step, s.prompts_per_step * dp_size, s.seed)
        # Tune: how many tokens the MTP head drafts in this rollout (auto)
        with timer("tune"):
            checked, tried = rollout.tune_draft_tokens(engines, policy.model, tokenizer, examples_now, step,
                                                       check_params, s.acceptance_check_every, s.tune_every, rank)
        # Rollout: vLLM samples --group-size completions per prompt, the MTP head drafting;
        # rewards and GRPO advantages (--dynamic-sampling: more rollouts for informative groups)
        with timer("rollout"):
            samples, rewards, acceptance, sampling = sample_batch(run, step, examples_now, params)
        # The policy loss on this data-parallel rank's share
        with timer("train"):
            train_sums = trainer.train(policy, samples[dp_rank * per_rank:(dp_rank + 1) * per_rank], s)
        # Sync: the new weights, MTP draft included, into vLLM
        with timer("sync"):
            sync_weights(engines, policy, step)
        # Evaluate: greedy on the held-out set, every --eval-every steps and after the last
        eval_metrics = {}
        if step % s.eval_every == 0 or step == s.steps:
            with timer("eval"):
                eval_metrics = evaluate(engines.active(), held_out, tokenizer, run.credit, s, rank)
        # Log and checkpoint
        record = run_log.step_record(step, samples, rewards, trainer.reduce_metrics(train_sums, run.device),
                                     draft_record(engines, acceptance, checked, tried), eval_metrics, timer.seconds)
        record.update(sampling)
        if rank == 0:
            records.append(record)
            run_log.log_step(record, metrics_path, writer, s.steps, time.time() - started, step - run.start_step,
                             wandb_run)
        stop_signal = stop.agreed(run.device)
        if step % s.save_every == 0 or step == s.steps or stop_signal:
            save_state(run, step)
        if stop_signal:
            raise stopped(run, step, stop_signal)

    finish(run, records, (writer, wandb_run), time.time() - started)
    return records


def stopped(run, step, signum):
    """The SystemExit of a run stopped by a signal after `step` (status 128 + its number, as
    the signal itself would give), said once."""
    if run.rank == 0:
        print(f"train_grpo.py: stopped by {signal.Signals(signum).name} after step {step}; its checkpoint is in "
              f"{os.path.join(run.settings.out, checkpoint.CHECKPOINTS_DIR)}, and the same command resumes from it",
              file=sys.stderr, flush=True)
    return SystemExit(128 + signum)


def sleep_level(run_settings):
    """vLLM's sleep level after a GPU rollout: 2 drops its weights (every push sends them
    all again); 1 keeps a host copy, needed when the draft drafts but does not train
    (nothing refills it)."""
    return 1 if run_settings.mtp_rollout and not run_settings.mtp_train else 2


def finish(run, records, loggers, seconds):
    """The trained policy as a HF checkpoint in OUT/final, the plots, the closing summary;
    `loggers` (TensorBoard's writer, the W&B run; each None when off) are closed."""
    out = run.settings.out
    hf_weights.save_hf_checkpoint(run.policy.model, run.model_dir, os.path.join(out, "final"))
    writer, wandb_run = loggers
    if writer is not None:
        writer.close()
    if wandb_run is not None:
        wandb_run.finish()
    if run.rank != 0 or not records:
        return
    run_log.plot_curves(records, os.path.join(out, "curves.png"))
    written = [os.path.join(out, name) for name in ("metrics.jsonl", "curves.png")]
    if run_log.plot_acceptance_against_entropy(records, os.path.join(out, "acceptance_vs_entropy.png")):
        written.append(os.path.join(out, "acceptance_vs_entropy.png"))
    print(run_log.summary(records, seconds, run.settings.steps - run.start_step), flush=True)
    print(f"wrote {', '.join(written)}, {os.path.join(out, 'final')}", flush=True)


if __name__ == "__main__":
    main(parse_args())
