"""GRPO on Megatron-Core with colocated vLLM rollouts drafted by the model's own MTP head.

One process per device under torchrun. Each process holds a Megatron-Core policy shard
(tensor parallel --tp, context parallel --cp, data parallel = the rest) and a vLLM engine
on the same device (distributed_executor_backend="external_launcher", rollout tensor
parallel --rollout-tp). Each step, one call per phase in `main`'s loop:

    prompts -> vLLM (rollout, MTP drafts) -> rewards -> GRPO advantages
            -> cp_thd packs -> forward (Megatron) -> PPO loss (+ MTP loss) -> megatron-core Adam
            -> weight_sync -> vLLM

    torchrun --nproc_per_node 2 train_grpo.py                       # CPU: tiny model, built-in task
    torchrun --nproc_per_node 8 train_grpo.py --model DIR --tp 2 --cp 2 --rollout-tp 2

Built-in task (no --data): repeat a letter. The prompt is "repeat:c", a random letter
from a small alphabet last; the answer is the letter three times ("ccc"); the reward is
the fraction of answer characters right, in place (per-character credit: a random policy
over the 128-token vocabulary earns a little, about 1%). The credit is per token: each
answer position gets its own group-baselined advantage. The letter sits at the end of
the prompt, so each answer token only has to repeat the token before it: a mapping the
tiny random-init model can find by RL alone in a few minutes on 2 CPU cores, and one its
MTP head can draft once the policy is sure of it. With --data, examples come from a
.jsonl or .parquet file, in our layout ({"prompt", "answer"}) or verl's (prompt as chat
messages, answer under reward_model.ground_truth), with an exact-match reward (numeric
when the answer is a number). Chat-message prompts go through the tokenizer's chat
template; every prompt reaches vLLM as token ids, so vLLM samples from exactly the
tokens Megatron trains on. Metrics: OUT/metrics.jsonl, TensorBoard under
OUT/tensorboard, and curves.png at the end.
"""

import argparse
import contextlib
import dataclasses
import importlib.util
import json
import math
import os
import random
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

DEFAULT_MODEL_DIR = os.path.join("runs", "tiny-mimo")
TASK_ALPHABET = "abcde"
TASK_LENGTH = 3
PROBE_PROMPT = "repeat:a"
PROBE_TOKENS = 4
NUMERIC_TOLERANCE = 1e-6
ADVANTAGE_EPS = 1e-6
ADAM_EPS = 1e-8
KL_LOG_RATIO_BOUND = 20.0  # k3 = exp(x) - x - 1 overflows fp32 past ~88; the bound keeps it finite
DATA_FORMATS = (".jsonl", ".parquet")
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


def parse_args(argv=None):
    p = _ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default=None, help="MiMo-style HF checkpoint dir; default: the built-in tiny model")
    p.add_argument("--data", default=None,
                   help="examples, .jsonl or .parquet: {prompt, answer} rows, or verl's layout (prompt as chat "
                        "messages, answer under reward_model.ground_truth); default: the built-in repeat task")
    p.add_argument("--prompt-key", default=DEFAULT_PROMPT_KEY,
                   help="--data field holding the prompt (a string or a list of {role, content} chat messages); "
                        "a dotted path reaches into nested fields")
    p.add_argument("--answer-key", default=None,
                   help="--data field holding the answer, a dotted path reaches into nested fields; default: "
                        + " or ".join(DEFAULT_ANSWER_KEYS))
    p.add_argument("--out", default="runs/grpo",
                   help="metrics.jsonl, curves.png, tensorboard/ event files, checkpoints, final HF dir")
    p.add_argument("--tensorboard", action=argparse.BooleanOptionalAction, default=True,
                   help="also write every metric to TensorBoard event files under OUT/tensorboard")
    p.add_argument("--resume", default=None, help="a checkpoint dir written by an earlier run (OUT/checkpoint)")
    p.add_argument("--steps", type=int, default=150, help="training steps (one rollout batch each)")
    p.add_argument("--seed", type=int, default=0, help="seed of data, init and sampling")
    p.add_argument("--tp", type=int, default=1, help="Megatron tensor parallel size")
    p.add_argument("--cp", type=int, default=1, help="Megatron context parallel size")
    p.add_argument("--rollout-tp", type=int, default=1, help="vLLM tensor parallel size")
    p.add_argument("--prompts-per-step", type=int, default=16, help="prompts per data-parallel rank per step")
    p.add_argument("--group-size", type=int, default=8, help="completions per prompt (the GRPO group)")
    p.add_argument("--max-new-tokens", type=int, default=TASK_LENGTH,
                   help="response length limit (the built-in task always samples exactly this many)")
    p.add_argument("--temperature", type=float, default=1.0, help="rollout sampling temperature (> 0)")
    p.add_argument("--lr", type=float, default=3e-4, help="Adam learning rate")
    p.add_argument("--micro-batches", type=int, default=2, help="gradient accumulation micro-batches per step")
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
    p.add_argument("--num-speculative-tokens", type=int, default=1, help="MTP draft tokens per step")
    p.add_argument("--spec-config", default=None, help="JSON object merged into vLLM's speculative_config")
    p.add_argument("--save-every", type=int, default=50, help="checkpoint every N steps (and at the end)")
    p.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=None,
                   help="bf16 weights and rollout (default: on with CUDA, off on CPU)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.3, help="vLLM's share of GPU memory")
    p.add_argument("--kv-cache-bytes", type=int, default=2**28, help="vLLM KV cache size on CPU")
    return p.parse_args(argv)


