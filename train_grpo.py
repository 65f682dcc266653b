"""GRPO on Megatron-Core with colocated vLLM rollouts drafted by the model's own MTP head.

One process per device under torchrun. Each process holds a Megatron-Core policy shard
(tensor parallel --tp, context parallel --cp, data parallel = the rest) and a vLLM engine
on the same device (distributed_executor_backend="external_launcher", rollout tensor
parallel --rollout-tp). Each step, one call per phase in `main`'s loop:

    prompts -> (tune: how many tokens to draft) -> vLLM (rollout, MTP drafts) -> rewards
            -> GRPO advantages -> cp_thd packs -> forward (Megatron) -> PPO loss (+ MTP loss)
            -> megatron-core Adam -> weight_sync -> vLLM (the draft checked against Megatron's)

    torchrun --nproc_per_node 2 train_grpo.py                       # CPU: tiny model, repeat task
    torchrun --nproc_per_node 2 train_grpo.py --task count          # CPU: 16-layer model, long answers
    torchrun --nproc_per_node 8 train_grpo.py --model DIR --tp 2 --cp 2 --rollout-tp 2

Built-in tasks (no --data), per-token credit: each answer position gets its own
group-baselined advantage, and a random policy over the 128-token vocabulary earns a
little (about 1%).
- repeat (the default, on the 2-layer tiny model): "repeat:c" -> "ccc", a letter from a
  small alphabet; a token's credit is 1 where it equals the answer's at its place. Each
  answer token only has to repeat the token before it: the random-init model finds it
  by RL alone in a few minutes on 2 CPU cores.
- count (on the 16-layer deep model): "count:7" -> the next 32 digits counting up mod 10,
  "8901..."; a digit earns its credit when it follows the one before it. Answers long
  enough to draft, a model deep enough for a draft to be cheap next to a target step.
MTP drafting: `--num-speculative-tokens auto` (the default) drafts the k (0 = none) whose
rollouts this engine measures fastest at the rollout's concurrency (spec_config.DraftTuner);
every push into a drafting engine is followed by a check that vLLM's draft holds
Megatron's MTP weights (weight_sync.check_draft). With --data, examples come from a
.jsonl or .parquet file, in our layout ({"prompt", "answer"}) or verl's (prompt as chat
messages, answer under reward_model.ground_truth), with an exact-match reward (numeric
when the answer is a number). Chat-message prompts go through the tokenizer's chat
template; every prompt reaches vLLM as token ids, so vLLM samples from exactly the
tokens Megatron trains on. Metrics: OUT/metrics.jsonl, TensorBoard under
OUT/tensorboard, curves.png and acceptance_vs_entropy.png at the end.
"""

import argparse
import contextlib
import dataclasses
import functools
import importlib.util
import inspect
import json
import math
import os
import random
import re
import shutil
import signal
import sys
import time

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler

import mtp_patch
import spec_config
import tiny_model
import weight_sync
from cpu_backend import cuda_on_cpu, init_distributed, init_model_parallel
from forward import forward_logprobs
from megatron_model import DEFAULT_MTP_LOSS_SCALING_FACTOR, build_gpt_model, load_hf_config

# Built-in tasks (no --data): the symbols prompts are drawn from, the symbols held out
# for evaluation (training never sees them: held-out accuracy says whether the policy
# learned the rule or memorised answers), the answer length, and the built-in model
# (tiny_model.BUILTIN_SIZES) and learning rate each runs with by default (the deep model's
# 16 thin layers learn the count rule in about 60 steps at 1e-3, hardly at 3e-4).
TASKS = {
    "repeat": {"train": "abcde", "held_out": "fghij", "length": 3, "model": "tiny", "lr": 3e-4},
    "count": {"train": "01234567", "held_out": "89", "length": 32, "model": "deep", "lr": 1e-3},
}
DATA_LR = 3e-4
DIGITS = "0123456789"
EVAL_HOLDOUT_FRACTION = 0.1
EVAL_HOLDOUT_MAX = 256
PROBE_PROMPT = "repeat:a"
PROBE_TOKENS = 4
# --num-speculative-tokens auto, while no rollout drafts: an acceptance check's new tokens
# (a few verify steps at the deepest k) and prompts per engine (x --group-size sequences).
ACCEPTANCE_CHECK_TOKENS = 12
ACCEPTANCE_CHECK_PROMPTS = 2
NUMERIC_TOLERANCE = 1e-6
ADVANTAGE_EPS = 1e-6
ADAM_EPS = 1e-8
SEED_STRIDE = 1_000_003  # a prime: seeds of (seed, step, engine) never collide in practice
KL_LOG_RATIO_BOUND = 20.0  # k3 = exp(x) - x - 1 overflows fp32 past ~88; the bound keeps it finite
DATA_FORMATS = (".jsonl", ".parquet")
# --data's default response limit: short answers (a number); reasoning needs --max-new-tokens.
DATA_MAX_NEW_TOKENS = 3
DEFAULT_PROMPT_KEY = "prompt"
# Where an example's answer lives when --answer-key is not given: our layout's "answer",
# then verl's (its example preprocessors write reward_model = {style, ground_truth}).
DEFAULT_ANSWER_KEYS = ("answer", "reward_model.ground_truth")


def usage_error(message):
    """The SystemExit for bad input: rank 0 prints `message`, every process exits non-zero."""
    return SystemExit(f"train_grpo.py: {message}" if int(os.environ.get("RANK", "0")) == 0 else 2)


class _ArgumentParser(argparse.ArgumentParser):
    def error(self, message):
        # argparse's own checks (types, choices) speak once, on rank 0, like ours.
        raise usage_error(f"{message} (--help lists every flag)")


def draft_tokens_flag(value):
    """--num-speculative-tokens: "auto" or an int >= 1."""
    if value == "auto":
        return value
    if not re.fullmatch(r"\d+", value) or int(value) < 1:
        raise argparse.ArgumentTypeError(f"{value!r}: expected auto or an int >= 1")
    return int(value)


