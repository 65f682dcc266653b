"""GRPO on Megatron-Core with colocated vLLM rollouts drafted by the model's own MTP head.

One process per device under torchrun. Each process holds a Megatron-Core policy shard
(tensor parallel --tp, context parallel --cp, data parallel = the rest) and a vLLM engine
on the same device (distributed_executor_backend="external_launcher", rollout tensor
parallel --rollout-tp). Each step:

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
MTP head can draft once the policy is sure of it. With --data, a JSONL file of
{"prompt", "answer"} lines is used with an exact-match reward (numeric when the answer
is a number).
"""

import argparse
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
from megatron_model import build_gpt_model, load_hf_config

DEFAULT_MODEL_DIR = os.path.join("runs", "tiny-mimo")
TASK_ALPHABET = "abcde"
TASK_LENGTH = 3
PROBE_PROMPT = "repeat:a"
PROBE_TOKENS = 4
NUMERIC_TOLERANCE = 1e-6
ADVANTAGE_EPS = 1e-6
ADAM_EPS = 1e-8


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default=None, help="MiMo-style HF checkpoint dir; default: the built-in tiny model")
    p.add_argument("--data", default=None, help="JSONL of {prompt, answer}; default: the built-in repeat task")
    p.add_argument("--out", default="runs/grpo", help="metrics.jsonl, curves.png, checkpoints, final HF dir")
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
    p.add_argument("--temperature", type=float, default=1.0, help="rollout sampling temperature")
    p.add_argument("--lr", type=float, default=3e-4, help="Adam learning rate")
    p.add_argument("--micro-batches", type=int, default=2, help="gradient accumulation micro-batches per step")
    p.add_argument("--grad-clip", type=float, default=1.0, help="global gradient-norm clip")
    p.add_argument("--advantage", choices=["grpo", "mean-only", "leave-one-out"], default="grpo",
                   help="group baseline: mean/std (GRPO), mean only (Dr. GRPO), leave-one-out mean")
    p.add_argument("--loss-agg", choices=["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"],
                   default="token-mean", help="how per-token losses are averaged")
    p.add_argument("--clip-low", type=float, default=0.2, help="PPO ratio clip below 1")
    p.add_argument("--clip-high", type=float, default=0.28, help="PPO ratio clip above 1")
    p.add_argument("--dual-clip", type=float, default=3.0, help="dual-clip bound for negative advantages")
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
    p.add_argument("--mtp-loss-scale", type=float, default=1.0, help="weight of the MTP loss")
    p.add_argument("--num-speculative-tokens", type=int, default=1, help="MTP draft tokens per step")
    p.add_argument("--spec-config", default=None, help="JSON object merged into vLLM's speculative_config")
    p.add_argument("--save-every", type=int, default=50, help="checkpoint every N steps (and at the end)")
    p.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=None,
                   help="bf16 weights and rollout (default: on with CUDA, off on CPU)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.3, help="vLLM's share of GPU memory")
    p.add_argument("--kv-cache-bytes", type=int, default=2**28, help="vLLM KV cache size on CPU")
    return p.parse_args(argv)


# ---------------------------------------------------------------------------------------
# Data and reward
# ---------------------------------------------------------------------------------------

def builtin_example(rng):
    letter = rng.choice(TASK_ALPHABET)
    return {"prompt": f"repeat:{letter}", "answer": letter * TASK_LENGTH}


def load_jsonl(path):
    """[{prompt, answer}] from a JSONL file; a bad line stops with its number."""
    if not os.path.isfile(path):
        raise SystemExit(f"--data {path!r}: no such file")
    examples = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise SystemExit(f"--data {path}: line {number} is not JSON ({error.msg})")
            if not isinstance(record, dict) or not isinstance(record.get("prompt"), str) \
                    or not isinstance(record.get("answer"), (str, int, float)):
                raise SystemExit(f"--data {path}: line {number} needs a string 'prompt' and an 'answer', got {line.strip()[:80]!r}")
            examples.append({"prompt": record["prompt"], "answer": str(record["answer"])})
    if not examples:
        raise SystemExit(f"--data {path}: no examples")
    return examples


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
# Setup
# ---------------------------------------------------------------------------------------