# ---------------------------------------------------------------------------------------
# Flags: every one checked before any process group, model or engine exists
# ---------------------------------------------------------------------------------------

# flag -> (bound, whether the bound itself is allowed)
AT_LEAST = {"steps": (1, True), "tp": (1, True), "cp": (1, True), "rollout_tp": (1, True),
            "prompts_per_step": (1, True), "group_size": (2, True), "max_new_tokens": (1, True),
            "micro_batches": (1, True), "num_speculative_tokens": (1, True), "save_every": (1, True),
            "kv_cache_bytes": (1, True), "temperature": (0, False), "lr": (0, False), "grad_clip": (0, False),
            "gpu_memory_utilization": (0, False), "clip_low": (0, True), "clip_high": (0, True),
            "dual_clip": (1, False), "tis_cap": (0, True), "kl_coef": (0, True), "entropy_coef": (0, True),
            "mtp_loss_scale": (0, True)}
AT_MOST = {"clip_low": (1, False), "gpu_memory_utilization": (1, True)}
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
    if sequences % args.micro_batches:
        problems.append(f"--micro-batches {args.micro_batches}: expected a divisor of the {sequences} sequences "
                        f"per step (--prompts-per-step x --group-size)")
    if args.model is not None and not os.path.isfile(os.path.join(args.model, "config.json")):
        problems.append(f"--model {args.model!r}: no config.json there; expected a Hugging Face checkpoint dir")
    if args.data is not None and not os.path.isfile(args.data):
        problems.append(f"--data {args.data!r}: no such file; expected a {' or '.join(DATA_FORMATS)} file of "
                        "examples")
    elif args.data is not None and not args.data.endswith(DATA_FORMATS):
        problems.append(f"--data {args.data!r}: extension {os.path.splitext(args.data)[1] or '(none)'!r} is not "
                        f"read; expected {' or '.join(DATA_FORMATS)}")
    # Packages only some runs import: missing, they would stop the run after the model loads.
    if args.data is not None and args.data.endswith(".parquet") and importlib.util.find_spec("pyarrow") is None:
        problems.append(f"--data {args.data!r}: reading Parquet needs pyarrow; pip install pyarrow")
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
    if args.resume is not None:
        missing = [f"rank{rank}.pt" for rank in range(world_size)
                   if not os.path.isfile(os.path.join(args.resume, f"rank{rank}.pt"))]
        if missing:
            problems.append(f"--resume {args.resume!r}: no {missing[0]} there; expected the checkpoint dir an "
                            f"earlier run wrote (OUT/checkpoint) with the same number of processes ({world_size})")
    try:
        spec_config.build_mtp_speculative_config("mtp", args.num_speculative_tokens, args.spec_config)
    except (TypeError, ValueError, RuntimeError) as error:
        problems.append(f"--spec-config {args.spec_config!r}: {error}")
    if not problems:
        problems += model_problems(args)
    return problems