def parse_args(argv=None):
    p = _ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default=None,
                   help="MiMo-style HF checkpoint dir; default: the built-in model of --builtin-model")
    p.add_argument("--builtin-model", choices=sorted(tiny_model.BUILTIN_SIZES), default=None,
                   help="the built-in model (written once under runs/) used without --model; default: the task's "
                        "(" + ", ".join(f"{task}: {spec['model']}" for task, spec in TASKS.items()) + ")")
    p.add_argument("--task", choices=sorted(TASKS), default="repeat",
                   help="built-in task without --data: repeat ('repeat:c' -> 'ccc', per-letter credit) or count "
                        f"('count:7' -> the next {TASKS['count']['length']} digits counting up mod 10, '8901...', "
                        "credit for each digit that follows the one before)")
    p.add_argument("--count-step", type=int, default=1,
                   help="--task count counts in steps of this many mod 10 (2: 'count:7' -> '9135...'); a policy "
                        "trained on one step and then on another is a policy that moves away from its MTP draft")
    p.add_argument("--data", default=None,
                   help="examples, .jsonl or .parquet: {prompt, answer} rows, or verl's layout (prompt as chat "
                        "messages, answer under reward_model.ground_truth); default: the built-in --task")
    p.add_argument("--prompt-key", default=DEFAULT_PROMPT_KEY,
                   help="--data field holding the prompt (a string or a list of {role, content} chat messages); "
                        "a dotted path reaches into nested fields")
    p.add_argument("--answer-key", default=None,
                   help="--data field holding the answer, a dotted path reaches into nested fields; default: "
                        + " or ".join(DEFAULT_ANSWER_KEYS))
    p.add_argument("--eval-data", default=None,
                   help="held-out examples in --data's formats and keys; default: the built-in task's held-out "
                        f"prompts, or with --data a fixed {EVAL_HOLDOUT_FRACTION:.0%}% of it (at most "
                        f"{EVAL_HOLDOUT_MAX}) that training never samples")
    p.add_argument("--eval-every", type=int, default=25,
                   help="greedy accuracy and mean reward on the held-out set every N steps (and after the last)")
    p.add_argument("--reward", default=None, metavar="FILE.py:FUNCTION",
                   help="your reward: FUNCTION(prompt: str, response: str, answer: str) -> float or a list of "
                        "per-token floats; default: per-character credit (built-in task), exact match (--data)")
    p.add_argument("--out", default="runs/grpo",
                   help="metrics.jsonl, curves.png, tensorboard/ event files, checkpoints, final HF dir")
    p.add_argument("--tensorboard", action=argparse.BooleanOptionalAction, default=True,
                   help="also write every metric to TensorBoard event files under OUT/tensorboard")
    p.add_argument("--resume", default="auto",
                   help="auto: continue from the newest complete checkpoint in OUT/checkpoints if there is one, "
                        "else start fresh (so torchrun --max-restarts survives a killed worker); never: start fresh "
                        "(refused if OUT holds checkpoints); or a checkpoint dir (OUT/checkpoints/step_N, or a run's "
                        "OUT/checkpoints for its newest)")
    p.add_argument("--steps", type=int, default=150, help="training steps (one rollout batch each)")
    p.add_argument("--seed", type=int, default=0, help="seed of data, init and sampling")
    p.add_argument("--tp", type=int, default=1, help="Megatron tensor parallel size")
    p.add_argument("--cp", type=int, default=1, help="Megatron context parallel size")
    p.add_argument("--rollout-tp", type=int, default=1, help="vLLM tensor parallel size")
    p.add_argument("--prompts-per-step", type=int, default=16, help="prompts per data-parallel rank per step")
    p.add_argument("--group-size", type=int, default=8, help="completions per prompt (the GRPO group)")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="response length limit (a built-in task always samples exactly this many); default: the "
                        "built-in task's answer length, " + ", ".join(f"{task} {spec['length']}"
                                                                      for task, spec in TASKS.items())
                        + ", or with --data " + str(DATA_MAX_NEW_TOKENS))
    p.add_argument("--temperature", type=float, default=1.0, help="rollout sampling temperature (> 0)")
    p.add_argument("--lr", type=float, default=None,
                   help="Adam learning rate; default: the built-in task's, " + ", ".join(
                       f"{task} {spec['lr']:g}" for task, spec in TASKS.items()) + f", or with --data {DATA_LR:g}")
    p.add_argument("--micro-batches", type=int, default=2,
                   help="gradient accumulation micro-batches per optimizer step (per mini-batch)")
    p.add_argument("--mini-batches", type=int, default=1,
                   help="optimizer steps per pass over the rollout batch; > 1 (or --ppo-epochs > 1) makes the PPO "
                        "ratio move and the clip act")
    p.add_argument("--ppo-epochs", type=int, default=1, help="passes over each rollout batch")
    p.add_argument("--grad-clip", type=float, default=1.0, help="global gradient-norm clip")
    p.add_argument("--advantage", choices=["grpo", "mean-only", "leave-one-out"], default="grpo",
                   help="group baseline: mean/std (GRPO), mean only (Dr. GRPO), leave-one-out mean")
    p.add_argument("--loss-agg", choices=["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"],
                   default="token-mean", help="how per-token losses are averaged")
    p.add_argument("--clip-low", type=float, default=0.2, help="PPO ratio clip below 1")
    p.add_argument("--clip-high", type=float, default=0.28, help="PPO ratio clip above 1")
    p.add_argument("--dual-clip", type=float, default=3.0, help="dual-clip bound for negative advantages (> 1)")
    p.add_argument("--tis-cap", type=float, default=2.0,
                   help="truncated importance sampling: weight min(p_megatron / p_vllm, cap); 0 disables")
    p.add_argument("--kl-coef", type=float, default=0.0, help="k3 KL to the initial policy (0: no reference model)")
    p.add_argument("--entropy-coef", type=float, default=0.02,
                   help="entropy bonus (keeps a random-init policy from collapsing onto one answer)")
    p.add_argument("--mtp-train", action=argparse.BooleanOptionalAction, default=True,
                   help="train the MTP head (its loss rides on the policy's backward pass)")
    p.add_argument("--mtp-rollout", action=argparse.BooleanOptionalAction, default=None,
                   help="draft with the MTP head in vLLM (speculative decoding); default: on when the model "
                        "has MTP layers")
    p.add_argument("--mtp-loss-scale", type=float, default=1.0,
                   help=f"multiplies megatron's MTP loss weight ({DEFAULT_MTP_LOSS_SCALING_FACTOR} / MTP layers): "
                        f"the MTP loss enters the gradient with weight {DEFAULT_MTP_LOSS_SCALING_FACTOR} x this "
                        f"/ MTP layers")
    p.add_argument("--num-speculative-tokens", type=draft_tokens_flag, default="auto",
                   help="MTP draft tokens per verify step, or auto: the k in 0..--max-speculative-tokens (0: no "
                        "drafting) whose rollouts run fastest: every --tune-every steps, and when the acceptance "
                        "moved far, the next rollouts try in turn k = 0 and every k that could pay, and the fastest "
                        "stays")
    p.add_argument("--max-speculative-tokens", type=int, default=3, help="the deepest k auto considers")
    p.add_argument("--tune-every", type=int, default=50,
                   help="auto: every N steps (and at the first) the rollouts try each k that could pay again, in "
                        "turns, on the current weights")
    p.add_argument("--acceptance-check-every", type=int, default=5,
                   help="auto, while no rollout drafts: every N steps measure the draft's acceptance at every depth on "
                        f"{ACCEPTANCE_CHECK_PROMPTS} of the step's prompts per engine")
    p.add_argument("--check-draft-every", type=int, default=1,
                   help="every N weight pushes, check that vLLM's MTP draft holds exactly Megatron's MTP weights and "
                        "stop naming the tensor when not (0: never)")
    p.add_argument("--spec-config", default=None, help="JSON object merged into vLLM's speculative_config")
    p.add_argument("--save-every", type=int, default=50, help="checkpoint every N steps (and at the end)")
    p.add_argument("--keep-checkpoints", type=int, default=2, help="how many of the newest checkpoints to keep")
    p.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=None,
                   help="bf16 weights and rollout (default: on with CUDA, off on CPU)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.3, help="vLLM's share of GPU memory")
    p.add_argument("--kv-cache-bytes", type=int, default=2**28, help="vLLM KV cache size on CPU")
    args = p.parse_args(argv)
    if args.max_new_tokens is None:
        args.max_new_tokens = DATA_MAX_NEW_TOKENS if args.data else TASKS[args.task]["length"]
    if args.lr is None:
        args.lr = DATA_LR if args.data else TASKS[args.task]["lr"]
    return args


# ---------------------------------------------------------------------------------------
# Flags: every one checked before any process group, model or engine exists
# ---------------------------------------------------------------------------------------

# flag -> (bound, whether the bound itself is allowed)
AT_LEAST = {"steps": (1, True), "tp": (1, True), "cp": (1, True), "rollout_tp": (1, True),
            "prompts_per_step": (1, True), "group_size": (2, True), "max_new_tokens": (1, True),
            "micro_batches": (1, True), "mini_batches": (1, True), "ppo_epochs": (1, True),
            "eval_every": (1, True), "max_speculative_tokens": (1, True), "tune_every": (1, True),
            "acceptance_check_every": (1, True), "check_draft_every": (0, True), "save_every": (1, True),
            "keep_checkpoints": (1, True),
            "kv_cache_bytes": (1, True), "temperature": (0, False), "lr": (0, False), "grad_clip": (0, False),
            "gpu_memory_utilization": (0, False), "clip_low": (0, True), "clip_high": (0, True),
            "dual_clip": (1, False), "tis_cap": (0, True), "count_step": (1, True), "kl_coef": (0, True),
            "entropy_coef": (0, True), "mtp_loss_scale": (0, True)}
AT_MOST = {"clip_low": (1, False), "gpu_memory_utilization": (1, True), "count_step": (9, True)}
WHY = {"temperature": " (greedy decoding would give every completion of a group the same answer)",
       "group_size": " (GRPO baselines each completion against the others of its prompt)",
       "dual_clip": " (it bounds the loss of negative advantages from below at dual-clip x advantage)"}


def flag_problems(args, world_size):
    """Every problem with the flags, each naming the flag, its value and what is expected."""
    problems = []
    for name, value in vars(args).items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, float) and not math.isfinite(value):
            problems.append(f"{flag} {value}: expected a finite number")
            continue
        for bounds, sign in ((AT_LEAST, ">"), (AT_MOST, "<")):
            if name in bounds:
                bound, inclusive = bounds[name]
                inside = value >= bound if sign == ">" else value <= bound
                if not inside or (value == bound and not inclusive):
                    problems.append(f"{flag} {value}: expected a number {sign}{'=' if inclusive else ''} {bound}"
                                    + WHY.get(name, ""))
    if problems:
        return problems
    if world_size % (args.tp * args.cp):
        problems.append(f"--tp {args.tp} x --cp {args.cp} = {args.tp * args.cp}: expected a divisor of the world "
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
    if args.data is not None and args.task != "repeat":
        problems.append(f"--task {args.task}: a built-in task, not used with --data {args.data!r}")
    if args.count_step != 1 and (args.data is not None or args.task != "count"):
        problems.append(f"--count-step {args.count_step}: only read with --task count")
    for flag, path in (("--data", args.data), ("--eval-data", args.eval_data)):
        if path is not None and not os.path.isfile(path):
            problems.append(f"{flag} {path!r}: no such file; expected a {' or '.join(DATA_FORMATS)} file of examples")
        elif path is not None and not path.endswith(DATA_FORMATS):
            problems.append(f"{flag} {path!r}: extension {os.path.splitext(path)[1] or '(none)'!r} is not read; "
                            f"expected {' or '.join(DATA_FORMATS)}")
        # Packages only some runs import: missing, they would stop the run after the model loads.
        elif path is not None and path.endswith(".parquet") and importlib.util.find_spec("pyarrow") is None:
            problems.append(f"{flag} {path!r}: reading Parquet needs pyarrow; pip install pyarrow")
    if args.tensorboard and importlib.util.find_spec("tensorboard") is None:
        problems.append("--tensorboard: the tensorboard package is not installed; pip install tensorboard or pass "
                        "--no-tensorboard")
    for flag, key, default in (("--prompt-key", args.prompt_key, DEFAULT_PROMPT_KEY),
                               ("--answer-key", args.answer_key, None)):
        if key is not None and not all(key.split(".")):
            problems.append(f"{flag} {key!r}: expected a field name or a dotted path such as "
                            f"{DEFAULT_ANSWER_KEYS[-1]}")
        elif key != default and args.data is None:
            problems.append(f"{flag} {key!r}: only read with --data (the built-in task has its own examples)")
    if args.reward is not None:
        problems += reward_problems(args.reward)
    problems += resume_problems(args, world_size)
    try:
        spec_config.build_mtp_speculative_config("mtp", deepest_draft(args), args.spec_config)
    except (TypeError, ValueError, RuntimeError) as error:
        problems.append(f"--spec-config {args.spec_config!r}: {error}")
    if not problems:
        problems += model_problems(args)
    return problems


def builtin_model(args):
    """(name, config.json dict) of the built-in model this run uses without --model."""
    name = args.builtin_model or TASKS[args.task]["model"]
    return name, tiny_model.mimo_config(**tiny_model.BUILTIN_SIZES[name])


def model_problems(args):
    """Flags that must fit the model's config.json (the built-in model's config without --model)."""
    if args.model is None:
        name, hf_config = builtin_model(args)
        where = f"the built-in {name} model"
    else:
        hf_config, where = load_hf_config(args.model), args.model
    problems = []
    if args.mtp_rollout and not hf_config.get("num_nextn_predict_layers", 0):
        problems.append(f"--mtp-rollout: {where} has no MTP layers (num_nextn_predict_layers is 0); "
                        "pass --no-mtp-rollout")
    kv_heads = hf_config.get("num_key_value_heads", hf_config["num_attention_heads"])
    for flag, size in (("--tp", args.tp), ("--rollout-tp", args.rollout_tp)):
        if kv_heads % size:
            problems.append(f"{flag} {size}: expected a divisor of {where}'s {kv_heads} key/value heads")
    return problems


def check_args(args, world_size):
    """Raise `usage_error` listing every problem with the flags; return the model's HF config."""
    problems = flag_problems(args, world_size)
    if problems:
        raise usage_error("\n  ".join(["bad flags:"] + problems))
    return builtin_model(args)[1] if args.model is None else load_hf_config(args.model)


# ---------------------------------------------------------------------------------------
# Data and reward
# ---------------------------------------------------------------------------------------

def task_examples(task, symbols, count_step):
    """A built-in task's examples, one per symbol: {prompt, answer} strings."""
    length = TASKS[task]["length"]
    if task == "repeat":
        return [{"prompt": f"repeat:{letter}", "answer": letter * length} for letter in symbols]
    return [{"prompt": f"count:{digit}",
             "answer": "".join(DIGITS[(int(digit) + k * count_step) % 10] for k in range(1, length + 1))}
            for digit in symbols]


def read_rows(path):
    """[(row number, record)] of a .jsonl or .parquet file; numbers are 1-based (a JSONL
    file's line numbers: blank lines are skipped but counted)."""
    if path.endswith(".parquet"):
        import pyarrow.parquet  # only --data FILE.parquet needs it
        return list(enumerate(pyarrow.parquet.read_table(path).to_pylist(), 1))
    rows = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rows.append((number, json.loads(line)))
            except json.JSONDecodeError as error:
                raise usage_error(f"--data {path}: row {number} is not JSON ({error.msg})")
    return rows


def lookup(record, key):
    """`record`'s value under `key`, a column name or a dotted path into nested dicts
    ("reward_model.ground_truth"); None when absent."""
    if key in record:
        return record[key]
    value = record
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


def is_chat(prompt):
    """Whether `prompt` is a list of chat messages ({role, content} dicts of strings)."""
    return isinstance(prompt, list) and len(prompt) > 0 and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in prompt)