def check_layout(args, world_size):
    if world_size % (args.tp * args.cp):
        raise SystemExit(f"--tp {args.tp} x --cp {args.cp} = {args.tp * args.cp} does not divide the world "
                         f"size {world_size}")
    if world_size % args.rollout_tp:
        raise SystemExit(f"--rollout-tp {args.rollout_tp} does not divide the world size {world_size}")
    if args.group_size < 2:
        raise SystemExit(f"--group-size {args.group_size}: GRPO needs at least 2 completions per prompt")
    total = args.prompts_per_step * args.group_size
    if total % args.micro_batches:
        raise SystemExit(f"--micro-batches {args.micro_batches} must divide the {total} sequences per step")


def check_prompts(examples, tokenizer, max_len, max_new_tokens):
    too_long = [e["prompt"] for e in examples if len(tokenizer(e["prompt"])) + max_new_tokens > max_len]
    if too_long:
        raise SystemExit(f"{len(too_long)} prompt(s) do not fit the context of {max_len} tokens with "
                         f"{max_new_tokens} new tokens; first: {too_long[0][:80]!r}")


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


def probe(llm):
    """Greedy continuation of a fixed prompt and its summed log-prob: changes when the weights do."""
    from vllm import SamplingParams
    completion = llm.generate([PROBE_PROMPT], SamplingParams(temperature=0.0, max_tokens=PROBE_TOKENS, logprobs=0),
                              use_tqdm=False)[0].outputs[0]
    return completion.text, sum(step[token].logprob for step, token in zip(completion.logprobs, completion.token_ids))


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


def save_checkpoint(directory, model, optimizer, step, rank):
    os.makedirs(directory, exist_ok=True)
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step},
               os.path.join(directory, f"rank{rank}.pt"))
    dist.barrier()


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


# ---------------------------------------------------------------------------------------
# One step
# ---------------------------------------------------------------------------------------

def rollout(llm, examples, args, rollout_group, rollout_rank):
    """Every rank's share of the step's examples -> completions; returns the global list.

    Each vLLM engine (a rollout tensor-parallel group) samples a slice of the step's
    prompts; the slices are gathered so every trainer rank can take its own.
    """
    from vllm import SamplingParams
    num_groups = dist.get_world_size() // args.rollout_tp
    share = examples[rollout_group::num_groups]
    # The built-in task's answers have a fixed length: no end-of-sequence to learn first.
    # Special tokens stay in the text, so the reward sees (and penalises) them.
    params = SamplingParams(n=args.group_size, temperature=args.temperature, max_tokens=args.max_new_tokens,
                            logprobs=0, ignore_eos=args.data is None, skip_special_tokens=False)
    outputs = llm.generate([e["prompt"] for e in share], params, use_tqdm=False) if share else []
    mine = []
    for example, output in zip(share, outputs):
        for completion in output.outputs:
            mine.append({"example": example, "prompt_ids": list(output.prompt_token_ids),
                         "response_ids": list(completion.token_ids), "text": completion.text,
                         "rollout_logprobs": [step[token].logprob for step, token in
                                              zip(completion.logprobs, completion.token_ids)]})
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine if rollout_rank == 0 else [])
    # Back in prompt order: engine g sampled examples g, g + num_groups, ...
    by_group = [gathered[g * args.rollout_tp] for g in range(num_groups)]
    ordered = []
    for index in range(len(examples)):
        group, position = index % num_groups, index // num_groups
        ordered.extend(by_group[group][position * args.group_size:(position + 1) * args.group_size])
    return ordered, outputs