def model_problems(args):
    """Flags that must fit the model's config.json (the built-in model's config without --model)."""
    hf_config = tiny_model.mimo_config() if args.model is None else load_hf_config(args.model)
    where = args.model or "the built-in model"
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
    return tiny_model.mimo_config() if args.model is None else load_hf_config(args.model)


# ---------------------------------------------------------------------------------------
# Data and reward
# ---------------------------------------------------------------------------------------

def builtin_example(rng):
    letter = rng.choice(TASK_ALPHABET)
    return {"prompt": f"repeat:{letter}", "answer": letter * TASK_LENGTH}


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
    """Built-in task: per-character credit, one reward per response token (1.0 where it
    equals the answer's token at its place)."""
    return [float(k < len(answer_ids) and token == answer_ids[k]) for k, token in enumerate(response_ids)]


def reward(response, answer):
    """--data: exact match, or numeric match when the answer is a number; 0.0 or 1.0."""
    response = response.strip()
    try:
        return float(abs(float(response) - float(answer)) <= NUMERIC_TOLERANCE)
    except ValueError:
        return float(response == answer.strip())


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
    """Per-token PPO loss with separate low/high clip, dual clip and truncated IS; [T] tensors."""
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - args.clip_low, 1 + args.clip_high)
    loss = torch.maximum(unclipped, clipped)
    loss = torch.where(advantages < 0, torch.minimum(loss, -advantages * args.dual_clip), loss)
    if args.tis_cap > 0:
        loss = loss * torch.exp(old_logprobs - rollout_logprobs).clamp(max=args.tis_cap).detach()
    clipped_fraction = (clipped > unclipped).float()
    return loss, clipped_fraction


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


def build_engine(model_dir, args, rank, dtype):
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
    if args.mtp_rollout:
        spec_config.fix_cpu_draft_sampling()
        options["speculative_config"] = spec_config.build_mtp_speculative_config(
            "mtp", args.num_speculative_tokens, args.spec_config)
        # Acceptance of exactly the rollout's requests (not the probe's).
        options["per_request_spec_decode_metrics"] = "summary"
    return LLM(**options)


def save_checkpoint(directory, policy, step, rank):
    os.makedirs(directory, exist_ok=True)
    torch.save({"model": policy.model.state_dict(), "optimizer": policy.optimizer.state_dict(), "step": step},
               os.path.join(directory, f"rank{rank}.pt"))
    dist.barrier()


def load_checkpoint(directory, policy, rank):
    """Restore model and optimizer state saved by `save_checkpoint`; returns the step it was saved at."""
    state = torch.load(os.path.join(directory, f"rank{rank}.pt"), weights_only=False)
    policy.model.load_state_dict(state["model"])
    with cuda_on_cpu():
        policy.optimizer.load_state_dict(state["optimizer"])
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


def sample_prompts(examples, step, args, dp_size):
    """The step's examples (`--prompts-per-step` per data-parallel rank), the same on every
    rank: drawn from a generator seeded by (seed, step) alone."""
    step_rng = random.Random(args.seed * 1_000_003 + step)
    return [builtin_example(step_rng) if examples is None else step_rng.choice(examples)
            for _ in range(args.prompts_per_step * dp_size)]


def rollout(llm, tokenizer, examples, args, rank):
    """All of the step's examples -> (samples, outputs): `--group-size` completions per
    example, in example order, on every rank; `outputs` are this engine's RequestOutputs.

    Each vLLM engine (a rollout tensor-parallel group) samples a slice of the step's
    examples; the slices are gathered so every trainer rank can take its own. A sample is
    {example, prompt_ids, response_ids, text, rollout_logprobs}. Prompts go to vLLM as
    token ids (`prompt_token_ids`), and `prompt_ids` are the ids vLLM reports it sampled
    from: Megatron trains on exactly those.
    """
    from vllm import SamplingParams
    num_engines = dist.get_world_size() // args.rollout_tp
    engine, engine_rank = rank // args.rollout_tp, rank % args.rollout_tp
    share = examples[engine::num_engines]
    # The built-in task's answers have a fixed length: no end-of-sequence to learn first.
    # Special tokens stay in the text, so the reward sees (and penalises) them.
    params = SamplingParams(n=args.group_size, temperature=args.temperature, max_tokens=args.max_new_tokens,
                            logprobs=0, ignore_eos=args.data is None, skip_special_tokens=False)
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
        ordered.extend(by_engine[engine][position * args.group_size:(position + 1) * args.group_size])
    return ordered, outputs