def load_examples(path, prompt_key=DEFAULT_PROMPT_KEY, answer_key=None):
    """[{prompt, answer}] from a .jsonl or .parquet file, in our layout ({"prompt", "answer"})
    or verl's (prompt as chat messages, the answer under reward_model.ground_truth).

    prompt: a string, or a list of {role, content} messages (templated at tokenization);
    answer: a string. `answer_key` None tries DEFAULT_ANSWER_KEYS in order. A bad row stops
    with the file, its row number and the key.
    """
    answer_keys = DEFAULT_ANSWER_KEYS if answer_key is None else (answer_key,)
    examples = []
    for number, record in read_rows(path):
        where = f"--data {path}: row {number}"
        if not isinstance(record, dict):
            raise usage_error(f"{where} is {type(record).__name__}, expected an object of named fields")
        prompt = lookup(record, prompt_key)
        if prompt is None:
            raise usage_error(f"{where} has no key {prompt_key!r} (--prompt-key)")
        if not isinstance(prompt, str) and not is_chat(prompt):
            raise usage_error(f"{where}: {prompt_key!r} is {str(prompt)[:80]!r}; expected a string or a list of "
                              "{role, content} chat messages")
        answer = next((value for value in (lookup(record, key) for key in answer_keys) if value is not None), None)
        if answer is None:
            raise usage_error(f"{where} has no key {' nor '.join(map(repr, answer_keys))} (--answer-key)")
        if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
            raise usage_error(f"{where}: answer {str(answer)[:80]!r} is {type(answer).__name__}; expected a string "
                              "or a number")
        examples.append({"prompt": prompt, "answer": str(answer)})
    if not examples:
        raise usage_error(f"--data {path}: no examples")
    return examples


def prompt_token_ids(tokenizer, prompt):
    """The prompt's token ids, the one tokenization both vLLM and Megatron see: chat
    messages through the tokenizer's chat template (with the assistant header that opens
    the reply), a string as vLLM would encode it."""
    if isinstance(prompt, str):
        return tokenizer.encode(prompt)
    return list(tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True,
                                              return_dict=True)["input_ids"])


def check_prompts(examples, tokenizer, max_len, max_new_tokens):
    """Stop before any work on chat prompts without a chat template, or prompts too long."""
    if any(not isinstance(e["prompt"], str) for e in examples) and not tokenizer.chat_template:
        raise usage_error(f"--data has chat-message prompts but {tokenizer.name_or_path}'s tokenizer has no chat "
                          "template; expected a checkpoint with one (tokenizer_config.json's chat_template)")
    too_long = [e["prompt"] for e in examples
                if len(prompt_token_ids(tokenizer, e["prompt"])) + max_new_tokens > max_len]
    if too_long:
        raise usage_error(f"{len(too_long)} prompt(s) do not fit the context of {max_len} tokens with "
                          f"{max_new_tokens} new tokens; first: {str(too_long[0])[:80]!r}")


def token_credits(response_ids, answer_ids):
    """--task repeat: per-character credit, one reward per response token (1.0 where it
    equals the answer's token at its place)."""
    return [float(k < len(answer_ids) and token == answer_ids[k]) for k, token in enumerate(response_ids)]


@functools.lru_cache(maxsize=None)
def digit_successors(tokenizer, count_step):
    """{token id of digit d: token id of digit d + count_step mod 10}, each digit a single token.
    Cached: the same for every completion of a run (a tokenizer hashes by identity)."""
    ids = [tokenizer.encode(digit, add_special_tokens=False) for digit in DIGITS]
    if any(len(digit_ids) != 1 for digit_ids in ids):
        raise usage_error(f"--task count needs each digit to be one token; {tokenizer.name_or_path}'s tokenizer "
                          f"encodes {DIGITS!r} as {ids}")
    return {ids[d][0]: ids[(d + count_step) % 10][0] for d in range(10)}


def count_credits(start_id, response_ids, successors):
    """--task count: 1.0 for each response token that is the digit after the token before
    it (the prompt's last token, its digit, before the first): a digit after a wrong one
    still earns its credit, so every position teaches the same rule."""
    previous = [start_id] + response_ids[:-1]
    return [float(successors.get(before) == token) for before, token in zip(previous, response_ids)]


def reward(response, answer):
    """--data: exact match, or numeric match when the answer is a number; 0.0 or 1.0."""
    response = response.strip()
    try:
        return float(abs(float(response) - float(answer)) <= NUMERIC_TOLERANCE)
    except ValueError:
        return float(response == answer.strip())


def load_reward_function(spec):
    """--reward FILE.py:FUNCTION -> the function, after checking that the file exists and
    imports, that FUNCTION exists there, and that it takes (prompt, response, answer).
    Raises ValueError naming the file and the function."""
    path, _, name = spec.rpartition(":")
    if not path or not name:
        raise ValueError(f"--reward {spec!r}: expected FILE.py:FUNCTION")
    if not os.path.isfile(path):
        raise ValueError(f"--reward {spec!r}: no such file {path!r}")
    module_spec = importlib.util.spec_from_file_location(f"reward_{os.path.basename(path).rsplit('.', 1)[0]}", path)
    if module_spec is None:
        raise ValueError(f"--reward {spec!r}: {path!r} is not a Python file")
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except Exception as error:
        raise ValueError(f"--reward {spec!r}: {path} does not import ({type(error).__name__}: {error})") from error
    function = getattr(module, name, None)
    if not callable(function):
        raise ValueError(f"--reward {spec!r}: {path} has no function {name!r}")
    try:
        inspect.signature(function).bind("prompt", "response", "answer")
    except TypeError as error:
        raise ValueError(f"--reward {spec!r}: {name}{inspect.signature(function)} cannot be called as "
                         f"{name}(prompt, response, answer) ({error})") from None
    return function


def reward_problems(spec):
    try:
        load_reward_function(spec)
    except ValueError as error:
        return [str(error)]
    return []


def credits_of(sample, tokenizer, reward_function, args):
    """One completion's credit: a list of floats, one per response token (per-token credit)
    or a single one (a sequence reward). A user's reward that raises or returns anything
    but finite floats stops the run here, before the weights change."""
    example, response = sample["example"], sample["text"]
    if reward_function is None:
        if args.data is not None:
            return [reward(response, example["answer"])]
        if args.task == "count":
            return count_credits(sample["prompt_ids"][-1], sample["response_ids"],
                                 digit_successors(tokenizer, args.count_step))
        return token_credits(sample["response_ids"], tokenizer.encode(example["answer"], add_special_tokens=False))
    where = f"--reward {args.reward} on prompt {example['prompt'][:80]!r}, response {response[:80]!r}"
    try:
        value = reward_function(example["prompt"], response, example["answer"])
    except Exception as error:
        raise usage_error(f"{where} raised {type(error).__name__}: {error}; stopped before the weights changed")
    values = list(value) if isinstance(value, (list, tuple)) else [value]
    if isinstance(value, (list, tuple)) and len(values) != len(sample["response_ids"]):
        raise usage_error(f"{where} returned {len(values)} per-token rewards for {len(sample['response_ids'])} "
                          "response tokens; expected one per token or a single float")
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in values):
        raise usage_error(f"{where} returned {value!r}; expected a finite float or a list of them; stopped before "
                          "the weights changed")
    return [float(v) for v in values]


