"""Megatron forward for RL: per-token log-probs and entropy of packed sequences under TP and CP.

One call runs a megatron-core `GPTModel` on a batch of variable-length sequences
(concatenated ids + lengths) and returns, for every token, the log-probability of the
token that follows it in its sequence, and optionally the entropy of that next-token
distribution, both at the sampling temperature (logits / temperature, so they match what
the rollout sampler saw).

    out = forward_logprobs(model, input_ids, seqlens, temperature=1.0, with_entropy=True, mtp_train=True)
    loss = -(out.logprobs * out.batch.pack(advantages)).sum() / num_tokens   # CP-local shard
    loss.backward()                                                          # MTP loss rides along

How it stays right and cheap:
- Packing is `cp_thd.pack_thd`: zigzag THD layout across context-parallel ranks. With
  `prefix_group_size` (GRPO groups, CP 1) it is `cp_thd.pack_shared_prefix`: each group's
  prompt once, every rotary embedding reading the tokens' own positions (megatron would
  number the pack's slots), as many prompt tokens shared as leave every output unchanged;
  its MTP targets go to the model explicitly (mtp_patch's MTP_TARGETS_ATTRIBUTE), as one
  shared slot predicts each member's own next tokens.
- `mtp_target="policy"` has the MTP head learn the policy's own next-token distribution at
  the sampling temperature instead of the sampled tokens, by `mtp_policy_loss` (soft cross
  entropy or total variation; mtp_patch's item 9: the forward runs inside
  `mtp_policy_target.policy_target(temperature, loss)`, which the MTP loss reads).
- `position_ids` reach the model only when MTP training is on. Megatron computes RoPE
  positions for THD itself from `packed_seq_params`; its MTP layers roll `input_ids` and
  `position_ids` and crash on `None`. (A vision model, which computes its own positions,
  would not get them either; this module serves GPTModel.)
- With MTP training on, labels and the loss mask are passed, so megatron builds the MTP
  loss (attached to the graph, it rides on the backward pass); off, they are not, and a
  model patched by mtp_patch.py skips its MTP layers.
- The main-model logits are taken from the output layer's forward (vocab-parallel shard,
  [s, b, vocab/tp]); log-probs come from megatron's vocab-parallel cross entropy and
  entropy from a vocab-parallel reduction: no rank ever holds the full vocabulary.

Imports torch, megatron-core, cp_thd, mtp_patch and mtp_policy_target.
"""

import contextlib
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel

from cp_thd import ThdBatch, pack_shared_prefix, pack_thd
from mtp_patch import MTP_TARGETS_ATTRIBUTE, mtp_depths, patched
from mtp_policy_target import POLICY_TARGET_LOSSES, policy_target

# What the MTP head learns (`forward_logprobs`' mtp_target): the sampled next tokens, or the
# policy's next-token distribution (soft targets).
MTP_TARGET_MODES = ("sampled", "policy")


@dataclass
class ForwardOutput:
    """Per-token results, in the CP-local slot layout of `batch` unless gathered.

    logprobs [T] fp32: log p(next token | prefix) at the temperature; 0 where `loss_mask` is 0.
    entropy [T] fp32 or None: entropy of the next-token distribution at the temperature.
    loss_mask [T] fp32: 1 for real tokens that have a next token in their sequence.
    mtp_loss: fp32 scalar tensor (detached), this rank's MTP loss summed over MTP depths
      (summed over CP ranks: the batch's), from `model.mtp_losses` which mtp_patch.py sets;
      None when MTP training is off or the model is not patched.
    mtp_acceptance: fp32 scalar tensor (detached) or None: with policy targets
      (`mtp_target="policy"`), this rank's share of the first MTP layer's mean sum_v
      min(p(v), q(v)) (summed over CP ranks: the batch's), the chance a draft sampled from
      the head is accepted (`model.mtp_acceptance`); None otherwise.
    batch: the `ThdBatch` (or `SharedPrefixBatch`) the model ran on (use `batch.pack` for
      advantages, old log-probs).
    routing_agreement [T_local] fp32 or None: with `routed_experts` and no replay, 1 where
      Megatron routed the token to the same experts as the rollout engine in every MoE
      layer, 0 where not, and -1 where the rollout's routing is unknown (padding, last tokens).
    T is T_local (this CP rank's slots) or T_total (input order) when gathered.
    """
    logprobs: torch.Tensor
    entropy: Optional[torch.Tensor]
    loss_mask: torch.Tensor
    mtp_loss: Optional[torch.Tensor]
    batch: ThdBatch
    routing_agreement: Optional[torch.Tensor] = None
    mtp_acceptance: Optional[torch.Tensor] = None