def generate(llm, meter, tokenizer, examples, args, rank):
    """The rollout phase: completions, this engine's draft acceptance (None without
    drafting), and vLLM put to sleep on a GPU so Megatron gets its memory."""
    samples, outputs = rollout(llm, tokenizer, examples, args, rank)
    acceptance = meter.read(outputs) if meter is not None else None
    if torch.cuda.is_available():
        # Level 2 drops vLLM's weights (every sync pushes them all again); level 1 keeps a
        # host copy, needed when the draft drafts but does not train (nothing refills it).
        llm.sleep(level=1 if args.mtp_rollout and not args.mtp_train else 2)
    return samples, acceptance


def score(samples, tokenizer, args):
    """Rewards [N] fp32 and each sample's per-token advantages (set on the sample).

    Built-in task: per-character credit baselined per answer position; --data: one
    exact-match reward per completion, spread over its tokens.
    """
    if args.data is None:
        credits = torch.tensor([token_credits(s["response_ids"], tokenizer.encode(
            s["example"]["answer"], add_special_tokens=False)) for s in samples])         # [N, L]
    else:
        credits = torch.tensor([[reward(s["text"], s["example"]["answer"])] for s in samples])  # [N, 1]
    advantages = group_advantages(credits, args.group_size, args.advantage)
    for sample, advantage in zip(samples, advantages):
        sample["advantages"] = advantage.expand(len(sample["response_ids"]))
    return credits.mean(1)


def pack_micro_batch(samples, device):
    """Samples -> packed tensors on `device`: input_ids [T] int64, seqlens [B] int64, and
    loss_mask, advantages, rollout_logprobs [T] fp32, each at the position that predicts
    its response token (position i predicts token i + 1)."""
    sequences = [s["prompt_ids"] + s["response_ids"] for s in samples]
    seqlens = torch.tensor([len(ids) for ids in sequences])
    input_ids = torch.tensor([token for ids in sequences for token in ids])
    loss_mask, advantages, rollout_logprobs = (torch.zeros(len(input_ids)) for _ in range(3))
    offset = 0
    for sample, length in zip(samples, seqlens.tolist()):
        first, last = offset + len(sample["prompt_ids"]) - 1, offset + length - 1
        loss_mask[first:last] = 1.0
        advantages[first:last] = sample["advantages"]
        rollout_logprobs[first:last] = torch.tensor(sample["rollout_logprobs"])
        offset += length
    # Built on the host, moved once.
    return [tensor.to(device) for tensor in (input_ids, seqlens, loss_mask, advantages, rollout_logprobs)]


def micro_batch_loss(policy, samples, num_sequences, num_tokens, args, sums):
    """Forward one micro-batch; returns its loss (a scalar: its share of the global mean)
    and adds its metric sums (over this rank's tokens) into `sums` by name."""
    device = next(policy.model.parameters()).device
    input_ids, seqlens, loss_mask, advantages, rollout_logprobs = pack_micro_batch(samples, device)
    weights = token_weights(loss_mask, seqlens, args.loss_agg, num_sequences, num_tokens)
    out = forward_logprobs(policy.model, input_ids, seqlens, loss_mask=loss_mask, temperature=args.temperature,
                           with_entropy=True, mtp_train=args.mtp_train)
    batch, local_mask = out.batch, out.loss_mask
    old_logprobs = out.logprobs.detach()
    local_rollout, local_weights = batch.pack(rollout_logprobs), batch.pack(weights)
    per_token, clipped = policy_loss(out.logprobs, old_logprobs, local_rollout, batch.pack(advantages), args)
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
    sums["total_loss"] += float(loss.detach())
    sums["clip_fraction"] += float((clipped * local_mask).sum())
    sums["entropy"] += float((out.entropy.detach() * local_mask).sum())
    sums["logprob_mismatch_mean"] += float(mismatch.sum())
    sums["logprob_mismatch_max"] = max(sums["logprob_mismatch_max"], float(mismatch.max()))
    sums["mtp_loss"] += float(out.mtp_loss) / args.micro_batches if out.mtp_loss is not None else 0.0
    sums["tokens"] += float(local_mask.sum())
    return loss