def group_advantages(rewards, group_size, mode):
    """[N] or [N, L] rewards, N in consecutive groups -> advantages of the same shape (fp32).

    With per-token rewards ([N, L], the built-in task's per-character credit) each answer
    position is baselined against the same position of the other completions in its group.
    """
    grouped = rewards.view(-1, group_size, *rewards.shape[1:])
    if mode == "leave-one-out":
        baseline = (grouped.sum(1, keepdim=True) - grouped) / (group_size - 1)
        return (grouped - baseline).view(rewards.shape)
    centred = grouped - grouped.mean(1, keepdim=True)
    if mode == "mean-only":
        return centred.view(rewards.shape)
    return (centred / (grouped.std(1, keepdim=True) + ADVANTAGE_EPS)).view(rewards.shape)


# ---------------------------------------------------------------------------------------
# Loss
# ---------------------------------------------------------------------------------------

def token_weights(loss_mask, seqlens, mode, num_sequences, num_tokens):
    """Per-token weights w with loss = sum(w * per_token_loss): the aggregation mode.

    loss_mask [T] fp32 (response predictions), seqlens [B]; counts are global (all
    data-parallel ranks and micro-batches), so summing gradients over ranks gives the mean.
    """
    if mode == "token-mean":
        return loss_mask / num_tokens
    if mode == "seq-mean-token-sum":
        return loss_mask / num_sequences
    seqlens = seqlens.to(loss_mask.device)
    sequence = torch.repeat_interleave(torch.arange(len(seqlens), device=loss_mask.device), seqlens)
    per_sequence = torch.zeros(len(seqlens), device=loss_mask.device).index_add_(0, sequence, loss_mask).clamp(min=1)
    return loss_mask / per_sequence[sequence] / num_sequences


def policy_loss(logprobs, old_logprobs, rollout_logprobs, advantages, args):
    """Per-token PPO loss with separate low/high clip, dual clip and truncated IS.

    All inputs [T] fp32: log-probs under the policy being trained (with grad), under the
    policy that sampled (old, Megatron's numerics) and under vLLM (rollout), advantages.
    ratio = p / p_old is clipped to [1 - clip_low, 1 + clip_high] the PPO way; for
    negative advantages the loss is also capped at -advantage x dual_clip; the whole is
    weighted by min(p_old / p_rollout, tis_cap) (truncated importance sampling, no grad).
    Returns (loss [T], where the clips acted: {"clip_low", "clip_high", "dual_clip"} [T]
    0/1 fp32). clip_low + clip_high is the usual clip fraction.
    """
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - args.clip_low, 1 + args.clip_high)
    loss = torch.maximum(unclipped, clipped)
    dual_bound = -advantages * args.dual_clip
    acted = {"clip_low": (clipped > unclipped) & (advantages < 0), "clip_high": (clipped > unclipped) & (advantages > 0),
             "dual_clip": (advantages < 0) & (loss > dual_bound)}
    loss = torch.where(advantages < 0, torch.minimum(loss, dual_bound), loss)
    if args.tis_cap > 0:
        loss = loss * torch.exp(old_logprobs - rollout_logprobs).clamp(max=args.tis_cap).detach()
    return loss, {name: where.float() for name, where in acted.items()}


# ---------------------------------------------------------------------------------------
# Setup: policy, optimizer, engine
# ---------------------------------------------------------------------------------------

@dataclasses.dataclass
class Policy:
    """The trainer's side: the GPTModel shard, megatron-core's DDP wrapper around it and its
    optimizer, and the frozen reference model for the KL term (None without --kl-coef)."""
    model: torch.nn.Module
    ddp_model: torch.nn.Module
    optimizer: object
    reference: torch.nn.Module = None


def build_optimizer(model, args):
    """megatron-core's DDP wrapper (bucketed gradient all-reduce over data x context
    parallel ranks into fp32 `main_grad` buffers) and its Adam (fp32 master weights for a
    bf16 model, global gradient-norm clipping); returns (ddp_model, optimizer).

    Freeze parameters before calling: DDP allocates buffers for the trainable ones only.
    """
    ddp_model = DistributedDataParallel(config=model.config, module=model, ddp_config=DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=False))
    config = OptimizerConfig(optimizer="adam", lr=args.lr, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.99,
                             adam_eps=ADAM_EPS, clip_grad=args.grad_clip, bf16=model.config.bf16,
                             params_dtype=model.config.params_dtype)
    with cuda_on_cpu():
        return ddp_model, get_megatron_optimizer(config, [ddp_model])


def build_policy(model_dir, args, device, dtype):
    """The policy from `model_dir`'s weights (and the reference model when --kl-coef > 0)."""
    def load(mtp):
        model = build_gpt_model(model_dir, mtp=mtp, tensor_parallel=args.tp, context_parallel=args.cp,
                                params_dtype=dtype).to(device)
        weight_sync.load_hf_into_megatron(model, model_dir)
        return model

    model = load(mtp=args.mtp_train)
    reference = load(mtp=False).eval() if args.kl_coef > 0 else None
    if args.mtp_train and args.mtp_rollout:
        # Megatron's MTP layer reads the trunk's hidden state after the final norm, vLLM's
        # MiMo drafter before it; RMSNorm is scale invariant, so both see the same input
        # only while the final norm's weight is uniform. Keep it as it is.
        model.decoder.final_layernorm.weight.requires_grad_(False)
    ddp_model, optimizer = build_optimizer(model, args)
    return Policy(model, ddp_model, optimizer, reference)


def deepest_draft(args):
    """The most draft tokens this run's engine may draft per verify step."""
    return args.max_speculative_tokens if args.num_speculative_tokens == "auto" else args.num_speculative_tokens


def build_engine(model_dir, args, rank, dtype, drafting):
    """One vLLM engine on this device: drafting with the MTP head (`drafting`: deepest_draft
    tokens, switchable down to 0 per rollout under auto) or not at all."""
    from vllm import LLM
    options = dict(model=model_dir, tensor_parallel_size=args.rollout_tp, distributed_executor_backend="external_launcher",
                   dtype=dtype, max_model_len=load_hf_config(model_dir).get("max_position_embeddings", 4096),
                   seed=args.seed + rank // args.rollout_tp, enforce_eager=not torch.cuda.is_available(),
                   disable_log_stats=False, weight_transfer_config=weight_sync.in_process_weight_transfer_config())
    if args.temperature != 1.0:
        # Log-probs of the tempered distribution the tokens were drawn from.
        options["logprobs_mode"] = "processed_logprobs"
    if torch.cuda.is_available():
        options.update(gpu_memory_utilization=args.gpu_memory_utilization, enable_sleep_mode=True)
    else:
        options.update(kv_cache_memory_bytes=args.kv_cache_bytes)
    if drafting:
        spec_config.fix_cpu_draft_sampling()
        speculative = spec_config.build_mtp_speculative_config("mtp", deepest_draft(args), args.spec_config)
        if args.num_speculative_tokens == "auto":
            speculative = spec_config.dynamic_speculative_config(speculative)
        options["speculative_config"] = speculative
        # Acceptance of exactly the rollout's requests (not the probe's).
        options["per_request_spec_decode_metrics"] = "summary"
    return LLM(**options)


@dataclasses.dataclass
class Engines:
    """The rollout side on this device. `plain` decodes without drafting (None with a fixed
    --num-speculative-tokens); `drafting` drafts with the MTP head (None with
    --no-mtp-rollout), under auto built with --max-speculative-tokens and switched to
    `draft_tokens` before each rollout; `draft_tokens` is the k of the next rollout (0: the
    plain engine rolls out); `tuner` (auto only) chooses it; `meter` reads the drafting
    engine's acceptance; `versions` is the step whose weights each engine holds (None:
    none, after a GPU sleep that dropped them); `asleep` the engines in vLLM's sleep mode."""
    plain: object
    drafting: object
    draft_tokens: int
    tuner: spec_config.DraftTuner = None
    meter: spec_config.SpecDecodeMeter = None
    versions: dict = dataclasses.field(default_factory=dict)
    asleep: set = dataclasses.field(default_factory=set)

    def active(self):
        return self.drafting if self.draft_tokens else self.plain

    def all(self):
        return [engine for engine in (self.plain, self.drafting) if engine is not None]

    def sleep(self, level):
        """GPU only: give every engine's memory to Megatron (level 2 drops the weights,
        level 1 keeps a host copy)."""
        for engine in self.all():
            if id(engine) not in self.asleep:
                engine.sleep(level=level)
                self.asleep.add(id(engine))
                if level == 2:
                    self.versions[id(engine)] = None

    def wake(self, engine):
        if id(engine) in self.asleep:
            engine.wake_up()
            self.asleep.discard(id(engine))


def build_engines(model_dir, args, rank, dtype):
    """This device's engines for the run's drafting mode (see `Engines`)."""
    auto = args.mtp_rollout and args.num_speculative_tokens == "auto"
    plain = build_engine(model_dir, args, rank, dtype, drafting=False) if auto or not args.mtp_rollout else None
    drafting = build_engine(model_dir, args, rank, dtype, drafting=True) if args.mtp_rollout else None
    engines = Engines(plain, drafting, draft_tokens=0 if auto or not args.mtp_rollout else args.num_speculative_tokens,
                      tuner=spec_config.DraftTuner(args.max_speculative_tokens) if auto else None,
                      meter=spec_config.SpecDecodeMeter(drafting) if drafting is not None else None)
    for engine in engines.all():
        engines.versions[id(engine)] = 0  # built from the model directory: the weights before step 1
    return engines