def train_step(model, ddp_model, reference, optimizer, samples, args):
    """PPO update on this data-parallel rank's samples; returns metrics (this rank's sums).

    `model` is the GPTModel that `ddp_model` wraps (forward runs on it; DDP's hooks catch
    the gradients), `optimizer` megatron-core's (see `build_optimizer`).
    """
    dp_size = parallel_state.get_data_parallel_world_size()
    per_micro = len(samples) // args.micro_batches
    num_sequences = len(samples) * dp_size
    device = next(model.parameters()).device
    num_tokens = torch.tensor([float(sum(len(s["response_ids"]) for s in samples))], device=device)
    dist.all_reduce(num_tokens, group=parallel_state.get_data_parallel_group())
    # The MTP loss is a mean per micro-batch and rank; gradients are summed over both.
    MTPLossAutoScaler.set_loss_scale(torch.tensor(args.mtp_loss_scale / (args.micro_batches * dp_size),
                                                  device=device))
    ddp_model.zero_grad_buffer()
    optimizer.zero_grad()
    totals = {"policy_loss": 0.0, "clip_fraction": 0.0, "entropy": 0.0, "mismatch_sum": 0.0, "mismatch_max": 0.0,
              "kl": 0.0, "mtp_loss": 0.0, "tokens": 0.0}
    for start in range(0, len(samples), per_micro):
        micro = samples[start:start + per_micro]
        sequences = [s["prompt_ids"] + s["response_ids"] for s in micro]
        seqlens = torch.tensor([len(ids) for ids in sequences])
        input_ids = torch.tensor([token for ids in sequences for token in ids])
        loss_mask, advantages, rollout_logprobs = (torch.zeros(len(input_ids)) for _ in range(3))
        offset = 0
        for sample, length in zip(micro, seqlens.tolist()):
            # Prediction at position i is of token i + 1: the response tokens' predictions
            # sit one slot before them.
            first = offset + len(sample["prompt_ids"]) - 1
            last = offset + length - 1
            loss_mask[first:last] = 1.0
            advantages[first:last] = sample["advantages"]
            rollout_logprobs[first:last] = torch.tensor(sample["rollout_logprobs"])
            offset += length
        # Built on the host, moved once.
        seqlens, input_ids, loss_mask, advantages, rollout_logprobs = (
            tensor.to(device) for tensor in (seqlens, input_ids, loss_mask, advantages, rollout_logprobs))
        weights = token_weights(loss_mask, seqlens, args.loss_agg, num_sequences, num_tokens)
        out = forward_logprobs(model, input_ids, seqlens, loss_mask=loss_mask, temperature=args.temperature,
                               with_entropy=True, mtp_train=args.mtp_train)
        batch = out.batch
        local_mask = out.loss_mask
        old_logprobs = out.logprobs.detach()
        local_rollout = batch.pack(rollout_logprobs)
        per_token, clipped = policy_loss(out.logprobs, old_logprobs, local_rollout, batch.pack(advantages), args)
        local_weights = batch.pack(weights)
        loss = (per_token * local_weights).sum()
        if args.entropy_coef > 0:
            loss = loss - args.entropy_coef * (out.entropy * local_weights).sum()
        if reference is not None:
            with torch.no_grad():
                reference_logprobs = forward_logprobs(reference, input_ids, seqlens, loss_mask=loss_mask,
                                                      temperature=args.temperature).logprobs
            log_ratio = (reference_logprobs - out.logprobs).clamp(-20, 20)
            k3 = (torch.exp(log_ratio) - log_ratio - 1) * local_mask
            loss = loss + args.kl_coef * (k3 * local_weights).sum()
            totals["kl"] += float((k3 * local_mask).sum())
        # Every rank stops together, before the optimizer touches the weights: the last
        # checkpoint on disk stays the last good one.
        finite = torch.isfinite(loss.detach()).float().view(1)
        dist.all_reduce(finite, op=dist.ReduceOp.MIN)
        if not finite.item():
            raise FloatingPointError(f"non-finite loss at micro-batch {start // per_micro} (this rank: "
                                     f"{loss.item()}); stopping with the last checkpoint in --out intact")
        loss.backward()
        mismatch = (old_logprobs - local_rollout).abs() * local_mask
        totals["policy_loss"] += float(loss.detach())
        totals["clip_fraction"] += float((clipped * local_mask).sum())
        totals["entropy"] += float((out.entropy.detach() * local_mask).sum())
        totals["mismatch_sum"] += float(mismatch.sum())
        totals["mismatch_max"] = max(totals["mismatch_max"], float(mismatch.max()))
        totals["mtp_loss"] += float(out.mtp_loss) / args.micro_batches if out.mtp_loss is not None else 0.0
        totals["tokens"] += float(local_mask.sum())
    ddp_model.finish_grad_sync()
    # DDP averages over data x context parallel ranks; the loss is normalised globally
    # (token_weights), so the gradient wanted is the sum.
    ddp_model.scale_gradients(parallel_state.get_data_parallel_world_size(with_context_parallel=True))
    with cuda_on_cpu():
        _, grad_norm, _ = optimizer.step()
    totals["grad_norm"] = grad_norm
    if not math.isfinite(grad_norm):
        # megatron's fp32 / bf16 step does not skip non-finite gradients: stop before
        # anything is saved, so the last checkpoint on disk stays the last good one.
        raise FloatingPointError(f"non-finite gradient norm {grad_norm}; stopping with the last checkpoint in "
                                 "--out intact")
    return totals


