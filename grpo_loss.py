"""The GRPO loss, in plain torch: group advantages, loss aggregation, policy losses, KL, and
the 2026 recipe's pieces around them (rollout masks, overlong penalty, group filter).

Everything a trainer computes between the rewards and `loss.backward()`, as functions of
tensors (no model, no process group, no flags object), so it can be read and tested by
hand and copied into another trainer:

    rewards = rewards + overlong_penalty(response_lengths, max_new_tokens=512, buffer=128, penalty=1.0)
    keep = informative_groups(rewards, group_size=8)                          # dynamic sampling
    advantages = group_advantages(rewards, group_size=8, mode="grpo")        # [N] or [N, L]
    weights = token_weights(loss_mask, seqlens, "token-mean", num_sequences, num_tokens)
    weights = weights * rollout_mask(old_logprobs, rollout_logprobs, loss_mask, sequence_index,
                                     len(seqlens), "token", low=0.5, high=5.0, sum_over_ranks=cp_sum)
    per_token, acted = policy_loss(logprobs, old_logprobs, rollout_logprobs, token_advantages,
                                   clip_low=0.2, clip_high=0.28, dual_clip=3.0, tis_cap=2.0,
                                   loss="ppo", loss_mask=loss_mask, sequence_index=sequence_index,
                                   num_sequences=len(seqlens), sum_over_ranks=cp_sum)
    loss = (per_token * weights).sum() - entropy_coef * (entropy * weights).sum() \
           + kl_coef * (k3_kl(logprobs, reference_logprobs) * loss_mask * weights).sum()

Conventions: one packed batch of T tokens (the sequences of a micro-batch concatenated);
every per-token tensor is [T] fp32 and sits at the position that predicts its token, zero
(in `loss_mask`) at prompts and padding. `sequence_index` [T] int64 says which packed
sequence each token belongs to; with context parallelism a rank holds only part of each
sequence, and `sum_over_ranks` (the caller's all-reduce over the context-parallel group,
None when a rank holds whole sequences) completes every per-sequence sum. `LossConfig`
holds the loss's settings, `RewardConfig` the batch's (rewards to advantages), for a
trainer that keeps them in one place. Imports torch only.
"""

import dataclasses

import torch

# GRPO's std normalisation: a group whose rewards are all equal has std 0.
ADVANTAGE_EPS = 1e-6
# k3 = exp(x) - x - 1 overflows fp32 past x ~ 88; the bound keeps it finite.
KL_LOG_RATIO_BOUND = 20.0
# verl's low_var_kl clamps k3 itself to [-10, 10] too (k3 >= 0: only 10 acts). A token with
# x = log p_ref - log p above 2.6 or below -11 then adds a constant 10 and no gradient, so
# one far-off token (k3 and its gradient reach e^20) cannot outweigh the batch's policy loss.
KL_VALUE_BOUND = 10.0

# GSPO's sequence ratio is exp of a mean log-ratio; verl bounds the log at 10 so that one
# stale sequence cannot overflow the loss (its ratio is clipped far below e^10 anyway).
GSPO_LOG_RATIO_BOUND = 10.0

ADVANTAGE_MODES = ("grpo", "mean-only", "leave-one-out")
LOSS_AGGREGATIONS = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")
POLICY_LOSSES = ("ppo", "gspo", "cispo")
ROLLOUT_MASK_LEVELS = ("off", "token", "sequence")


@dataclasses.dataclass(frozen=True)
class LossConfig:
    """The policy loss's settings, as a trainer passes them to `policy_loss`, `rollout_mask`
    and its own entropy and KL terms."""
    loss: str = "ppo"                 # POLICY_LOSSES; PPO's token ratio is the common baseline
    loss_agg: str = "token-mean"      # LOSS_AGGREGATIONS; DAPO's: long answers are not down-weighted
    clip_low: float = 0.2             # PPO's usual clip below 1
    clip_high: float = 0.28           # DAPO's clip-higher: room for rare tokens to gain probability
    dual_clip: float = 3.0            # bounds the loss of a negative advantage whose ratio ran away
    tis_cap: float = 2.0              # truncated IS against the rollout engine's log-probs (0: off)
    rollout_mask: str = "off"         # ROLLOUT_MASK_LEVELS; TIS already corrects the mismatch
    rollout_mask_low: float = 0.5     # the ratio band a masked token or sequence must stay in
    rollout_mask_high: float = 2.0
    entropy_coef: float = 0.02        # keeps a random-init policy from collapsing onto one answer
    kl_coef: float = 0.0              # k3 KL to the initial policy; 0 needs no reference model