# ---------------------------------------------------------------------------------------
# Checkpoints: atomic, self-describing, resumed automatically
# ---------------------------------------------------------------------------------------
# OUT/checkpoints/step_000050/{rank0.pt, rank1.pt, ..., meta.json}. Each save is written
# into step_N.partial/, every file flushed to disk, meta.json (the layout, the step, each
# file's size) last; then the directory is renamed to step_N: a checkpoint directory
# either is complete or does not exist. --out must be storage every node sees.

CHECKPOINTS_DIR = "checkpoints"
CHECKPOINT_META = "meta.json"
# Set by the fault-tolerance tests: "PHASE:STEP" makes the last rank SIGKILL itself there,
# on torchrun's first attempt only (PHASE: train, after the optimizer step; save, after
# writing its file, before the checkpoint is published).
KILL_AT_ENV = "TRAIN_GRPO_KILL_AT"
# Set by the stale-draft test: "STEP" makes that step's weight push skip the MTP draft.
STALE_DRAFT_AT_ENV = "TRAIN_GRPO_STALE_DRAFT_AT"


def run_layout(args, world_size):
    """What a checkpoint must match to be resumed: the process layout and the model."""
    return {"world_size": world_size, "tp": args.tp, "cp": args.cp, "rollout_tp": args.rollout_tp,
            "model": os.path.abspath(args.model) if args.model else f"built-in {builtin_model(args)[0]}"}


def fault_point(phase, step):
    if os.environ.get(KILL_AT_ENV) == f"{phase}:{step}" and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0" \
            and dist.get_rank() == dist.get_world_size() - 1:
        os.kill(os.getpid(), signal.SIGKILL)


def _write_synced(path, write):
    """Write a file through `write(f)`, flushed to disk, under a temporary name renamed at the end."""
    with open(path + ".tmp", "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)


def save_checkpoint(args, policy, engines, step, rank, world_size):
    """Every rank writes its shard (and auto's draft tuner) into step_N.partial/; rank 0
    publishes step_N and keeps the newest --keep-checkpoints."""
    root = os.path.join(args.out, CHECKPOINTS_DIR)
    final = os.path.join(root, f"step_{step:06d}")
    staging = final + ".partial"
    if rank == 0:
        shutil.rmtree(staging, ignore_errors=True)
        os.makedirs(staging)
    dist.barrier()
    state = {"model": policy.model.state_dict(), "optimizer": policy.optimizer.state_dict(), "step": step}
    if engines.tuner is not None:
        # Its tries and acceptance: the resumed run drafts as the uninterrupted one would.
        state["draft_tuner"] = engines.tuner.state_dict()
    _write_synced(os.path.join(staging, f"rank{rank}.pt"), lambda f: torch.save(state, f))
    fault_point("save", step)
    dist.barrier()
    if rank == 0:
        files = {name: os.path.getsize(os.path.join(staging, name)) for name in sorted(os.listdir(staging))}
        meta = dict(run_layout(args, world_size), step=step, files=files)
        _write_synced(os.path.join(staging, CHECKPOINT_META), lambda f: f.write(json.dumps(meta, indent=1).encode()))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(staging, final)
        for old in checkpoint_dirs(root)[args.keep_checkpoints:]:
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


def choose_checkpoint(args, world_size):
    """The checkpoint directory this run continues from, or None to start fresh; a complete
    checkpoint of another layout or model is an error, an incomplete one is skipped with a
    warning naming the bad file."""
    if args.resume == "never":
        return None
    root = os.path.join(args.out, CHECKPOINTS_DIR) if args.resume == "auto" else args.resume
    candidates = [root] if os.path.isfile(os.path.join(root, CHECKPOINT_META)) else checkpoint_dirs(root)
    for directory in candidates:
        problem = checkpoint_problem(directory)
        if problem is not None:
            if int(os.environ.get("RANK", "0")) == 0:
                print(f"train_grpo.py: warning: checkpoint {directory} skipped: {problem}", file=sys.stderr, flush=True)
            continue
        with open(os.path.join(directory, CHECKPOINT_META)) as f:
            saved = json.load(f)
        expected = run_layout(args, world_size)
        different = {key: (saved[key], value) for key, value in expected.items() if saved[key] != value}
        if different:
            raise usage_error(f"--resume {args.resume}: {directory} was saved with " + ", ".join(
                f"{key} {was!r}" for key, (was, _) in different.items()) + "; this run has " + ", ".join(
                f"{key} {now!r}" for key, (_, now) in different.items()) + " (resume with the same layout, or "
                "pass --resume never and another --out)")
        return directory
    if args.resume != "auto":
        raise usage_error(f"--resume {args.resume!r}: no complete checkpoint there; expected a checkpoint dir "
                          f"(OUT/checkpoints/step_N) or a run's OUT/checkpoints")
    return None


def resume_problems(args, world_size):
    if args.resume == "never" and checkpoint_dirs(os.path.join(args.out, CHECKPOINTS_DIR)):
        return [f"--resume never: {os.path.join(args.out, CHECKPOINTS_DIR)} holds checkpoints of an earlier run; "
                "expected a fresh --out (or --resume auto to continue it)"]
    if args.resume not in ("auto", "never") and not os.path.isdir(args.resume):
        return [f"--resume {args.resume!r}: no such directory; expected auto, never or a checkpoint dir"]
    return []


def load_checkpoint(directory, policy, engines, rank):
    """Restore this rank's model and optimizer state (and auto's draft tuner, when both
    this run and the checkpoint have one); returns the step it was saved at. The engines
    receive the weights when they are next used."""
    path = os.path.join(directory, f"rank{rank}.pt")
    state = torch.load(path, weights_only=True)
    policy.model.load_state_dict(state["model"])
    with cuda_on_cpu():
        policy.optimizer.load_state_dict(state["optimizer"])
    if engines.tuner is not None and "draft_tuner" in state:
        engines.tuner.load_state_dict(state["draft_tuner"])
    return state["step"]


# ---------------------------------------------------------------------------------------
# The phases of one step, in the order main's loop calls them
# ---------------------------------------------------------------------------------------

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


def split_examples(examples, eval_examples, seed, task, count_step=1):
    """(training pool, held-out set). A built-in task (examples None) trains on its "train"
    symbols and holds out its "held_out" ones (TASKS); --data without --eval-data holds
    out a fixed, seeded EVAL_HOLDOUT_FRACTION of its examples (at most EVAL_HOLDOUT_MAX),
    which training never samples."""
    if examples is None:
        return (task_examples(task, TASKS[task]["train"], count_step),
                task_examples(task, TASKS[task]["held_out"], count_step))
    if eval_examples is not None:
        return examples, eval_examples
    if len(examples) < 2:
        raise usage_error(f"--data has {len(examples)} example; expected at least 2 to hold some out for "
                          "evaluation, or pass --eval-data")
    order = list(range(len(examples)))
    random.Random(seed).shuffle(order)
    held_out = max(1, min(EVAL_HOLDOUT_MAX, round(EVAL_HOLDOUT_FRACTION * len(examples))))
    return [examples[i] for i in sorted(order[held_out:])], [examples[i] for i in sorted(order[:held_out])]


def sample_prompts(examples, step, args, dp_size):
    """The step's examples (`--prompts-per-step` per data-parallel rank), the same on every
    rank: drawn from the training pool by a generator seeded by (seed, step) alone."""
    step_rng = random.Random(args.seed * SEED_STRIDE + step)
    return [step_rng.choice(examples) for _ in range(args.prompts_per_step * dp_size)]


def rollout(llm, tokenizer, examples, params, args, rank):
    """All of the step's examples -> (samples, outputs): `params.n` completions per
    example, in example order, on every rank; `outputs` are this engine's RequestOutputs.

    Each vLLM engine (a rollout tensor-parallel group) samples a slice of the step's
    examples; the slices are gathered so every trainer rank can take its own. A sample is
    {example, prompt_ids, response_ids, text, rollout_logprobs}. Prompts go to vLLM as
    token ids (`prompt_token_ids`), and `prompt_ids` are the ids vLLM reports it sampled
    from: Megatron trains on exactly those.
    """
    num_engines = dist.get_world_size() // args.rollout_tp
    engine, engine_rank = rank // args.rollout_tp, rank % args.rollout_tp
    share = examples[engine::num_engines]
    prompts = [{"prompt_token_ids": prompt_token_ids(tokenizer, e["prompt"])} for e in share]
    outputs = llm.generate(prompts, params, use_tqdm=False) if share else []
    mine = []
    for example, output in zip(share, outputs):
        for completion in output.outputs:
            mine.append({"example": example, "prompt_ids": list(output.prompt_token_ids),
                         "response_ids": list(completion.token_ids), "text": completion.text,
                         "rollout_logprobs": [step[token].logprob for step, token in
                                              zip(completion.logprobs, completion.token_ids)]})
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine if engine_rank == 0 else [])
    # Back in example order: engine g sampled examples g, g + num_engines, ...
    by_engine = [gathered[g * args.rollout_tp] for g in range(num_engines)]
    ordered = []
    for index in range(len(examples)):
        engine, position = index % num_engines, index // num_engines
        ordered.extend(by_engine[engine][position * params.n:(position + 1) * params.n])
    return ordered, outputs