def next_token_labels(input_ids, seqlens):
    """labels[i] = input_ids[i + 1] within a sequence; the last token of each sequence gets
    label 0 and mask 0. input_ids [T] int, seqlens [B] int -> (labels [T] int64, mask [T] fp32)."""
    labels = torch.roll(input_ids, -1).long()
    last_token = torch.cumsum(seqlens.to(input_ids.device), 0) - 1
    mask = torch.ones(input_ids.shape[0], dtype=torch.float32, device=input_ids.device)
    mask[last_token] = 0.0
    labels[last_token] = 0
    return labels, mask


class _VocabParallelEntropy(torch.autograd.Function):
    """Entropy of softmax(logits) where the vocabulary is split over the TP group.

    Forward all-reduces max, sum(exp) and sum(p * z) over the group; backward is local:
    dH/dz_i = p_i * (E_p[z] - z_i). (A differentiable all-reduce would multiply the
    gradient by the TP size, because every rank backpropagates the same entropy.)
    """

    @staticmethod
    def forward(ctx, logits, group):
        logits_max = logits.max(dim=-1, keepdim=True).values
        dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - logits_max
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1, keepdim=True)
        dist.all_reduce(sum_exp, group=group)
        probs = exp / sum_exp
        expected_logit = (probs * shifted).sum(dim=-1, keepdim=True)
        dist.all_reduce(expected_logit, group=group)
        ctx.save_for_backward(probs, shifted, expected_logit)
        return (sum_exp.log() - expected_logit).squeeze(-1)

    @staticmethod
    def backward(ctx, grad_entropy):
        probs, shifted, expected_logit = ctx.saved_tensors
        return grad_entropy.unsqueeze(-1) * probs * (expected_logit - shifted), None


def vocab_parallel_entropy(logits, group=None):
    """logits [..., vocab/tp] (any float dtype) -> entropy [...] in the logits' dtype."""
    group = group if group is not None else parallel_state.get_tensor_model_parallel_group()
    return _VocabParallelEntropy.apply(logits, group)