@dataclasses.dataclass(frozen=True)
class RewardConfig:
    """How a step's rollouts become its batch, as a trainer passes them to
    `overlong_penalty`, `informative_groups` and `group_advantages`: the groups, DAPO's
    overlong shaping and dynamic sampling, the advantage's baseline."""
    max_new_tokens: int               # the response limit the overlong shaping counts from
    group_size: int = 8               # completions per prompt: each baselined against the others
    advantage: str = "grpo"           # ADVANTAGE_MODES; mean/std, the common baseline
    overlong_filter: bool = False     # truncated completions stay out of the loss
    overlong_buffer: int = 0          # DAPO's soft overlong punishment over the last N tokens (0: off)
    overlong_penalty: float = 1.0     # the reward taken from a completion of max_new_tokens tokens
    dynamic_sampling: bool = False    # groups of equal rewards dropped, more rolled out in their place
    max_sampling_rounds: int = 1      # rollouts per step at most (> 1 only with dynamic sampling)


def group_advantages(rewards, group_size, mode):
    """[N] or [N, L] rewards, N in consecutive groups of `group_size` -> advantages of the
    same shape (fp32).

    mode: "grpo" (mean/std baseline), "mean-only" (Dr. GRPO: no std division) or
    "leave-one-out" (each completion against the mean of the others). With per-token
    rewards ([N, L]) each answer position is baselined against the same position of the
    other completions in its group. A group (or position) whose rewards are all equal gets
    exactly 0, in every mode.
    """
    if mode not in ADVANTAGE_MODES:
        raise ValueError(f"mode={mode!r}: expected one of {ADVANTAGE_MODES}")
    if group_size < 2 or rewards.shape[0] % group_size:
        raise ValueError(f"group_size={group_size}: expected an int >= 2 dividing the {rewards.shape[0]} rewards")
    grouped = rewards.view(-1, group_size, *rewards.shape[1:])
    if mode == "leave-one-out":
        baseline = (grouped.sum(1, keepdim=True) - grouped) / (group_size - 1)
        advantages = grouped - baseline
    else:
        advantages = grouped - grouped.mean(1, keepdim=True)
        if mode == "grpo":
            advantages = advantages / (grouped.std(1, keepdim=True) + ADVANTAGE_EPS)
    # The fp32 mean of equal non-dyadic rewards (8 x 0.7) is off by an ulp, and dividing
    # that by a std of ~6e-8 gives advantages up to 0.056 (verl has the same noise). An
    # exact test, not float64: every other group keeps its fp32 values bit for bit.
    equal = grouped.amax(1, keepdim=True) == grouped.amin(1, keepdim=True)
    return torch.where(equal, torch.zeros_like(advantages), advantages).view(rewards.shape)


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


def policy_loss(logprobs, old_logprobs, rollout_logprobs, advantages, *, clip_low, clip_high, dual_clip, tis_cap,
                loss="ppo", loss_mask=None, sequence_index=None, num_sequences=None, sum_over_ranks=None):
    """Per-token policy loss: PPO (default), GSPO or CISPO, then truncated IS.

    logprobs, old_logprobs, rollout_logprobs, advantages [T] fp32: log-probs under the
    policy being trained (with grad), under the policy that sampled (old, the trainer's
    numerics) and under the rollout engine (rollout), and the advantages.
      ppo    ratio = p / p_old clipped to [1 - clip_low, 1 + clip_high] the PPO way (max of
             the unclipped and clipped -advantage x ratio); for negative advantages the loss
             is also capped at -advantage x dual_clip.
      gspo   GSPO-token (Zheng et al. 2025; verl "gspo"): the ratio is the sequence's,
             exp(mean over its loss tokens of log p - log p_old) (detached; log bounded at
             GSPO_LOG_RATIO_BOUND), times p / sg(p) per token for the gradient, clipped the
             PPO way with clip_low/clip_high; no dual clip (GSPO has none). Needs loss_mask
             [T] fp32, sequence_index [T] int64, num_sequences and sum_over_ranks (see
             `sequence_sums`); pair it with "seq-mean-token-mean" aggregation as verl does.
      cispo  CISPO (MiniMax-M1): -sg(min(ratio, 1 + clip_high)) x advantage x log p; every
             token keeps a gradient, none is clipped away; clip_low and dual_clip unused.
    The whole is weighted by min(p_old / p_rollout, tis_cap) (truncated importance sampling
    against the rollout engine, no grad; tis_cap 0: off). Returns (loss [T], where the
    clips acted: {"clip_low", "clip_high", "dual_clip"} [T] 0/1 fp32); for gspo a clip flag
    holds for every token of a clipped sequence; for cispo "clip_high" marks the tokens
    whose weight was capped, whatever the advantage's sign, and the other two are 0.
    """
    if loss not in POLICY_LOSSES:
        raise ValueError(f"loss={loss!r}: expected one of {POLICY_LOSSES}")
    if loss == "cispo":
        per_token, acted = _cispo_loss(logprobs, old_logprobs, advantages, clip_high)
    else:
        if loss == "gspo":
            if loss_mask is None or sequence_index is None or num_sequences is None:
                raise ValueError("loss='gspo' needs loss_mask, sequence_index and num_sequences: "
                                 f"got {type(loss_mask).__name__}, {type(sequence_index).__name__}, {num_sequences!r}")
            log_ratio = _sequence_mean(logprobs - old_logprobs, loss_mask, sequence_index, num_sequences,
                                       sum_over_ranks)
            # The value is the sequence's ratio; the gradient is each token's own, d log p.
            ratio = torch.exp((logprobs - logprobs.detach() + log_ratio).clamp(max=GSPO_LOG_RATIO_BOUND))
        else:
            ratio = torch.exp(logprobs - old_logprobs)
        dual = dual_clip if loss == "ppo" else None
        per_token, acted = _clipped_surrogate(ratio, advantages, clip_low, clip_high, dual)
    if tis_cap > 0:
        per_token = per_token * torch.exp(old_logprobs - rollout_logprobs).clamp(max=tis_cap).detach()
    return per_token, {name: where.float() for name, where in acted.items()}


