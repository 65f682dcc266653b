"""The policy as the MTP target (mtp_patch's item 9): a vocab-parallel soft cross entropy
against the policy's own detached next-token distribution, and the draft acceptance it
estimates on the way.

With policy targets, MTP depth d at position i learns p = softmax(z[i + d] / T) (z the
main model's logits, rolled like the labels or read at explicit rows) by -sum_v p(v) log
q(v), q the head's distribution at the same temperature, with the vocabulary split over
the tensor-parallel group; sum_v min(p(v), q(v)) per token is the chance that a draft
sampled from the head is accepted.

    with policy_target(temperature):       # around a forward of a model mtp_patch patched
        loss = model(input_ids, ..., labels=labels, loss_mask=loss_mask)
    policy_target_temperature()            # inside mtp_patch's MTP loss: T, or None (the sampled tokens)

Why a context and not an argument: megatron-core's GPTModel.forward hands `_postprocess`,
where mtp_patch computes the MTP loss, only its own fixed parameters (and its decoder
refuses unknown block arguments), so no argument of the caller's reaches the loss. The
caller states the target around its forward; the context belongs to the thread running it
(a contextvars.ContextVar) and ends with the `with` block.

Imports only torch and the standard library.
"""

import contextlib
import contextvars

import torch

# The MTP target of the forward under way: the policy's distribution at this temperature,
# or None for the sampled tokens (megatron's cross entropy).
_POLICY_TEMPERATURE = contextvars.ContextVar("mtp_policy_target_temperature", default=None)


@contextlib.contextmanager
def policy_target(temperature):
    """Within it, the MTP loss of a model patched by mtp_patch learns the policy's detached
    distribution at `temperature` (> 0) instead of the sampled tokens; None: the sampled
    tokens. Nests; the previous target is back when it ends."""
    if temperature is not None and not temperature > 0:
        raise ValueError(f"policy_target({temperature!r}): expected a temperature > 0, or None")
    token = _POLICY_TEMPERATURE.set(temperature)
    try:
        yield
    finally:
        _POLICY_TEMPERATURE.reset(token)


def policy_target_temperature():
    """The temperature of the enclosing `policy_target`, or None (the sampled tokens)."""
    return _POLICY_TEMPERATURE.get()


def soft_depth_loss(temperature, logits_of, hidden_states, depth_targets, roll_tensor, roll_kwargs, tp_group):
    """(each depth's per-token loss in turn, (labels, MTP logits) -> [b, s] ([1, E] with
    explicit targets) fp32: the soft cross entropy against the policy's distribution at
    `temperature`; a list each call appends its tokens' sum_v min(p, q) to). logits_of:
    [s, b, h] -> [s, b, V/tp]; hidden_states [s, b, h]: the trunk's; depth_targets:
    mtp_patch's (rows, labels, weights, policy_rows) per depth."""
    # The policy's distribution is a target, not something the MTP loss may move.
    with torch.no_grad():
        policy_logits = logits_of(hidden_states).float() / temperature
    targets = policy_target_logits(policy_logits, depth_targets, roll_tensor, roll_kwargs)
    overlaps = []

    def soft_cross_entropy(labels, mtp_logits):
        loss, overlap = VocabParallelSoftCrossEntropy.apply(mtp_logits.float() / temperature, next(targets),
                                                            tp_group)
        overlaps.append(overlap.transpose(0, 1))
        return loss.transpose(0, 1)  # [s, b] -> [b, s], as megatron's cross entropy returns it

    return soft_cross_entropy, overlaps


def policy_target_logits(policy_logits, depth_targets, roll_tensor, roll_kwargs):
    """Each depth's target logits in turn (one rolled copy alive at a time). policy_logits
    [s, b, V/tp] fp32, no graph: the main logits / T. Depth d's: rolled d times like the
    labels ([s, b, V/tp]; 0 where the mask rolled in 0), or its policy_rows ([E, 1, V/tp])."""
    rolled = policy_logits
    for _, _, _, policy_rows in depth_targets:
        if policy_rows is not None:
            yield policy_logits.index_select(0, policy_rows)
        else:
            # The roll works on the last dimension, the labels' [b, s] sequence: move it there and back.
            rolled = roll_tensor(rolled.permute(1, 2, 0), **roll_kwargs)[0].permute(2, 0, 1)
            yield rolled


class VocabParallelSoftCrossEntropy(torch.autograd.Function):
    """-sum_v p(v) log q(v) per token, p = softmax(target logits), q = softmax(logits), the
    vocabulary split over the TP group (megatron's vocab_parallel_cross_entropy takes hard
    labels only). logits [..., V/tp] fp32, target_logits [..., V/tp] fp32 (no gradient) ->
    ([...] fp32, the same on every TP rank; d/dlogits = q - p, local to each rank;
    [...] fp32 sum_v min(p(v), q(v)), no gradient).
    """

    @staticmethod
    def forward(ctx, logits, target_logits, group):
        log_q = vocab_parallel_log_softmax(logits, group)
        p = vocab_parallel_log_softmax(target_logits, group).exp_()
        cross_entropy = -(p * log_q).sum(dim=-1)
        q = log_q.exp_()
        loss, overlap = all_reduced(torch.stack([cross_entropy, torch.minimum(p, q).sum(dim=-1)]), group)  # one call
        ctx.save_for_backward(q.sub_(p))
        ctx.mark_non_differentiable(overlap)
        return loss, overlap

    @staticmethod
    def backward(ctx, grad_loss, grad_overlap):
        q_minus_p, = ctx.saved_tensors
        return grad_loss.unsqueeze(-1) * q_minus_p, None, None


def vocab_parallel_log_softmax(logits, group):
    """logits [..., V/tp] -> log-softmax over the whole vocabulary, this rank's shard [..., V/tp]."""
    logits_max = all_reduced(logits.max(dim=-1, keepdim=True).values, group, "MAX")
    shifted = logits - logits_max
    sum_exp = all_reduced(shifted.exp().sum(dim=-1, keepdim=True), group)
    return shifted - sum_exp.log()


def all_reduced(tensor, group, op="SUM"):
    """`tensor` all-reduced over `group` in place, op a torch.distributed.ReduceOp name (a
    no-op outside torch.distributed or at size 1)."""
    if group is not None and torch.distributed.is_initialized() and group.size() > 1:
        torch.distributed.all_reduce(tensor, op=getattr(torch.distributed.ReduceOp, op), group=group)
    return tensor