def forward_logprobs(model, input_ids, seqlens, *, loss_mask=None, temperature=1.0, with_entropy=False,
                     mtp_train=False, mtp_target="sampled", mtp_policy_loss="ce", gather=False, pad_id=0,
                     pad_multiple=1, routed_experts=None, replay_routing=False, prefix_group_size=None):
    """Run `model` on packed sequences; return per-token next-token log-probs (and entropy).

    model: megatron-core GPTModel (post_process=True), built with THD-capable attention.
    input_ids: [T_total] int tensor, the sequences concatenated; seqlens: [B] int, each >= 1.
    loss_mask: optional [T_total] (0/1): loss_mask[i] says whether the prediction made at
      token i (of token i + 1) counts, e.g. 1 where token i + 1 is a response token. It is
      also the MTP loss mask. Combined with "token i has a next token in its sequence".
    temperature: logits are divided by it before log-softmax (the sampler's temperature).
    with_entropy: also return the next-token entropy (vocab-parallel, differentiable).
    mtp_train: pass packed position ids so the MTP layers can roll them; megatron then
      attaches the MTP loss to the graph. Off: position_ids=None (megatron derives RoPE
      positions from packed_seq_params).
    mtp_target: with mtp_train, what the MTP head learns: "sampled", the token that follows,
      or "policy", the policy's own distribution there at `temperature` (mtp_patch.py's).
    mtp_policy_loss: with policy targets, the loss against the policy's distribution (one of
      mtp_policy_target.POLICY_TARGET_LOSSES): "ce", the soft cross entropy, or "tv", the
      total variation, one minus the sampled draft's acceptance.
    gather: return [T_total] tensors in input order (all-gathered over the CP group; for
      logging) instead of this CP rank's [T_local] slots (for a loss computed on the shard).
    routed_experts: optional [T_total, moe_layers, top_k] int, the experts the rollout
      engine routed each token to in each MoE layer of the main model (-1: unknown). With
      `replay_routing` the model's routers use them (rollout routing replay); without, they
      route on their own and `routing_agreement` says where they agree. Needs a model
      built with `moe_enable_routing_replay` (megatron_model.py sets it for MoE models).
    prefix_group_size: G, when each G consecutive sequences may share a prefix (GRPO's
      completions of one prompt): each group's common prefix runs once (cp_thd's
      shared-prefix layout; CP 1, no sequence parallel, pad_multiple 1, and a core attention
      that reads it: cp_attention's; with mtp_train, megatron patched by mtp_patch.py).
      Same outputs as without, on fewer tokens (`shared_prefix_lengths`).
    Returns `ForwardOutput`. Gradients flow from logprobs/entropy into the model.
    """
    if temperature <= 0:
        raise ValueError(f"temperature={temperature}; expected > 0")
    _check_mtp_target(mtp_target, mtp_policy_loss, mtp_train)
    cp_group = parallel_state.get_context_parallel_group()
    seqlens = torch.as_tensor(seqlens, device=input_ids.device)
    labels, loss_mask = _labels_and_loss_mask(input_ids, seqlens, loss_mask)
    shared = prefix_group_size is not None
    batch = _packed_batch(model, input_ids, seqlens, loss_mask, cp_group, pad_id=pad_id, pad_multiple=pad_multiple,
                          prefix_group_size=prefix_group_size, mtp_train=mtp_train)
    local_labels = batch.pack(labels)
    local_mask = batch.pack(loss_mask)

    rope = _rope_at_positions(model, batch.position_ids) if shared else contextlib.nullcontext()
    mtp_target_context = policy_target(temperature if mtp_train and mtp_target == "policy" else None,
                                       loss=mtp_policy_loss)
    with _rollout_routing(model, batch, routed_experts, replay_routing) as routing, rope, mtp_target_context:
        logits = _main_logits(model, batch, local_labels, local_mask, mtp_train).float() / temperature
    entropy, logprobs = _entropy_and_logprobs(logits, local_labels, local_mask, with_entropy)

    mtp_losses = getattr(model, "mtp_losses", None) if mtp_train else None
    mtp_loss = mtp_losses.sum() if mtp_losses is not None else None
    mtp_acceptance = getattr(model, "mtp_acceptance", None) if mtp_train else None

    if gather:
        logprobs = batch.unpack(logprobs, cp_group=cp_group)
        entropy = batch.unpack(entropy, cp_group=cp_group) if entropy is not None else None
        local_mask = loss_mask
    return ForwardOutput(logprobs=logprobs, entropy=entropy, loss_mask=local_mask, mtp_loss=mtp_loss, batch=batch,
                         routing_agreement=routing.get("agreement"),
                         mtp_acceptance=None if mtp_acceptance is None else mtp_acceptance[0])


def forward_stage(model, input_ids, seqlens, *, mtp_train=False, pad_id=0, pad_multiple=1):
    """A pipeline stage before the last: this stage's output hidden states [s, 1, hidden]
    (s: this CP rank's packed slots, over TP under sequence parallelism) for the packed
    sequences, `forward_logprobs`' layout (pack_thd; input_ids [T_total] int, seqlens [B]
    int), from the previous stage's hidden states (megatron's `set_input_tensor`) or, on
    the first stage, the embedding. The last stage runs `forward_logprobs` on the same batch."""
    cp_group = parallel_state.get_context_parallel_group()
    seqlens = torch.as_tensor(seqlens, device=input_ids.device)
    batch = _packed_batch(model, input_ids, seqlens, None, cp_group, pad_id=pad_id, pad_multiple=pad_multiple,
                          prefix_group_size=None, mtp_train=mtp_train)
    return model(input_ids=batch.input_ids[None], position_ids=batch.position_ids[None] if mtp_train else None,
                 attention_mask=None, packed_seq_params=batch.packed_seq_params)


def _check_mtp_target(mtp_target, mtp_policy_loss, mtp_train):
    """Refuse an MTP target that is not one of MTP_TARGET_MODES, a loss against the policy
    that is not one of POLICY_TARGET_LOSSES, or policy targets that the model's MTP loss
    would not read (megatron-core unpatched: it would train on the sampled tokens without a
    word)."""
    if mtp_target not in MTP_TARGET_MODES:
        raise ValueError(f"mtp_target={mtp_target!r}; expected one of {MTP_TARGET_MODES}")
    if mtp_policy_loss not in POLICY_TARGET_LOSSES:
        raise ValueError(f"mtp_policy_loss={mtp_policy_loss!r}; expected one of {POLICY_TARGET_LOSSES}")
    if mtp_train and mtp_target == "policy" and not patched():
        raise ValueError("mtp_target='policy' on an unpatched megatron-core: call mtp_patch.patch_megatron_mtp() "
                         "(its MTP loss reads the policy target)")


