"""The GRPO loss, in plain torch: group advantages, loss aggregation, PPO policy loss, KL.

Everything a trainer computes between the rewards and `loss.backward()`, as functions of
tensors (no model, no process group, no flags object), so it can be read and tested by
hand and copied into another trainer:

    advantages = group_advantages(rewards, group_size=8, mode="grpo")        # [N] or [N, L]
    weights = token_weights(loss_mask, seqlens, "token-mean", num_sequences, num_tokens)
    per_token, acted = policy_loss(logprobs, old_logprobs, rollout_logprobs, token_advantages,
                                   clip_low=0.2, clip_high=0.28, dual_clip=3.0, tis_cap=2.0)
    loss = (per_token * weights).sum() - entropy_coef * (entropy * weights).sum() \
           + kl_coef * (k3_kl(logprobs, reference_logprobs) * loss_mask * weights).sum()

Conventions: one packed batch of T tokens (the sequences of a micro-batch concatenated);
every per-token tensor is [T] fp32 and sits at the position that predicts its token, zero
(in `loss_mask`) at prompts and padding. Imports torch only.
"""

import torch

# GRPO's std normalisation: a group whose rewards are all equal has std 0.
ADVANTAGE_EPS = 1e-6
# k3 = exp(x) - x - 1 overflows fp32 past x ~ 88; the bound keeps it finite.
KL_LOG_RATIO_BOUND = 20.0

ADVANTAGE_MODES = ("grpo", "mean-only", "leave-one-out")
LOSS_AGGREGATIONS = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")


def group_advantages(rewards, group_size, mode):
    """[N] or [N, L] rewards, N in consecutive groups of `group_size` -> advantages of the
    same shape (fp32).

    mode: "grpo" (mean/std baseline), "mean-only" (Dr. GRPO: no std division) or
    "leave-one-out" (each completion against the mean of the others). With per-token
    rewards ([N, L]) each answer position is baselined against the same position of the
    other completions in its group.
    """
    if mode not in ADVANTAGE_MODES:
        raise ValueError(f"mode={mode!r}: expected one of {ADVANTAGE_MODES}")
    if group_size < 2 or rewards.shape[0] % group_size:
        raise ValueError(f"group_size={group_size}: expected an int >= 2 dividing the {rewards.shape[0]} rewards")
    grouped = rewards.view(-1, group_size, *rewards.shape[1:])
    if mode == "leave-one-out":
        baseline = (grouped.sum(1, keepdim=True) - grouped) / (group_size - 1)
        return (grouped - baseline).view(rewards.shape)
    centred = grouped - grouped.mean(1, keepdim=True)
    if mode == "mean-only":
        return centred.view(rewards.shape)
    return (centred / (grouped.std(1, keepdim=True) + ADVANTAGE_EPS)).view(rewards.shape)


def token_weights(loss_mask, seqlens, mode, num_sequences, num_tokens):
    """Per-token weights w [T] fp32 with loss = sum(w * per_token_loss): the aggregation mode.

    loss_mask [T] fp32 (1 at response predictions), seqlens [B] int64 (the packed
    sequences' lengths, summing to T). num_sequences and num_tokens (a number or a 0-d /
    [1] tensor) are global counts, over every data-parallel rank and micro-batch, so that
    summing the ranks' gradients gives the mean:
      token-mean           every response token weighs the same (verl's default);
      seq-mean-token-sum   each sequence's token sum, averaged over sequences;
      seq-mean-token-mean  each sequence's token mean, averaged over sequences (GRPO paper).
    """
    if mode == "token-mean":
        return loss_mask / num_tokens
    if mode == "seq-mean-token-sum":
        return loss_mask / num_sequences
    if mode != "seq-mean-token-mean":
        raise ValueError(f"mode={mode!r}: expected one of {LOSS_AGGREGATIONS}")
    seqlens = seqlens.to(loss_mask.device)
    sequence = torch.repeat_interleave(torch.arange(len(seqlens), device=loss_mask.device), seqlens)
    per_sequence = torch.zeros(len(seqlens), device=loss_mask.device).index_add_(0, sequence, loss_mask).clamp(min=1)
    return loss_mask / per_sequence[sequence] / num_sequences


def policy_loss(logprobs, old_logprobs, rollout_logprobs, advantages, *, clip_low, clip_high, dual_clip, tis_cap):
    """Per-token PPO loss with separate low/high clip, dual clip and truncated IS.

    All inputs [T] fp32: log-probs under the policy being trained (with grad), under the
    policy that sampled (old, the trainer's numerics) and under the rollout engine
    (rollout), and the advantages. ratio = p / p_old is clipped to [1 - clip_low,
    1 + clip_high] the PPO way; for negative advantages the loss is also capped at
    -advantage x dual_clip; the whole is weighted by min(p_old / p_rollout, tis_cap)
    (truncated importance sampling against the rollout engine, no grad; tis_cap 0: off).
    Returns (loss [T], where the clips acted: {"clip_low", "clip_high", "dual_clip"} [T]
    0/1 fp32). clip_low + clip_high is the usual clip fraction.
    """
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - clip_low, 1 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    dual_bound = -advantages * dual_clip
    acted = {"clip_low": (clipped > unclipped) & (advantages < 0), "clip_high": (clipped > unclipped) & (advantages > 0),
             "dual_clip": (advantages < 0) & (loss > dual_bound)}
    loss = torch.where(advantages < 0, torch.minimum(loss, dual_bound), loss)
    if tis_cap > 0:
        loss = loss * torch.exp(old_logprobs - rollout_logprobs).clamp(max=tis_cap).detach()
    return loss, {name: where.float() for name, where in acted.items()}


def k3_kl(logprobs, reference_logprobs):
    """[T] fp32 k3 estimate of KL(policy || reference) per token (verl's "low_var_kl"):
    exp(x) - x - 1 with x = log p_ref - log p, x bounded to +-KL_LOG_RATIO_BOUND; >= 0,
    unbiased, gradient through `logprobs`."""
    log_ratio = (reference_logprobs - logprobs).clamp(-KL_LOG_RATIO_BOUND, KL_LOG_RATIO_BOUND)
    return torch.exp(log_ratio) - log_ratio - 1