def sampling_params(args, n, temperature, max_tokens=None):
    from vllm import SamplingParams
    # The built-in task's answers have a fixed length: no end-of-sequence to learn first.
    # Special tokens stay in the text, so the reward sees (and penalises) them.
    return SamplingParams(n=n, temperature=temperature, max_tokens=max_tokens or args.max_new_tokens, logprobs=0,
                          ignore_eos=args.data is None or max_tokens is not None, skip_special_tokens=False)


def seed_engine(args, rank, step):
    """Seed the engine's sampling (torch's generator in this process) from (seed, step,
    engine): step s's rollout depends on those and the weights alone, so a run resumed
    from a checkpoint samples what the uninterrupted run sampled."""
    torch.manual_seed((args.seed * SEED_STRIDE + step) * SEED_STRIDE + rank // args.rollout_tp)


def all_engines_statistics(statistics, args, rank):
    """One engine's acceptance statistics (SpecDecodeMeter.read) -> those of every engine's
    rollout, summed (each engine counted once, by its rollout-TP rank 0), the same on
    every rank; None without verify steps."""
    depth = deepest_draft(args)
    counts = torch.zeros(3 + depth, dtype=torch.float64)
    if statistics and rank % args.rollout_tp == 0:
        per_position = statistics["accepted_per_position"][:depth]
        counts[:3 + len(per_position)] = torch.tensor(
            [statistics["num_drafts"], statistics["num_draft_tokens"], statistics["num_accepted_tokens"]]
            + per_position, dtype=torch.float64)
    dist.all_reduce(counts)
    drafts, draft_tokens, accepted, *per_position = [int(count) for count in counts.tolist()]
    if not drafts:
        return None
    return spec_config.acceptance_statistics("all_engines", drafts, draft_tokens, accepted, per_position)


def ensure_current(engines, engine, policy, version, args):
    """Push the policy (the weights after step `version`) into `engine` unless it holds them
    already: an engine that sat idle while the other rolled out catches up here. Every
    --check-draft-every steps a drafting engine's draft is checked against Megatron's."""
    engines.wake(engine)
    if engines.versions[id(engine)] == version:
        return
    # The fault-tolerance tests' hook for the stale-draft check: one push without the draft.
    stale = os.environ.get(STALE_DRAFT_AT_ENV) == str(version)
    weight_sync.push_to_vllm(policy.model, engine, weight_version=str(version), draft=not stale)
    engines.versions[id(engine)] = version
    if engine is engines.drafting and args.check_draft_every and version % args.check_draft_every == 0:
        weight_sync.check_draft(policy.model, engine)


def tune(engines, policy, tokenizer, examples, args, rank, step):
    """The tune phase (--num-speculative-tokens auto only): set the k this step's rollout
    drafts. While no rollout drafts, the draft's acceptance is checked at the deepest k on a
    few prompts, at a process's first step and every --acceptance-check-every steps; at the
    first step, every --tune-every steps and once the acceptance moved far, the next
    rollouts try each k that could pay in turn (DraftTuner.try_each). Returns (the
    acceptance statistics of the check, every engine's, or None; whether this rollout is
    a try). A no-op for a fixed k or without drafting."""
    tuner = engines.tuner
    if tuner is None:
        return None, False
    checked = None
    first = tuner.tried_tokens_per_step is None
    if not tuner.exploring():
        if not engines.draft_tokens and (first or (step - 1) % args.acceptance_check_every == 0):
            ensure_current(engines, engines.drafting, policy, step - 1, args)
            spec_config.set_draft_tokens(engines.drafting, args.max_speculative_tokens)
            num_engines = dist.get_world_size() // args.rollout_tp
            _, outputs = rollout(engines.drafting, tokenizer, examples[:ACCEPTANCE_CHECK_PROMPTS * num_engines],
                                 sampling_params(args, args.group_size, args.temperature,
                                                 max_tokens=ACCEPTANCE_CHECK_TOKENS), args, rank)
            checked = all_engines_statistics(engines.meter.read(outputs), args, rank)
            tuner.observe(checked)
        if first or (step - 1) % args.tune_every == 0 or tuner.is_stale():
            tuner.try_each()
    engines.draft_tokens = tuner.choose()
    if engines.draft_tokens:
        spec_config.set_draft_tokens(engines.drafting, engines.draft_tokens)
    return checked, tuner.exploring()


def generate(engines, policy, tokenizer, examples, args, rank, step):
    """The rollout phase: completions from the active engine (brought up to date), the draft
    acceptance of every engine's rollout (None without drafting), and vLLM put to sleep on
    a GPU so Megatron gets its memory. While auto tries each k in turn, the rollout's
    tokens/s (without the push) goes to its tuner."""
    engine = engines.active()
    ensure_current(engines, engine, policy, step - 1, args)
    seed_engine(args, rank, step)
    start = time.perf_counter()
    samples, outputs = rollout(engine, tokenizer, examples, sampling_params(args, args.group_size, args.temperature),
                               args, rank)
    if engines.tuner is not None and engines.tuner.exploring():
        # The slowest rank's seconds, so every rank records the same speed and chooses alike.
        seconds = torch.tensor(time.perf_counter() - start, dtype=torch.float64)
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
        engines.tuner.record(engines.draft_tokens, sum(len(s["response_ids"]) for s in samples) / seconds.item())
    acceptance = None
    if engines.draft_tokens:
        acceptance = all_engines_statistics(engines.meter.read(outputs), args, rank)
        if engines.tuner is not None:
            engines.tuner.observe(acceptance)
    if torch.cuda.is_available():
        # Level 2 drops vLLM's weights (every push sends them all again); level 1 keeps a
        # host copy, needed when the draft drafts but does not train (nothing refills it).
        engines.sleep(level=1 if args.mtp_rollout and not args.mtp_train else 2)
    return samples, acceptance


def score(samples, tokenizer, reward_function, args):
    """Rewards [N] fp32 (each completion's mean credit) and each sample's per-token
    advantages (set on the sample).

    Built-in task: per-character credit baselined per answer position; --data: one
    exact-match reward per completion, spread over its tokens; --reward: the user's, per
    completion or per token. Per-token credits of unequal lengths are zero-padded for the
    per-position group baseline.
    """
    rows = [credits_of(sample, tokenizer, reward_function, args) for sample in samples]
    lengths = [len(row) for row in rows]
    credits = torch.tensor([row + [0.0] * (max(lengths) - len(row)) for row in rows])          # [N, L]
    advantages = group_advantages(credits, args.group_size, args.advantage)
    for sample, advantage, length in zip(samples, advantages, lengths):
        sample["advantages"] = advantage[:length].expand(len(sample["response_ids"]))
    return torch.stack([row[:length].mean() for row, length in zip(credits, lengths)])


def evaluate(llm, held_out, tokenizer, reward_function, args, rank):
    """Greedy completions of the held-out examples, scored like training's:
    {eval_accuracy (reward 1), eval_reward_mean, eval_response_length}, on every rank."""
    samples, _ = rollout(llm, tokenizer, held_out, sampling_params(args, 1, 0.0), args, rank)
    rewards = torch.tensor([sum(row) / len(row) for row in
                            (credits_of(sample, tokenizer, reward_function, args) for sample in samples)])
    return {"eval_accuracy": (rewards == 1).float().mean().item(), "eval_reward_mean": rewards.mean().item(),
            "eval_response_length": sum(len(s["response_ids"]) for s in samples) / len(samples)}


def pack_micro_batch(samples, device):
    """Samples -> packed tensors on `device`: input_ids [T] int64, seqlens [B] int64, and
    loss_mask, advantages, rollout_logprobs, old_logprobs [T] fp32, each at the position
    that predicts its response token (position i predicts token i + 1); old_logprobs is
    None until `record_old_logprobs` has run."""
    sequences = [s["prompt_ids"] + s["response_ids"] for s in samples]
    seqlens = torch.tensor([len(ids) for ids in sequences])
    input_ids = torch.tensor([token for ids in sequences for token in ids])
    with_old = "old_logprobs" in samples[0]
    loss_mask, advantages, rollout_logprobs, old_logprobs = (torch.zeros(len(input_ids)) for _ in range(4))
    offset = 0
    for sample, length in zip(samples, seqlens.tolist()):
        first, last = offset + len(sample["prompt_ids"]) - 1, offset + length - 1
        loss_mask[first:last] = 1.0
        advantages[first:last] = sample["advantages"]
        rollout_logprobs[first:last] = torch.tensor(sample["rollout_logprobs"])
        if with_old:
            old_logprobs[first:last] = sample["old_logprobs"]
        offset += length
    # Built on the host, moved once.
    packed = [tensor.to(device) for tensor in (input_ids, seqlens, loss_mask, advantages, rollout_logprobs)]
    return packed + [old_logprobs.to(device) if with_old else None]


@torch.no_grad()
def record_old_logprobs(policy, samples, args):
    """Set each sample's "old_logprobs" ([response length] fp32, on the host): its response
    log-probs under the current weights, the policy that sampled it, at Megatron's numerics.
    One no-grad forward per micro-batch, before the first update."""
    per_micro = len(samples) // (args.mini_batches * args.micro_batches)
    device = next(policy.model.parameters()).device
    for start in range(0, len(samples), per_micro):
        micro = samples[start:start + per_micro]
        input_ids, seqlens, loss_mask, *_ = pack_micro_batch(micro, device)
        logprobs = forward_logprobs(policy.model, input_ids, seqlens, loss_mask=loss_mask,
                                    temperature=args.temperature, gather=True).logprobs.float().cpu()
        for sample, row in zip(micro, torch.split(logprobs, seqlens.tolist())):
            sample["old_logprobs"] = row[len(sample["prompt_ids"]) - 1:-1]


def micro_batch_loss(policy, samples, num_sequences, num_tokens, args, sums):
    """Forward one micro-batch; returns its loss (a scalar: its share of the global mean)
    and adds its metric sums (over this rank's tokens) into `sums` by name."""
    device = next(policy.model.parameters()).device
    input_ids, seqlens, loss_mask, advantages, rollout_logprobs, old_logprobs = pack_micro_batch(samples, device)
    weights = token_weights(loss_mask, seqlens, args.loss_agg, num_sequences, num_tokens)
    out = forward_logprobs(policy.model, input_ids, seqlens, loss_mask=loss_mask, temperature=args.temperature,
                           with_entropy=True, mtp_train=args.mtp_train)
    batch, local_mask = out.batch, out.loss_mask
    # One optimizer step per rollout batch: this forward is the policy that sampled it.
    old_logprobs = out.logprobs.detach() if old_logprobs is None else batch.pack(old_logprobs)
    local_rollout, local_weights = batch.pack(rollout_logprobs), batch.pack(weights)
    per_token, acted = policy_loss(out.logprobs, old_logprobs, local_rollout, batch.pack(advantages), args)
    loss = (per_token * local_weights).sum()
    if args.entropy_coef > 0:
        loss = loss - args.entropy_coef * (out.entropy * local_weights).sum()
    if policy.reference is not None:
        with torch.no_grad():
            reference_logprobs = forward_logprobs(policy.reference, input_ids, seqlens, loss_mask=loss_mask,
                                                  temperature=args.temperature).logprobs
        log_ratio = (reference_logprobs - out.logprobs).clamp(-KL_LOG_RATIO_BOUND, KL_LOG_RATIO_BOUND)
        k3 = (torch.exp(log_ratio) - log_ratio - 1) * local_mask
        loss = loss + args.kl_coef * (k3 * local_weights).sum()
        sums["kl_to_reference"] += float((k3 * local_mask).sum())
    mismatch = (old_logprobs - local_rollout).abs() * local_mask
    log_ratio = out.logprobs.detach() - old_logprobs
    ratio = torch.exp(log_ratio)
    sums["total_loss"] += float(loss.detach())
    sums["clip_fraction"] += float(((acted["clip_low"] + acted["clip_high"]) * local_mask).sum())
    for name in acted:
        sums[f"{name}_fraction"] += float((acted[name] * local_mask).sum())
    sums["ratio_mean"] += float((ratio * local_mask).sum())
    # k3 estimate of KL(old || current): CleanRL's approx_kl.
    sums["approx_kl"] += float(((ratio - 1 - log_ratio) * local_mask).sum())
    if local_mask.any():
        sums["ratio_min"] = min(sums["ratio_min"], float(ratio[local_mask > 0].min()))
        sums["ratio_max"] = max(sums["ratio_max"], float(ratio[local_mask > 0].max()))
    sums["entropy"] += float((out.entropy.detach() * local_mask).sum())
    sums["logprob_mismatch_mean"] += float(mismatch.sum())
    sums["logprob_mismatch_max"] = max(sums["logprob_mismatch_max"], float(mismatch.max()))
    sums["mtp_loss"] += float(out.mtp_loss) / args.micro_batches if out.mtp_loss is not None else 0.0
    sums["tokens"] += float(local_mask.sum())
    return loss


def train_step(policy, samples, args):
    """One optimizer step on this data-parallel rank's share of a mini-batch; returns the
    metric sums of this rank by name (see `combine_steps`, `reduce_metrics`) and the
    global grad_norm."""
    dp_size = parallel_state.get_data_parallel_world_size()
    per_micro = len(samples) // args.micro_batches
    device = next(policy.model.parameters()).device
    num_tokens = torch.tensor([float(sum(len(s["response_ids"]) for s in samples))], device=device)
    dist.all_reduce(num_tokens, group=parallel_state.get_data_parallel_group())
    # The MTP loss is a mean per micro-batch and rank; gradients are summed over both.
    MTPLossAutoScaler.set_loss_scale(torch.tensor(args.mtp_loss_scale / (args.micro_batches * dp_size),
                                                  device=device))
    policy.ddp_model.zero_grad_buffer()
    policy.optimizer.zero_grad()
    sums = dict(dict.fromkeys(SUMMED_METRICS, 0.0), **METRIC_START)
    for start in range(0, len(samples), per_micro):
        loss = micro_batch_loss(policy, samples[start:start + per_micro], len(samples) * dp_size, num_tokens,
                                args, sums)
        # Every rank stops together, before the optimizer touches the weights: the last
        # checkpoint on disk stays the last good one.
        finite = torch.isfinite(loss.detach()).float().view(1)
        dist.all_reduce(finite, op=dist.ReduceOp.MIN)
        if not finite.item():
            raise FloatingPointError(f"non-finite loss at micro-batch {start // per_micro} (this rank: "
                                     f"{loss.item()}); stopping with the last checkpoint in --out intact")
        loss.backward()
    policy.ddp_model.finish_grad_sync()
    # DDP averages over data x context parallel ranks; the loss is normalised globally
    # (token_weights), so the gradient wanted is the sum.
    policy.ddp_model.scale_gradients(parallel_state.get_data_parallel_world_size(with_context_parallel=True))
    with cuda_on_cpu():
        _, grad_norm, _ = policy.optimizer.step()
    if not math.isfinite(grad_norm):
        # megatron's fp32 / bf16 step does not skip non-finite gradients: stop before
        # anything is saved, so the last checkpoint on disk stays the last good one.
        raise FloatingPointError(f"non-finite gradient norm {grad_norm}; stopping with the last checkpoint in "
                                 "--out intact")
    return dict(sums, grad_norm=grad_norm)


def train(policy, samples, args):
    """The train phase: --ppo-epochs passes over this rank's samples, each in --mini-batches
    optimizer steps; returns the metric sums of all of them (see `combine_steps`)."""
    if args.ppo_epochs * args.mini_batches > 1:
        # Every step after the first sees moved weights: its ratio must be against the
        # policy that sampled the batch.
        record_old_logprobs(policy, samples, args)
    per_mini = len(samples) // args.mini_batches
    return combine_steps([train_step(policy, samples[start:start + per_mini], args)
                          for _ in range(args.ppo_epochs) for start in range(0, len(samples), per_mini)])


# How each train metric is combined over optimizer steps (`combine_steps`) and over data x
# context parallel ranks (`reduce_metrics`, each rank holds a share of the tokens).
TOKEN_MEAN_METRICS = ("clip_fraction", "entropy", "logprob_mismatch_mean", "kl_to_reference", "clip_low_fraction",
                      "clip_high_fraction", "dual_clip_fraction", "ratio_mean", "approx_kl")
STEP_MEAN_METRICS = ("mtp_loss", "total_loss")
SUMMED_METRICS = TOKEN_MEAN_METRICS + ("tokens",) + STEP_MEAN_METRICS
MAXED_METRICS = ("logprob_mismatch_max", "ratio_max")
MINNED_METRICS = ("ratio_min",)
# Where a max or min starts before the first token.
METRIC_START = {"logprob_mismatch_max": 0.0, "ratio_max": -math.inf, "ratio_min": math.inf}


def combine_steps(steps):
    """Metric sums of several optimizer steps -> one set: token sums add up, the MTP and
    total losses and grad_norm average over steps, maxima and minima stay extremes."""
    combined = {name: sum(step[name] for step in steps) for name in TOKEN_MEAN_METRICS + ("tokens",)}
    combined.update({name: sum(step[name] for step in steps) / len(steps)
                     for name in STEP_MEAN_METRICS + ("grad_norm",)})
    combined.update({name: max(step[name] for step in steps) for name in MAXED_METRICS})
    combined.update({name: min(step[name] for step in steps) for name in MINNED_METRICS})
    return combined


def reduce_metrics(sums, device):
    """Per-rank sums by name -> the step's values: token means, the MTP loss averaged over
    data-parallel ranks (each rank's is its share of its data-parallel rank's mean), the
    total loss summed (it is normalised globally), extremes; grad_norm is already global."""
    group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    summed = torch.tensor([sums[name] for name in SUMMED_METRICS], device=device)
    dist.all_reduce(summed, group=group)
    totals = dict(zip(SUMMED_METRICS, summed))
    metrics = {name: (totals[name] / totals["tokens"].clamp(min=1)).item() for name in TOKEN_MEAN_METRICS}
    metrics["mtp_loss"] = totals["mtp_loss"].item() / parallel_state.get_data_parallel_world_size()
    metrics["total_loss"] = totals["total_loss"].item()
    for names, op in ((MAXED_METRICS, dist.ReduceOp.MAX), (MINNED_METRICS, dist.ReduceOp.MIN)):
        extremes = torch.tensor([sums[name] for name in names], device=device, dtype=torch.float64)
        dist.all_reduce(extremes, op=op, group=group)
        metrics.update(zip(names, extremes.tolist()))
    metrics["grad_norm"] = sums["grad_norm"]
    return metrics


def probe(llm):
    """Greedy continuation of a fixed prompt and its summed log-prob: changes when the weights do."""
    from vllm import SamplingParams
    completion = llm.generate([PROBE_PROMPT], SamplingParams(temperature=0.0, max_tokens=PROBE_TOKENS, logprobs=0),
                              use_tqdm=False)[0].outputs[0]
    return completion.text, sum(step[token].logprob for step, token in zip(completion.logprobs, completion.token_ids))


def sync_weights(engines, policy, step, args):
    """The sync phase: push every weight, MTP draft included, into the engine that rolled
    out (woken on a GPU; the other catches up when it is next used), check its draft every
    --check-draft-every steps, and probe it; returns {probe_text, probe_logprob,
    weight_version}."""
    fault_point("sync", step)
    engine = engines.active()
    ensure_current(engines, engine, policy, step, args)
    text, logprob = probe(engine)
    return {"probe_text": text, "probe_logprob": logprob, "weight_version": engine.get_weight_version()}


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
              "acceptance_by_depth": spec_config.acceptance_by_depth(acceptance) or None}
    if checked is not None:
        record["check_acceptance_by_depth"] = spec_config.acceptance_by_depth(checked)
    if tried:
        record["realized_speedups"] = engines.tuner.realized_speeds()
    return record


