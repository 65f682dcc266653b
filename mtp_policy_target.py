"""The policy as the MTP target (mtp_patch's item 9): a vocab-parallel loss against the
policy's own detached next-token distribution (a soft cross entropy, or the total
variation), and the draft acceptance it estimates on the way.

With policy targets, MTP depth d at position i learns p = softmax(z[i + d] / T) (z the
main model's logits, rolled like the labels or read at explicit rows), q the head's
distribution at the same temperature, with the vocabulary split over the tensor-parallel
group, by one of POLICY_TARGET_LOSSES:
- "ce": the soft cross entropy -sum_v p(v) log q(v);
- "tv": the total variation 0.5 sum_v |p(v) - q(v)| = 1 - sum_v min(p(v), q(v)), one
  minus the very acceptance below, plus a small cross-entropy anchor
  (TV_CROSS_ENTROPY_ANCHOR, `VocabParallelTotalVariation` says why).
sum_v min(p(v), q(v)) per token is the chance that a draft sampled from the head is
accepted.

    with policy_target(temperature, loss="ce"):   # around a forward of a model mtp_patch patched
        loss = model(input_ids, ..., labels=labels, loss_mask=loss_mask)
    policy_target_temperature()            # inside mtp_patch's MTP loss: T, or None (the sampled tokens)
    policy_target_loss()                   # and which loss: "ce" or "tv"

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

# The losses an MTP head can learn the policy's distribution by (the module docstring's list).
POLICY_TARGET_LOSSES = ("ce", "tv")
# The weight of the soft cross entropy inside the "tv" loss (`VocabParallelTotalVariation`).
TV_CROSS_ENTROPY_ANCHOR = 0.1

# The MTP target of the forward under way: (the temperature of the policy's distribution,
# or None for the sampled tokens (megatron's cross entropy); the loss against it).
_POLICY_TARGET = contextvars.ContextVar("mtp_policy_target", default=(None, "ce"))


@contextlib.contextmanager
def policy_target(temperature, loss="ce"):
    """Within it, the MTP loss of a model patched by mtp_patch learns the policy's detached
    distribution at `temperature` (> 0) by `loss` (one of POLICY_TARGET_LOSSES) instead of
    the sampled tokens; None: the sampled tokens. Nests; the previous target is back when
    it ends."""
    if temperature is not None and not temperature > 0:
        raise ValueError(f"policy_target({temperature!r}): expected a temperature > 0, or None")
    if loss not in POLICY_TARGET_LOSSES:
        raise ValueError(f"policy_target(loss={loss!r}): expected one of {POLICY_TARGET_LOSSES}")
    token = _POLICY_TARGET.set((temperature, loss))
    try:
        yield
    finally:
        _POLICY_TARGET.reset(token)


def policy_target_temperature():
    """The temperature of the enclosing `policy_target`, or None (the sampled tokens)."""
    return _POLICY_TARGET.get()[0]


def policy_target_loss():
    """The loss of the enclosing `policy_target` against the policy's distribution: one of
    POLICY_TARGET_LOSSES ("ce" outside any)."""
    return _POLICY_TARGET.get()[1]


def soft_depth_loss(temperature, loss, logits_of, hidden_states, depth_targets, roll_tensor, roll_kwargs, tp_group):
    """(each depth's per-token loss in turn, (labels, MTP logits) -> [b, s] ([1, E] with
    explicit targets) fp32: `loss` (one of POLICY_TARGET_LOSSES) against the policy's
    distribution at `temperature`; a list each call appends its tokens' sum_v min(p, q)
    to). logits_of: [s, b, h] -> [s, b, V/tp]; hidden_states [s, b, h]: the trunk's;
    depth_targets: mtp_patch's (rows, labels, weights, policy_rows) per depth."""
    # The policy's distribution is a target, not something the MTP loss may move.
    with torch.no_grad():
        policy_logits = logits_of(hidden_states).float() / temperature
    targets = policy_target_logits(policy_logits, depth_targets, roll_tensor, roll_kwargs)
    loss_function = POLICY_TARGET_LOSS_FUNCTIONS[loss]
    overlaps = []

    def policy_loss(labels, mtp_logits):
        token_loss, overlap = loss_function.apply(mtp_logits.float() / temperature, next(targets), tp_group)
        overlaps.append(overlap.transpose(0, 1))
        return token_loss.transpose(0, 1)  # [s, b] -> [b, s], as megatron's cross entropy returns it

    return policy_loss, overlaps


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
        p, q, cross_entropy = policy_and_head(logits, target_logits, group)
        loss, overlap = all_reduced(torch.stack([cross_entropy, torch.minimum(p, q).sum(dim=-1)]), group)  # one call
        ctx.save_for_backward(q.sub_(p))
        ctx.mark_non_differentiable(overlap)
        return loss, overlap

    @staticmethod
    def backward(ctx, grad_loss, grad_overlap):
        q_minus_p, = ctx.saved_tensors
        return grad_loss.unsqueeze(-1) * q_minus_p, None, None