def train_step(policy, samples, args):
    """PPO update on this data-parallel rank's samples; returns the metric sums of this
    rank by name (reduce them over ranks with `reduce_metrics`) and the global grad_norm."""
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
    sums = dict.fromkeys(SUMMED_METRICS + MAXED_METRICS, 0.0)
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


# How `reduce_metrics` combines each train metric over data x context parallel ranks: each
# rank holds a share of the step's tokens.
TOKEN_MEAN_METRICS = ("clip_fraction", "entropy", "logprob_mismatch_mean", "kl_to_reference")
SUMMED_METRICS = TOKEN_MEAN_METRICS + ("tokens", "mtp_loss", "total_loss")
MAXED_METRICS = ("logprob_mismatch_max",)


def reduce_metrics(sums, device):
    """Per-rank sums by name -> the step's values: token means, the MTP loss averaged over
    data-parallel ranks (each rank's is its share of its data-parallel rank's mean), the
    total loss summed (it is normalised globally), maxima; grad_norm is already global."""
    group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    summed = torch.tensor([sums[name] for name in SUMMED_METRICS], device=device)
    dist.all_reduce(summed, group=group)
    maxed = torch.tensor([sums[name] for name in MAXED_METRICS], device=device)
    dist.all_reduce(maxed, op=dist.ReduceOp.MAX, group=group)
    totals = dict(zip(SUMMED_METRICS, summed))
    metrics = {name: (totals[name] / totals["tokens"].clamp(min=1)).item() for name in TOKEN_MEAN_METRICS}
    metrics["mtp_loss"] = totals["mtp_loss"].item() / parallel_state.get_data_parallel_world_size()
    metrics["total_loss"] = totals["total_loss"].item()
    metrics.update(zip(MAXED_METRICS, maxed.tolist()))
    metrics["grad_norm"] = sums["grad_norm"]
    return metrics


def probe(llm):
    """Greedy continuation of a fixed prompt and its summed log-prob: changes when the weights do."""
    from vllm import SamplingParams
    completion = llm.generate([PROBE_PROMPT], SamplingParams(temperature=0.0, max_tokens=PROBE_TOKENS, logprobs=0),
                              use_tqdm=False)[0].outputs[0]
    return completion.text, sum(step[token].logprob for step, token in zip(completion.logprobs, completion.token_ids))


def sync_weights(policy, llm, step):
    """The sync phase: wake vLLM (GPU), push every weight, MTP draft included, and probe it;
    returns the probe's {probe_text, probe_logprob, weight_version}."""
    if torch.cuda.is_available():
        llm.wake_up()
    weight_sync.push_to_vllm(policy.model, llm, weight_version=str(step))
    text, logprob = probe(llm)
    return {"probe_text": text, "probe_logprob": logprob, "weight_version": llm.get_weight_version()}


def step_record(step, samples, rewards, train_metrics, acceptance, sync_result, seconds):
    """One line of metrics.jsonl: every value of the step by name."""
    response_tokens = sum(len(s["response_ids"]) for s in samples)
    return {
        "step": step,
        "reward_mean": rewards.mean().item(), "reward_std": rewards.std().item(),
        "accuracy": (rewards == 1).float().mean().item(),
        "response_length": response_tokens / len(samples),
        **train_metrics,
        "acceptance_rate": acceptance["acceptance_rate"] if acceptance else None,
        "mean_acceptance_length": acceptance["mean_acceptance_length"] if acceptance else None,
        **sync_result,
        **{f"{phase}_s": value for phase, value in seconds.items()},
        "tokens_per_s": response_tokens / sum(seconds.values()),
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
          f"accept {accept} mtp {record['mtp_loss']:.3f} ent {record['entropy']:.2f} "
          f"mismatch {record['logprob_mismatch_mean']:.1e} gnorm {record['grad_norm']:.2f} "
          f"| {sum(record[f'{p}_s'] for p in ('rollout', 'train', 'sync')):.1f}s/step "
          f"({record['rollout_s']:.1f} roll, {record['train_s']:.1f} train, {record['sync_s']:.1f} sync) "
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
    axis.set_xlabel("step")
    axis.set_ylim(0, 1.05)
    axis.grid(alpha=0.3)
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)