# The phases a step's tokens/s counts (evaluation is not part of producing the update).
STEP_PHASES = ("tune", "rollout", "train", "sync")


def step_record(step, samples, rewards, train_metrics, draft_metrics, sync_result, eval_metrics, seconds):
    """One line of metrics.jsonl: every value of the step by name (eval_* on eval steps only)."""
    response_tokens = sum(len(s["response_ids"]) for s in samples)
    return {
        "step": step,
        "reward_mean": rewards.mean().item(), "reward_std": rewards.std().item(),
        "accuracy": (rewards == 1).float().mean().item(),
        "response_length": response_tokens / len(samples),
        **train_metrics,
        **draft_metrics,
        **sync_result,
        **eval_metrics,
        **{f"{phase}_s": value for phase, value in seconds.items()},
        "rollout_tokens_per_s": response_tokens / seconds["rollout"],
        "tokens_per_s": response_tokens / sum(seconds[phase] for phase in STEP_PHASES),
    }


def open_tensorboard(args, start_step):
    """Rank 0's TensorBoard writer on OUT/tensorboard (None with --no-tensorboard). A resumed
    run hides what an earlier run logged past `start_step`, as metrics.jsonl drops it."""
    if not args.tensorboard:
        return None
    from torch.utils.tensorboard import SummaryWriter
    return SummaryWriter(os.path.join(args.out, "tensorboard"), purge_step=start_step + 1 if start_step else None)