def _clipped_surrogate(ratio, advantages, clip_low, clip_high, dual_clip):
    """PPO's pessimistic clipped loss of [T] ratios and advantages, with the dual clip
    unless dual_clip is None; returns (loss [T], {"clip_low", "clip_high", "dual_clip"} [T] bool)."""
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - clip_low, 1 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    acted = {"clip_low": (clipped > unclipped) & (advantages < 0),
             "clip_high": (clipped > unclipped) & (advantages > 0)}
    if dual_clip is None:
        return loss, dict(acted, dual_clip=torch.zeros_like(acted["clip_low"]))
    dual_bound = -advantages * dual_clip
    acted["dual_clip"] = (advantages < 0) & (loss > dual_bound)
    return torch.where(advantages < 0, torch.minimum(loss, dual_bound), loss), acted


def _cispo_loss(logprobs, old_logprobs, advantages, clip_high):
    """CISPO's [T] loss and acted flags (see `policy_loss`). No lower bound on the weight:
    MiniMax-M1 sets none, TRL clamps from above only (verl's example sets clip_ratio_low 10)."""
    ratio = torch.exp(logprobs - old_logprobs).detach()
    capped = ratio > 1 + clip_high
    loss = -ratio.clamp(max=1 + clip_high) * advantages * logprobs
    never = torch.zeros_like(capped)
    return loss, {"clip_low": never, "clip_high": capped, "dual_clip": never}


def sequence_sums(values, sequence_index, num_sequences, sum_over_ranks=None):
    """Per-sequence sums of per-token values: values [T] or [T, k] (any float dtype; detached
    here), sequence_index [T] int64 in [0, num_sequences) -> [num_sequences] or
    [num_sequences, k] fp32, no grad.

    With context parallelism a sequence's tokens are split over ranks: `sum_over_ranks`
    takes this rank's partial sums (a detached fp32 tensor of that shape) and returns the
    full ones (the caller's all-reduce over the context-parallel group); None: this rank
    holds whole sequences. Pass several quantities as columns of one [T, k] tensor so that
    they cost one all-reduce.
    """
    if sequence_index.shape != values.shape[:1]:
        raise ValueError(f"sequence_index of shape {tuple(sequence_index.shape)}: expected "
                         f"({values.shape[0]},), one per token of the values {tuple(values.shape)}")
    if num_sequences < 1:
        raise ValueError(f"num_sequences={num_sequences!r}: expected an int >= 1")
    sums = torch.zeros((num_sequences, *values.shape[1:]), dtype=torch.float32, device=values.device)
    sums.index_add_(0, sequence_index, values.detach().float())
    if sum_over_ranks is None:
        return sums
    full = sum_over_ranks(sums)
    if full.shape != sums.shape:
        raise ValueError(f"sum_over_ranks returned shape {tuple(full.shape)}: expected {tuple(sums.shape)}")
    return full


def _sequence_mean(values, loss_mask, sequence_index, num_sequences, sum_over_ranks):
    """[T] fp32, no grad: at each token, the mean of `values` over its sequence's loss tokens
    (0 for a sequence without any)."""
    on = loss_mask > 0
    # Tokens outside the loss may carry any index and any value (inf at prompts, say).
    index = torch.where(on, sequence_index, torch.zeros_like(sequence_index))
    masked = torch.where(on, values.detach(), torch.zeros_like(values))
    sums = sequence_sums(torch.stack([masked, loss_mask.detach().to(masked.dtype)], dim=-1), index, num_sequences,
                         sum_over_ranks)
    return (sums[:, 0] / sums[:, 1].clamp(min=1))[index]