def read_records(metrics_path, last_step):
    """metrics.jsonl's records up to `last_step` (those a resumed run keeps)."""
    if not os.path.exists(metrics_path):
        return []
    with open(metrics_path) as f:
        return [record for record in map(json.loads, f) if record["step"] <= last_step]


def _broadcast(value):
    holder = [value]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


# ---------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------

def main(args):
    hf_config = check_args(args, int(os.environ.get("WORLD_SIZE", "1")))
    examples = load_examples(args.data, args.prompt_key, args.answer_key) if args.data else None
    args.mtp_rollout = hf_config.get("num_nextn_predict_layers", 0) > 0 if args.mtp_rollout is None \
        else args.mtp_rollout
    args.mtp_train = args.mtp_train and hf_config.get("num_nextn_predict_layers", 0) > 0
    use_bf16 = torch.cuda.is_available() if args.bf16 is None else args.bf16
    dtype = torch.bfloat16 if use_bf16 else torch.float32

    rank, world_size, device = init_distributed()
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    # The built-in model is written once and cached; only rank 0 writes it.
    model_dir = args.model or _broadcast(tiny_model.build_tiny_mimo(DEFAULT_MODEL_DIR) if rank == 0 else None)
    # The one tokenizer of prompts and answers (vLLM loads the same, through transformers):
    # prompts reach vLLM as token ids, so vLLM samples from the tokens Megatron trains on.
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if examples is not None:
        check_prompts(examples, tokenizer, hf_config.get("max_position_embeddings", 4096), args.max_new_tokens)
    init_model_parallel(tensor_parallel=args.tp, context_parallel=args.cp, seed=args.seed)
    mtp_patch.patch_megatron_mtp()
    policy = build_policy(model_dir, args, device, dtype)
    start_step = load_checkpoint(args.resume, policy, rank) if args.resume else 0
    llm = build_engine(model_dir, args, rank, "bfloat16" if use_bf16 else "float32")
    if start_step:
        weight_sync.push_to_vllm(policy.model, llm, weight_version=str(start_step))
    meter = spec_config.SpecDecodeMeter(llm) if args.mtp_rollout else None
    dp_rank, dp_size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    os.makedirs(args.out, exist_ok=True)
    metrics_path = os.path.join(args.out, "metrics.jsonl")
    records = read_records(metrics_path, start_step) if rank == 0 and start_step else []
    writer = open_tensorboard(args, start_step) if rank == 0 else None
    started = time.time()

    for step in range(start_step + 1, args.steps + 1):
        timer = PhaseTimer()
        # Prompts: the same examples on every rank, from (seed, step) alone
        examples_now = sample_prompts(examples, step, args, dp_size)
        # Rollout: vLLM samples --group-size completions per prompt, the MTP head drafting
        with timer("rollout"):
            samples, acceptance = generate(llm, meter, tokenizer, examples_now, args, rank)
        # Rewards and GRPO advantages, then PPO on this data-parallel rank's share
        with timer("train"):
            rewards = score(samples, tokenizer, args)
            per_rank = args.prompts_per_step * args.group_size
            train_sums = train_step(policy, samples[dp_rank * per_rank:(dp_rank + 1) * per_rank], args)
        # Sync: the new weights, MTP draft included, into vLLM
        with timer("sync"):
            sync_result = sync_weights(policy, llm, step)
        # Log and checkpoint
        record = step_record(step, samples, rewards, reduce_metrics(train_sums, device), acceptance, sync_result,
                             timer.seconds)
        if rank == 0:
            records.append(record)
            log_step(record, metrics_path, writer, args, time.time() - started, step - start_step)
        if step % args.save_every == 0 or step == args.steps:
            save_checkpoint(os.path.join(args.out, "checkpoint"), policy, step, rank)

    weight_sync.save_hf_checkpoint(policy.model, model_dir, os.path.join(args.out, "final"))
    if writer is not None:
        writer.close()
    if rank == 0 and records:
        plot_curves(records, os.path.join(args.out, "curves.png"))
        print(f"wrote {metrics_path}, {os.path.join(args.out, 'curves.png')}, {os.path.join(args.out, 'final')}")
    return records


if __name__ == "__main__":
    main(parse_args())