def write_tensorboard(writer, record):
    """Every number of the record as a scalar at its step, under its metrics.jsonl name
    (strings and None have no curve); flushed, so a crash loses no finished step."""
    for name, value in record.items():
        if name != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
            writer.add_scalar(name, value, record["step"])
    writer.flush()


def log_step(record, metrics_path, writer, args, seconds_so_far, steps_done):
    """Rank 0: append the record to metrics.jsonl (and TensorBoard, `writer` not None) and
    print the step line with its ETA."""
    with open(metrics_path, "a") as f:
        f.write(json.dumps(record) + "\n")
    if writer is not None:
        write_tensorboard(writer, record)
    eta = seconds_so_far / steps_done * (args.steps - record["step"])
    accept = f"{record['acceptance_rate']:.2f}" if record["acceptance_rate"] is not None else "-"
    print(f"step {record['step']}/{args.steps} reward {record['reward_mean']:.3f} acc {record['accuracy']:.2f} "
          f"k {record['draft_tokens']} accept {accept} mtp {record['mtp_loss']:.3f} ent {record['entropy']:.2f} "
          f"mismatch {record['logprob_mismatch_mean']:.1e} gnorm {record['grad_norm']:.2f} "
          f"clip {record['clip_fraction']:.3f} "
          + (f"eval acc {record['eval_accuracy']:.2f} reward {record['eval_reward_mean']:.3f} "
             if "eval_accuracy" in record else "")
          + f"| {sum(record[f'{p}_s'] for p in STEP_PHASES):.1f}s/step ({record['tune_s']:.1f} tune, "
          f"{record['rollout_s']:.1f} roll {record['rollout_tokens_per_s']:.0f} tok/s, {record['train_s']:.1f} train, "
          f"{record['sync_s']:.1f} sync) "
          f"eta {eta / 60:.1f} min", flush=True)


def plot_curves(records, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
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
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
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


def keep_records(metrics_path, last_step):
    """Rank 0: metrics.jsonl cut back to the steps up to `last_step` (a resumed run logs
    the later ones again; a fresh one starts empty); returns the records kept."""
    records = []
    if os.path.exists(metrics_path):
        with open(metrics_path) as f:
            records = [record for record in map(json.loads, f) if record["step"] <= last_step]
    _write_synced(metrics_path, lambda f: f.write("".join(json.dumps(r) + "\n" for r in records).encode()))
    return records


def _broadcast(value):
    holder = [value]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


# ---------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------

def load_inputs(args, hf_config):
    """Before any process group: (training pool, held-out set, the user's reward or None),
    each checked; --mtp-rollout and --mtp-train resolved against the model's MTP layers."""
    examples, held_out = split_examples(
        load_examples(args.data, args.prompt_key, args.answer_key) if args.data else None,
        load_examples(args.eval_data, args.prompt_key, args.answer_key) if args.eval_data else None, args.seed,
        args.task, args.count_step)
    reward_function = load_reward_function(args.reward) if args.reward else None
    has_mtp = hf_config.get("num_nextn_predict_layers", 0) > 0
    args.mtp_rollout = has_mtp if args.mtp_rollout is None else args.mtp_rollout
    args.mtp_train = args.mtp_train and has_mtp
    return examples, held_out, reward_function


def open_outputs(args, rank, start_step, resume_dir):
    """(metrics.jsonl's path, the records kept from before start_step, a TensorBoard writer);
    records and writer on rank 0 only."""
    os.makedirs(args.out, exist_ok=True)
    metrics_path = os.path.join(args.out, "metrics.jsonl")
    if rank != 0:
        return metrics_path, [], None
    if start_step:
        print(f"resumed from {resume_dir} (step {start_step})", flush=True)
    return metrics_path, keep_records(metrics_path, start_step), open_tensorboard(args, start_step)


def main(args):
    hf_config = check_args(args, int(os.environ.get("WORLD_SIZE", "1")))
    resume_dir = choose_checkpoint(args, int(os.environ.get("WORLD_SIZE", "1")))
    examples, held_out, reward_function = load_inputs(args, hf_config)
    use_bf16 = torch.cuda.is_available() if args.bf16 is None else args.bf16
    dtype = torch.bfloat16 if use_bf16 else torch.float32

    rank, world_size, device = init_distributed()
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    # The built-in model is written once and cached; only rank 0 writes it.
    name = builtin_model(args)[0]
    model_dir = args.model or _broadcast(tiny_model.build_tiny_mimo(
        os.path.join("runs", f"{name}-mimo"), **tiny_model.BUILTIN_SIZES[name]) if rank == 0 else None)
    # The one tokenizer of prompts and answers (vLLM loads the same, through transformers):
    # prompts reach vLLM as token ids, so vLLM samples from the tokens Megatron trains on.
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if examples is not None:
        check_prompts(examples + held_out, tokenizer, hf_config.get("max_position_embeddings", 4096),
                      args.max_new_tokens)
    init_model_parallel(tensor_parallel=args.tp, context_parallel=args.cp, seed=args.seed)
    mtp_patch.patch_megatron_mtp()
    policy = build_policy(model_dir, args, device, dtype)
    engines = build_engines(model_dir, args, rank, "bfloat16" if use_bf16 else "float32")
    start_step = load_checkpoint(resume_dir, policy, engines, rank) if resume_dir else 0
    dp_rank, dp_size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    metrics_path, records, writer = open_outputs(args, rank, start_step, resume_dir)
    started = time.time()

    for step in range(start_step + 1, args.steps + 1):
        timer = PhaseTimer()
        # Prompts: the same examples on every rank, from (seed, step) alone
        examples_now = sample_prompts(examples, step, args, dp_size)
        # Tune: how many tokens the MTP head drafts in this rollout (auto)
        with timer("tune"):
            checked, tried = tune(engines, policy, tokenizer, examples_now, args, rank, step)
        # Rollout: vLLM samples --group-size completions per prompt, the MTP head drafting
        with timer("rollout"):
            samples, acceptance = generate(engines, policy, tokenizer, examples_now, args, rank, step)
        # Rewards and GRPO advantages, then PPO on this data-parallel rank's share
        with timer("train"):
            rewards = score(samples, tokenizer, reward_function, args)
            per_rank = args.prompts_per_step * args.group_size
            train_sums = train(policy, samples[dp_rank * per_rank:(dp_rank + 1) * per_rank], args)
        # Sync: the new weights, MTP draft included, into vLLM
        with timer("sync"):
            sync_result = sync_weights(engines, policy, step, args)
        # Evaluate: greedy on the held-out set, every --eval-every steps and after the last
        eval_metrics = {}
        if step % args.eval_every == 0 or step == args.steps:
            with timer("eval"):
                eval_metrics = evaluate(engines.active(), held_out, tokenizer, reward_function, args, rank)
        # Log and checkpoint
        record = step_record(step, samples, rewards, reduce_metrics(train_sums, device),
                             draft_record(engines, acceptance, checked, tried), sync_result, eval_metrics, timer.seconds)
        if rank == 0:
            records.append(record)
            log_step(record, metrics_path, writer, args, time.time() - started, step - start_step)
        if step % args.save_every == 0 or step == args.steps:
            save_checkpoint(args, policy, engines, step, rank, world_size)

    weight_sync.save_hf_checkpoint(policy.model, model_dir, os.path.join(args.out, "final"))
    if writer is not None:
        writer.close()
    if rank == 0 and records:
        plot_curves(records, os.path.join(args.out, "curves.png"))
        written = [metrics_path, os.path.join(args.out, "curves.png")]
        if plot_acceptance_against_entropy(records, os.path.join(args.out, "acceptance_vs_entropy.png")):
            written.append(os.path.join(args.out, "acceptance_vs_entropy.png"))
        print(f"wrote {', '.join(written)}, {os.path.join(args.out, 'final')}")
    return records


if __name__ == "__main__":
    main(parse_args())