class VocabParallelTotalVariation(torch.autograd.Function):
    """0.5 sum_v |p(v) - q(v)| + TV_CROSS_ENTROPY_ANCHOR x (-sum_v p(v) log q(v)) per token,
    p = softmax(target logits), q = softmax(logits), the vocabulary split over the TP group.
    logits [..., V/tp] fp32, target_logits [..., V/tp] fp32 (no gradient) -> ([...] fp32,
    the same on every TP rank; [...] fp32 sum_v min(p(v), q(v)), no gradient), as
    `VocabParallelSoftCrossEntropy`.

    The total variation is 1 - sum_v min(p, q): one minus the chance that a draft sampled
    from the head is accepted, so minimising it maximises acceptance directly. It is summed
    as 0.5 sum_v |p - q|, which keeps its precision where the acceptance is near 1. Its
    gradient, u_v = 1 where q_v < p_v (a token the head under-proposes), 0 where q_v > p_v:
        d/dz_j = -q_j (u_j - sum_v u_v q_v),
    the sum over the whole vocabulary (all-reduced). At a tie q_v == p_v, |p - q| has no
    derivative; u_v = 1/2 there, the mean of the two one-sided ones (torch's sign(0) = 0,
    so autograd of 0.5 * |p - q|.sum() agrees everywhere), neither side favoured. Ties are
    rare in floating point but for a head equal to the policy, whose gradient is 0 with
    any choice.

    Why the anchor: the total variation's gradient on each logit is in proportion to the
    head's own q, not to p. A head far from the policy (a cold head: q near uniform over a
    large vocabulary, or its mass off p's support) gets gradients of order 1/V or of the
    little mass it has on p's support, and they push every under-proposed token alike, p's
    long tail as hard as its mode (LK losses, arXiv 2602.23881: pure TV from scratch trains
    poorly). The soft cross entropy's gradient q - p has neither fault. At weight
    TV_CROSS_ENTROPY_ANCHOR it steers a far head and fades near the policy (q - p -> 0) while the total variation's
    gradient does not (q_j (u_j - ...) stays of the order of q_j), so near the optimum the
    total variation decides. Both are least at q = p: the anchor moves only a head that
    cannot match p, towards covering it. (test_mtp_policy_target_adam_steps_... shows a
    random head on a sharp policy: its acceptance rises about 2.5 times as far in 6 steps
    with the anchor as without.)
    """

    @staticmethod
    def forward(ctx, logits, target_logits, group):
        p, q, cross_entropy = policy_and_head(logits, target_logits, group)
        under = torch.sign(q - p).neg_().add_(1).mul_(0.5)  # u: 1 where q < p, 0 where q > p, 1/2 at a tie
        sums = torch.stack([0.5 * (p - q).abs().sum(dim=-1), torch.minimum(p, q).sum(dim=-1),
                            (under * q).sum(dim=-1), cross_entropy])
        total_variation, overlap, under_mass, cross_entropy = all_reduced(sums, group)  # one call
        gradient = q * (under_mass.unsqueeze(-1) - under)
        gradient.add_(q.sub_(p), alpha=TV_CROSS_ENTROPY_ANCHOR)
        ctx.save_for_backward(gradient)
        ctx.mark_non_differentiable(overlap)
        return total_variation + TV_CROSS_ENTROPY_ANCHOR * cross_entropy, overlap

    @staticmethod
    def backward(ctx, grad_loss, grad_overlap):
        gradient, = ctx.saved_tensors
        return grad_loss.unsqueeze(-1) * gradient, None, None


# The autograd function of each of POLICY_TARGET_LOSSES.
POLICY_TARGET_LOSS_FUNCTIONS = {"ce": VocabParallelSoftCrossEntropy, "tv": VocabParallelTotalVariation}


def policy_and_head(logits, target_logits, group):
    """(p = softmax(target_logits), q = softmax(logits): this rank's shards [..., V/tp], the
    softmax over the whole vocabulary; -sum_v p(v) log q(v) over this rank's shard [...],
    to be all-reduced)."""
    log_q = vocab_parallel_log_softmax(logits, group)
    p = vocab_parallel_log_softmax(target_logits, group).exp_()
    cross_entropy = -(p * log_q).sum(dim=-1)
    return p, log_q.exp_(), cross_entropy


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