def _labels_and_loss_mask(input_ids, seqlens, loss_mask):
    """`next_token_labels`, with the caller's optional `loss_mask` [T_total] (0/1) folded into
    the next-token mask: (labels [T_total] int64, loss_mask [T_total] fp32)."""
    labels, next_token_mask = next_token_labels(input_ids, seqlens)
    if loss_mask is not None:
        if loss_mask.shape != input_ids.shape:
            raise ValueError(f"loss_mask has shape {tuple(loss_mask.shape)}; expected {tuple(input_ids.shape)} "
                             "like input_ids")
        next_token_mask = next_token_mask * loss_mask.to(next_token_mask)
    return labels, next_token_mask


def _packed_batch(model, input_ids, seqlens, loss_mask, cp_group, *, pad_id, pad_multiple, prefix_group_size,
                  mtp_train):
    """The layout the model runs on: cp_thd's zigzag THD pack of this CP rank (`ThdBatch`),
    or with `prefix_group_size` its shared-prefix pack (`SharedPrefixBatch`), after refusing
    what that cannot run; with MTP training its explicit MTP targets ride on its
    packed_seq_params. loss_mask [T_total] fp32 is the next-token mask."""
    config = model.config
    if prefix_group_size is None:
        return pack_thd(input_ids, seqlens, cp_size=cp_group.size(), cp_rank=cp_group.rank(),
                        tp_size=config.tensor_model_parallel_size, sequence_parallel=config.sequence_parallel,
                        pad_multiple=pad_multiple, pad_id=pad_id)
    mtp_depth = mtp_depths(model) if mtp_train else 0
    _check_shared_prefix_layout(model, cp_group.size(), pad_multiple, prefix_group_size, len(seqlens), mtp_depth)
    shared_lengths = shared_prefix_lengths(input_ids, seqlens, loss_mask, prefix_group_size, mtp_depth)
    batch = pack_shared_prefix(input_ids, seqlens, group_size=prefix_group_size, shared_lengths=shared_lengths)
    if mtp_depth:
        setattr(batch.packed_seq_params, MTP_TARGETS_ATTRIBUTE,
                mtp_targets(batch.slot_of_token, input_ids, seqlens, loss_mask, mtp_depth))
    return batch


def _entropy_and_logprobs(logits, local_labels, local_mask, with_entropy):
    """logits [T_local, vocab/tp] fp32 (consumed) -> (entropy [T_local] or None, log-probs of
    `local_labels` [T_local] times `local_mask`)."""
    # Entropy first: megatron's vocab-parallel cross entropy overwrites its input in place.
    entropy = vocab_parallel_entropy(logits) if with_entropy else None
    logprobs = -tensor_parallel.vocab_parallel_cross_entropy(logits[:, None], local_labels[:, None])[:, 0]
    return entropy, logprobs * local_mask


def shared_prefix_lengths(input_ids, seqlens, loss_mask, group_size, mtp_depth):
    """How many leading tokens each group of `group_size` consecutive sequences stores once
    (cp_thd.pack_shared_prefix) with every output the same as unshared: [B // group_size] int64.

    input_ids [T_total] int, seqlens [B] int64, loss_mask [T_total] fp32 (the next-token
    mask: > 0 where a prediction is in the loss), mtp_depth: MTP layers trained (0: none).
    A stored-once token t of group g must read the same inputs in every member and carry
    no main loss: the main output at t reads tokens 0..t, MTP layer d reads token t + d
    (the pack's roll takes it from the next slot, the first member's: stored, so t + d <
    shortest - 1), and the main loss at t predicts t + 1. The MTP outputs at t may predict
    each member's own tokens: their targets go to the model explicitly (`mtp_targets`). So
    S_g = min(common_prefix - mtp_depth, first_loss, shortest - 1 - mtp_depth), at least 0.
    """
    num_groups = len(seqlens) // group_size
    starts = torch.cumsum(seqlens, 0) - seqlens
    longest = int(seqlens.max())
    position = torch.arange(longest, device=input_ids.device)
    valid = position < seqlens[:, None]
    token = (starts[:, None] + position).clamp(max=len(input_ids) - 1)
    ids = torch.where(valid, input_ids[token], -1).view(num_groups, group_size, longest)
    common = ((ids == ids[:, :1]) & valid.view(ids.shape)).all(dim=1)
    common_prefix = common.long().cumprod(dim=1).sum(dim=1)
    in_loss = (valid & (loss_mask[token] > 0)).view(ids.shape).any(dim=1)
    shortest = seqlens.view(num_groups, group_size).min(dim=1).values
    first_loss = torch.where(in_loss.any(dim=1), in_loss.long().argmax(dim=1), shortest)
    return torch.minimum(torch.minimum(common_prefix - mtp_depth, first_loss), shortest - 1 - mtp_depth).clamp(min=0)