def rollout_mask(old_logprobs, rollout_logprobs, loss_mask, sequence_index, num_sequences, level, low, high,
                 sum_over_ranks=None):
    """Masked importance sampling against the rollout engine (IcePop; verl's rollout
    rejection): [T] fp32 0/1, the loss tokens to keep.

    old_logprobs, rollout_logprobs, loss_mask [T] fp32, sequence_index [T] int64 and
    num_sequences, sum_over_ranks as in `sequence_sums`. With r = p_old / p_rollout:
      off       loss_mask unchanged;
      token     a loss token is kept iff low <= r <= high (NeMo-RL "icepop", TRL "token_mask");
      sequence  a sequence's loss tokens are kept iff the geometric mean of their r,
                exp(mean log r), is in [low, high] (NeMo-RL "seq-mask-tis", verl "seq_mean_k1").
    Multiply it into the policy term's token weights; unlike TIS it drops tokens outright.
    Unlike verl, a token's log r is not bounded to +-20 before the sequence's mean: exp of
    an unbounded mean is inf or 0, outside [low, high], so a sequence holding one infinite
    log r (a -inf rollout log-prob) is dropped, where the bound would let it through.
    """
    if level not in ROLLOUT_MASK_LEVELS:
        raise ValueError(f"level={level!r}: expected one of {ROLLOUT_MASK_LEVELS}")
    if not 0 < low <= high:
        raise ValueError(f"low={low!r}, high={high!r}: expected 0 < low <= high (bounds on p_old / p_rollout)")
    if level == "off":
        return loss_mask
    on = loss_mask > 0
    log_ratio = torch.where(on, old_logprobs - rollout_logprobs, torch.zeros_like(old_logprobs)).detach()
    if level == "sequence":
        log_ratio = _sequence_mean(log_ratio, loss_mask, sequence_index, num_sequences, sum_over_ranks)
    ratio = torch.exp(log_ratio)
    return ((ratio >= low) & (ratio <= high) & on).to(loss_mask.dtype)


def overlong_penalty(response_lengths, max_new_tokens, buffer, penalty):
    """DAPO's soft overlong punishment, a reward to add: response_lengths [N] int64 -> [N] fp32.

    0 up to max_new_tokens - buffer tokens, then linear down to -penalty at max_new_tokens,
    -penalty beyond (DAPO eq. 13; verl's overlong_buffer, TRL's soft overlong punishment).
    buffer 0: off (all zeros).
    """
    if not 0 <= buffer <= max_new_tokens:
        raise ValueError(f"buffer={buffer!r}: expected 0 <= buffer <= max_new_tokens={max_new_tokens!r}")
    if penalty < 0:
        raise ValueError(f"penalty={penalty!r}: expected >= 0 (it is subtracted)")
    if buffer == 0:
        return torch.zeros(response_lengths.shape, dtype=torch.float32, device=response_lengths.device)
    exceed = (response_lengths - (max_new_tokens - buffer)).to(torch.float32)
    return -penalty * (exceed / buffer).clamp(0, 1)


def informative_groups(rewards, group_size):
    """Dynamic sampling's group filter (DAPO): rewards [N] fp32, N in consecutive groups of
    `group_size` -> [N // group_size] bool, True where the group's rewards are not all equal
    (a group of equal rewards has zero advantages: no gradient).
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards of shape {tuple(rewards.shape)}: expected [N]")
    if group_size < 1 or rewards.shape[0] % group_size:
        raise ValueError(f"group_size={group_size}: expected an int >= 1 dividing the {rewards.shape[0]} rewards")
    grouped = rewards.view(-1, group_size)
    # max != min, not std > 0: fp32 std of equal values can come out a hair above 0.
    return grouped.amax(1) != grouped.amin(1)


def k3_kl(logprobs, reference_logprobs):
    """[T] fp32 k3 estimate of KL(policy || reference) per token (verl's "low_var_kl"):
    exp(x) - x - 1 with x = log p_ref - log p, x bounded to +-KL_LOG_RATIO_BOUND and the
    result to +-KL_VALUE_BOUND, both as verl does; >= 0, unbiased inside the bounds,
    gradient through `logprobs` (none where a bound holds)."""
    log_ratio = (reference_logprobs - logprobs).clamp(-KL_LOG_RATIO_BOUND, KL_LOG_RATIO_BOUND)
    return (torch.exp(log_ratio) - log_ratio - 1).clamp(-KL_VALUE_BOUND, KL_VALUE_BOUND)