def main(args):
    rank, world_size, device = init_distributed()
    check_layout(args, world_size)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    if args.model is None:
        # Built once and cached; only rank 0 writes it.
        model_dir = _broadcast(tiny_model.build_tiny_mimo(DEFAULT_MODEL_DIR) if rank == 0 else None)
    elif not os.path.isfile(os.path.join(args.model, "config.json")):
        raise SystemExit(f"--model {args.model!r}: no config.json there; expected a Hugging Face checkpoint dir")
    else:
        model_dir = args.model
    hf_config = load_hf_config(model_dir)
    has_mtp = hf_config.get("num_nextn_predict_layers", 0) > 0
    if args.mtp_rollout and not has_mtp:
        raise SystemExit(f"--mtp-rollout: {model_dir} has no MTP layers (num_nextn_predict_layers is 0); "
                         "pass --no-mtp-rollout")
    args.mtp_rollout = has_mtp if args.mtp_rollout is None else args.mtp_rollout
    args.mtp_train = args.mtp_train and has_mtp
    use_bf16 = torch.cuda.is_available() if args.bf16 is None else args.bf16
    examples = load_jsonl(args.data) if args.data else None
    if examples is not None:
        from transformers import AutoTokenizer  # vLLM's own tokenizer loader, before vLLM starts
        check_prompts(examples, AutoTokenizer.from_pretrained(model_dir).encode,
                      hf_config.get("max_position_embeddings", 4096), args.max_new_tokens)
    if args.resume and not os.path.isfile(os.path.join(args.resume, f"rank{rank}.pt")):
        raise SystemExit(f"--resume {args.resume!r}: no rank{rank}.pt there; expected the checkpoint dir an "
                         f"earlier run wrote (OUT/checkpoint) with the same number of processes")

    init_model_parallel(tensor_parallel=args.tp, context_parallel=args.cp, seed=args.seed)
    mtp_patch.patch_megatron_mtp()
    dtype = torch.bfloat16 if use_bf16 else torch.float32
    model = build_gpt_model(model_dir, mtp=args.mtp_train, tensor_parallel=args.tp, context_parallel=args.cp,
                            params_dtype=dtype).to(device)
    weight_sync.load_hf_into_megatron(model, model_dir)
    reference = None
    if args.kl_coef > 0:
        reference = build_gpt_model(model_dir, mtp=False, tensor_parallel=args.tp, context_parallel=args.cp,
                                    params_dtype=dtype).to(device)
        weight_sync.load_hf_into_megatron(reference, model_dir)
        reference.eval()
    if args.mtp_train and args.mtp_rollout:
        # Megatron's MTP layer reads the trunk's hidden state after the final norm, vLLM's
        # MiMo drafter before it; RMSNorm is scale invariant, so both see the same input
        # only while the final norm's weight is uniform. Keep it as it is.
        model.decoder.final_layernorm.weight.requires_grad_(False)
    ddp_model, optimizer = build_optimizer(model, args)
    start_step = 0
    if args.resume:
        state = torch.load(os.path.join(args.resume, f"rank{rank}.pt"), weights_only=False)
        model.load_state_dict(state["model"])
        with cuda_on_cpu():
            optimizer.load_state_dict(state["optimizer"])
        start_step = state["step"]

    llm = build_engine(model_dir, args, rank, "bfloat16" if use_bf16 else "float32")
    tokenizer = llm.get_tokenizer()
    if start_step:
        weight_sync.push_to_vllm(model, llm, weight_version=str(start_step))
    meter = spec_config.SpecDecodeMeter(llm) if args.mtp_rollout else None
    # While Megatron trains, vLLM frees the GPU: level 2 drops its weights (every sync
    # pushes them all again), level 1 keeps a host copy, needed when the draft drafts but
    # does not train (nothing would refill it).
    sleep_level = 1 if args.mtp_rollout and not args.mtp_train else 2
    dp_rank, dp_size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    rollout_group, rollout_rank = rank // args.rollout_tp, rank % args.rollout_tp
    os.makedirs(args.out, exist_ok=True)
    metrics_path = os.path.join(args.out, "metrics.jsonl")
    records = []
    if rank == 0 and start_step and os.path.exists(metrics_path):
        with open(metrics_path) as f:
            records = [json.loads(line) for line in f if json.loads(line)["step"] <= start_step]
    started = time.time()
    for step in range(start_step + 1, args.steps + 1):
        step_rng = random.Random(args.seed * 1_000_003 + step)
        step_examples = [builtin_example(step_rng) if examples is None else step_rng.choice(examples)
                         for _ in range(args.prompts_per_step * dp_size)]

        t0 = time.time()
        samples, outputs = rollout(llm, step_examples, args, rollout_group, rollout_rank)
        acceptance = meter.read(outputs) if meter is not None else None
        if torch.cuda.is_available():
            llm.sleep(level=sleep_level)
        t1 = time.time()

        if examples is None:
            credits = torch.tensor([token_credits(s["response_ids"], tokenizer.encode(
                s["example"]["answer"], add_special_tokens=False)) for s in samples])         # [N, L]
        else:
            credits = torch.tensor([[reward(s["text"], s["example"]["answer"])] for s in samples])  # [N, 1]
        rewards = credits.mean(1)
        advantages = group_advantages(credits, args.group_size, args.advantage)
        for sample, advantage in zip(samples, advantages):
            sample["advantages"] = advantage.expand(len(sample["response_ids"]))
        per_rank = args.prompts_per_step * args.group_size
        mine = samples[dp_rank * per_rank:(dp_rank + 1) * per_rank]
        totals = train_step(model, ddp_model, reference, optimizer, mine, args)
        t2 = time.time()

        if torch.cuda.is_available():
            llm.wake_up()
        weight_sync.push_to_vllm(model, llm, weight_version=str(step))
        t3 = time.time()
        probe_text, probe_logprob = probe(llm)

        # Over data and context parallel ranks: each holds a share of the tokens. A rank's
        # MTP loss is its share of its data-parallel rank's mean.
        group = parallel_state.get_data_parallel_group(with_context_parallel=True)
        summed = torch.tensor([totals[k] for k in ("clip_fraction", "entropy", "mismatch_sum", "kl", "tokens",
                                                    "mtp_loss")], device=device)
        dist.all_reduce(summed, group=group)
        clip_fraction, entropy, mismatch, kl = (summed[:4] / summed[4].clamp(min=1)).tolist()
        mtp_loss = summed[5].item() / dp_size
        mismatch_max = torch.tensor([totals["mismatch_max"]], device=device)
        dist.all_reduce(mismatch_max, op=dist.ReduceOp.MAX, group=group)
        response_lengths = [len(s["response_ids"]) for s in samples]
        record = {
            "step": step,
            "reward_mean": rewards.mean().item(), "reward_std": rewards.std().item(),
            "accuracy": (rewards == 1).float().mean().item(),
            "response_length": sum(response_lengths) / len(response_lengths),
            "policy_loss": totals["policy_loss"], "clip_fraction": clip_fraction, "approx_kl": kl,
            "entropy": entropy, "grad_norm": totals["grad_norm"],
            "mtp_loss": mtp_loss,
            "acceptance_rate": acceptance["acceptance_rate"] if acceptance else None,
            "mean_acceptance_length": acceptance["mean_acceptance_length"] if acceptance else None,
            "logprob_mismatch_mean": mismatch, "logprob_mismatch_max": mismatch_max.item(),
            "probe_text": probe_text, "probe_logprob": probe_logprob, "weight_version": llm.get_weight_version(),
            "rollout_s": t1 - t0, "train_s": t2 - t1, "sync_s": t3 - t2,
            "tokens_per_s": sum(response_lengths) / (t3 - t0),
        }
        if rank == 0:
            records.append(record)
            with open(metrics_path, "a") as f:
                f.write(json.dumps(record) + "\n")
            done = step - start_step
            eta = (time.time() - started) / done * (args.steps - step)
            accept = f"{record['acceptance_rate']:.2f}" if record["acceptance_rate"] is not None else "-"
            print(f"step {step}/{args.steps} reward {record['reward_mean']:.3f} acc {record['accuracy']:.2f} "
                  f"accept {accept} mtp {record['mtp_loss']:.3f} ent {entropy:.2f} "
                  f"mismatch {mismatch:.1e} gnorm {record['grad_norm']:.2f} "
                  f"| {t3 - t0:.1f}s/step ({t1 - t0:.1f} roll, {t2 - t1:.1f} train, {t3 - t2:.1f} sync) "
                  f"eta {eta / 60:.1f} min", flush=True)
        if step % args.save_every == 0 or step == args.steps:
            save_checkpoint(os.path.join(args.out, "checkpoint"), model, optimizer, step, rank)

    weight_sync.save_hf_checkpoint(model, model_dir, os.path.join(args.out, "final"))
    if rank == 0 and records:
        plot_curves(records, os.path.join(args.out, "curves.png"))
        print(f"wrote {metrics_path}, {os.path.join(args.out, 'curves.png')}, {os.path.join(args.out, 'final')}")
    return records


def _broadcast(value):
    holder = [value]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


if __name__ == "__main__":
    main(parse_args())