def mtp_targets(slot_of_token, input_ids, seqlens, loss_mask, mtp_depth):
    """The MTP targets of a shared-prefix pack, for mtp_patch (MTP_TARGETS_ATTRIBUTE): per
    depth d in 1..mtp_depth, (rows [E] int64, labels [E] int64, weights [E] fp32,
    policy_rows [E] int64).

    slot_of_token [T_total] int64 (`SharedPrefixBatch.slot_of_token`), input_ids [T_total],
    seqlens [B], loss_mask [T_total] (the next-token mask). Token i's depth-d output
    predicts token i + d + 1 of its sequence, weighted by the main mask at i + d (what
    megatron's roll of labels and mask gives within a sequence); it sits at i's slot, so a
    slot the members of a group share carries each member's target. The main output that
    predicts the same token i + d + 1 sits at the slot of token i + d (policy_rows: where
    the policy target of mtp_target="policy" is read).
    """
    total = len(input_ids)
    token = torch.arange(total, device=input_ids.device)
    starts = torch.cumsum(seqlens, 0) - seqlens
    # Tokens from each one to the end of its sequence, itself included.
    remaining = torch.repeat_interleave(starts + seqlens, seqlens) - token
    targets = []
    for depth in range(1, mtp_depth + 1):
        weights = torch.where(remaining > depth + 1, loss_mask[(token + depth).clamp(max=total - 1)], 0.0)
        counted = weights > 0
        targets.append((slot_of_token[counted], input_ids[token[counted] + depth + 1].long(), weights[counted].float(),
                        slot_of_token[token[counted] + depth]))
    return targets


def _check_shared_prefix_layout(model, cp_size, pad_multiple, group_size, num_sequences, mtp_depth):
    """Refuse a shared-prefix forward the layout, the model's attention or megatron's MTP loss cannot run."""
    problems = []
    if mtp_depth and not patched():
        problems.append("MTP training on an unpatched megatron-core (call mtp_patch.patch_megatron_mtp(): its MTP "
                        "loss takes the layout's explicit targets)")
    if cp_size > 1:
        problems.append(f"context parallel size {cp_size} (the layout is CP 1)")
    if model.config.sequence_parallel:
        problems.append("sequence parallel")
    if pad_multiple != 1:
        problems.append(f"pad_multiple={pad_multiple}")
    if not isinstance(group_size, int) or group_size < 1 or num_sequences % group_size:
        problems.append(f"prefix_group_size={group_size!r} for {num_sequences} sequences (expected an integer "
                        "that divides them)")
    attentions = {type(module).__name__ for name, module in model.named_modules() if name.endswith("core_attention")
                  and not getattr(module, "reads_shared_prefix_units", False)}
    if attentions:
        problems.append(f"core attention {sorted(attentions)} (it must read the pack's units: cp_attention's does)")
    if problems:
        raise ValueError(f"prefix_group_size needs the shared-prefix layout, which cannot run with {'; '.join(problems)}")


@contextlib.contextmanager
def _rope_at_positions(model, position_ids):
    """Inside: every rotary embedding of `model` returns one row of frequencies per slot, at
    `position_ids` ([T] int64). Megatron then applies RoPE slot by slot (its THD path does
    when the rows match the pack's tokens), so a segment continues its prefix's positions."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    rotaries = [module for module in model.modules() if isinstance(module, RotaryEmbedding)]
    longest = int(position_ids.max()) + 1

    def at_positions(original):
        def forward(max_seq_len, *args, **kwargs):
            frequencies = original(longest, *args, **kwargs)
            if isinstance(frequencies, tuple):  # YaRN: (frequencies, mscale)
                return (frequencies[0].index_select(0, position_ids), *frequencies[1:])
            return frequencies.index_select(0, position_ids)
        return forward

    for rotary in rotaries:
        rotary.forward = at_positions(rotary.forward)
    try:
        yield
    finally:
        for rotary in rotaries:
            del rotary.forward


def main_model_routers(model):
    """The main model's MoE routers in layer order (the MTP layers' route on their own:
    their loss is not the policy's)."""
    return [module for name, module in model.named_modules()
            if name.startswith("decoder.") and getattr(module, "router_replay", None) is not None]


@contextlib.contextmanager
def _rollout_routing(model, batch, routed_experts, replay):
    """Inside: the main model's routers replay `routed_experts` ([T_total, layers, k]) or
    record their own top-k; after: {"agreement": [T_local] per `ForwardOutput`} when
    recorded. Rows the rollout does not know (-1) and padding replay experts 0..k-1: their
    outputs feed no loss. Under sequence parallelism each TP rank routes its slice of the
    pack (megatron scatters the sequence over the TP group); the agreement is gathered."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction
    result = {}
    routers = main_model_routers(model) if routed_experts is not None else []
    if not routers:
        yield result
        return
    if routed_experts.shape[1] != len(routers):
        raise ValueError(f"routed_experts has {routed_experts.shape[1]} MoE layers; the model has {len(routers)}")
    local = batch.pack(routed_experts.long(), pad_value=-1)
    sequence_parallel = model.config.sequence_parallel
    if sequence_parallel:
        tp_group = parallel_state.get_tensor_model_parallel_group()
        local = local.chunk(tp_group.size())[tp_group.rank()]
    known = (local >= 0).all(dim=-1)
    filled = torch.where(known[..., None], local, torch.arange(local.shape[-1], device=local.device))
    for layer, router in enumerate(routers):
        router.router_replay.clear_indices()
        if replay:
            router.router_replay.set_target_indices(filled[:, layer])
        router.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD if replay
                                                      else RouterReplayAction.RECORD)
    try:
        yield result
        if not replay:
            own = torch.stack([router.router_replay.get_recorded_indices() for router in routers], dim=1)
            same = (own.sort(dim=-1).values == local.sort(dim=-1).values).all(dim=-1).all(dim=-1)
            agreement = torch.where(known.all(dim=-1), same.float(), torch.full_like(same, -1.0, dtype=torch.float))
            if sequence_parallel:
                agreement = tensor_parallel.gather_from_sequence_parallel_region(agreement)
            result["agreement"] = agreement
    finally:
        for router in routers:
            router.router_replay.clear_router_replay_action()
            router.router_replay.clear_indices()


def output_layer_logits(model, clone, **inputs):
    """The main model's logits [s, b, vocab/tp] (the model's dtype), taken from the output
    layer's forward while `model(**inputs)` runs. `clone`: the rest of the forward gets a
    copy of them (with labels, megatron's cross entropy works on its input in place)."""
    captured = []

    def keep_logits(module, args, output):
        # The output layer runs once per MTP layer (and once more for an MTP policy target),
        # then once for the main model: the last capture is the main one, and only the
        # latest is kept, so that no other logits outlive their use. With labels, megatron's
        # own cross entropy then works on these logits in place; hand it a copy and keep
        # the original.
        logits, bias = output
        captured[:] = [logits]
        return (logits.clone(), bias) if clone else output

    hook = model.output_layer.register_forward_hook(keep_logits)
    try:
        model(**inputs)
    finally:
        hook.remove()
    return captured[-1]


def _main_logits(model, batch, local_labels, local_mask, mtp_train):
    """[T_local, vocab/tp] logits of the main model (with MTP training on the model's
    forward also builds the MTP loss)."""
    # Labels only serve the MTP loss (log-probs are computed by the caller): without them
    # a patched model skips its MTP layers (see mtp_patch.py; megatron <= 0.16 needs it).
    return output_layer_logits(model, clone=mtp_train,
                               input_ids=batch.input_ids[None],
                               position_ids=batch.position_ids[None] if mtp_train else None,
                               attention_mask=None,
                               labels=local_labels[None] if mtp_train else None,
                               loss_mask=local_mask[None] if mtp_train else None,
                               packed_seq_params=batch.packed_seq_params)[:, 0]
