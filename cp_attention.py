"""Causal core attention for packed THD batches under context parallelism, without Transformer Engine.

megatron-core's local `DotProductAttention` refuses packed THD input and context
parallelism; only Transformer Engine's attention does both, and it needs CUDA. This
module is a drop-in `core_attention` for megatron's layer spec that does both with
`torch.nn.functional.scaled_dot_product_attention`, so CP and THD run (and are tested)
on any machine, exactly, at a cost that grows with each sequence's length squared.

Layout (the one Transformer Engine expects, and cp_thd.py produces): each sequence is
padded to a multiple of 2*cp, cut into 2*cp chunks, and CP rank r holds chunks r and
2*cp-1-r of every sequence, sequences in order. `packed_seq_params.cu_seqlens_q_padded`
gives the global padded boundaries. A query attends to a key iff both belong to the same
sequence and the key's position is <= the query's. Padding sits at the end of each
sequence, so no real token ever sees a padding key. RoPE was already applied by megatron.

How (`packed_causal_attention`): a rank's queries form "units", runs of consecutive
slots of one sequence that see keys 0..(last query's position): at CP 1 a whole
sequence; at CP > 1 each of its two chunks, the front chunk r seeing chunks 0..r, the
mirrored back chunk 2cp-1-r seeing chunks 0..2cp-1-r. Units of similar key length go
into one bucket: a padded [units, heads, length, head_dim] batch and one SDPA call
(causal for units that start at key 0; else a [units, 1, queries, keys] mask, since the
unit's queries start mid-sequence, and the two kinds in separate buckets). Work per sequence is its length squared over cp (plus bucket
padding: a bucket holds units with at least BUCKET_LENGTH_RATIO of its longest key
length); no tensor spans the whole pack except the gathers in and out.

A shared-prefix pack (cp_thd.pack_shared_prefix, CP 1) has its own units: each group's
prefix (causal), and each member's segment, whose keys are the prefix and then its own
slots (a mask: its first query sits at key position len(prefix)).

Per-sequence SDPA calls and buckets cost about the same on mixed lengths; buckets win on
equal lengths and many short sequences (one call per bucket, not per sequence) and need
no Python loop over sequences. torch's jagged nested-tensor SDPA has no CPU kernel that
takes a causal mask; FlexAttention has no backward on CPU in torch 2.13. The measurements
behind these choices are in docs/BENCHMARKS.md.

Under CP every rank all-gathers the keys and values of the whole pack (keys and values
as one tensor, one collective). A partial exchange would not be cheaper in wall time:
rank 0's back chunk (chunk 2cp-1) sees every chunk of every sequence, so rank 0 needs
every other rank's whole shard, and ranks step together. The gradient of the gathered
keys and values goes back by a reduce-scatter. Both are pairwise exchanges, faster on
gloo than its own collectives (see `_AllGatherSequence`).

Imports torch, megatron-core and cp_thd (the layout).
"""

import bisect
import contextlib
import dataclasses

import torch
import torch.nn.functional as F
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel

from cp_thd import CHUNKS_PER_RANK, SharedPrefixSeqParams, zigzag_gathered_slot

# A bucket holds the units whose key length is at least this fraction of its longest:
# padding costs at most 1/ratio^2 per unit, and lognormal lengths 16..256 take ~10 buckets.
BUCKET_LENGTH_RATIO = 0.8
# Units this short all share one bucket: their padding costs less than another SDPA call.
SHORT_UNIT_KEYS = 32
# Where `shared_prefix_plan` keeps a batch's plan: on its PackedSeqParams, for the next layers.
PLAN_ATTRIBUTE = "_cp_attention_plan"


@dataclasses.dataclass
class Bucket:
    """One padded SDPA batch: `units` rows of `queries` query slots and `keys` key slots.

    mask: bool [units, 1, queries, keys], True = attend; None means causal (CP 1).
    """
    units: int
    queries: int
    keys: int
    mask: torch.Tensor | None


@dataclasses.dataclass
class AttentionPlan:
    """Where every bucket reads its queries and keys and where its outputs go, for one rank.

    query_index [sum units*queries] int64: the local slot each bucket row reads.
    key_index [sum units*keys] int64: the row of the rank-ordered gathered keys it reads.
    output_index [T_local] int64: each local slot's row in the buckets' concatenated outputs.
    query_rows, key_rows: per bucket, units*queries and units*keys (to split the gathers).
    """
    buckets: list
    query_index: torch.Tensor
    key_index: torch.Tensor
    output_index: torch.Tensor
    query_rows: list
    key_rows: list


def attention_plan(seqlens_padded, cp_size, cp_rank, local_tokens):
    """Buckets of causal attention units for CP rank `cp_rank` (see the module docstring).

    seqlens_padded: [B] int64, the layout's padded lengths (multiples of 2*cp_size when
    cp_size > 1); local_tokens: T_local = sum(seqlens_padded) // cp_size.
    One device-to-host sync (the units' lengths, to size the buckets); a Python loop over
    buckets, none over sequences.
    """
    device = seqlens_padded.device
    local_lengths = seqlens_padded // cp_size
    local_starts = torch.cumsum(local_lengths, 0) - local_lengths
    sequences = torch.arange(len(seqlens_padded), device=device)
    if cp_size == 1:
        unit_sequence, unit_start, unit_queries = sequences, local_starts, seqlens_padded
        unit_first_position = torch.zeros_like(seqlens_padded)
    else:
        chunk = seqlens_padded // (CHUNKS_PER_RANK * cp_size)
        mirror = CHUNKS_PER_RANK * cp_size - 1 - cp_rank
        unit_sequence = torch.stack([sequences, sequences], 1).view(-1)
        unit_start = torch.stack([local_starts, local_starts + chunk], 1).view(-1)
        unit_queries = torch.stack([chunk, chunk], 1).view(-1)
        unit_first_position = torch.stack([cp_rank * chunk, mirror * chunk], 1).view(-1)

    def key_slots(units, key_position):
        return zigzag_gathered_slot(seqlens_padded, cp_size, unit_sequence[units, None], key_position, local_tokens)

    return _bucketed_plan(unit_start, unit_queries, unit_first_position, key_slots, local_tokens)


def shared_prefix_plan(packed_seq_params, local_tokens):
    """The buckets of a shared-prefix pack (cp_thd.pack_shared_prefix, CP 1): a unit's keys
    are its context (its group's prefix), then its own slots; its first query sits at key
    position context_length. Computed once per batch and kept on `packed_seq_params`, so
    every layer of a forward shares it."""
    device = packed_seq_params.unit_starts.device
    cached = getattr(packed_seq_params, PLAN_ATTRIBUTE, None)
    if cached is not None and cached[0] == (local_tokens, device):
        return cached[1]
    unit_start, context_start = packed_seq_params.unit_starts, packed_seq_params.context_starts
    context_length = packed_seq_params.context_lengths

    def key_slots(units, key_position):
        length = context_length[units, None]
        return torch.where(key_position < length, context_start[units, None] + key_position,
                           unit_start[units, None] + key_position - length)

    plan = _bucketed_plan(unit_start, packed_seq_params.unit_lengths, context_length, key_slots, local_tokens)
    setattr(packed_seq_params, PLAN_ATTRIBUTE, ((local_tokens, device), plan))
    return plan


def _bucketed_plan(unit_start, unit_queries, unit_first_position, key_slots, local_tokens):
    """Units -> an AttentionPlan. Unit u's queries are the local slots unit_start[u] + j (j <
    unit_queries[u]); its keys are key positions 0 .. unit_first_position[u] + unit_queries[u]
    - 1, at the gathered rows `key_slots(units, key_position)` gives ([n] unit ids, [n, keys]
    positions -> [n, keys] rows); query j sees key positions <= unit_first_position[u] + j.
    Empty units are dropped. Units that start at key position 0 run causal, the others
    (a shared prefix's segments, the zigzag's later chunks) with a mask, and the two kinds
    never share a bucket: padding a segment's few queries to its prefix's many costs more
    than a second SDPA call (docs/BENCHMARKS.md)."""
    device = unit_start.device
    kept = unit_queries > 0
    unit_ids = torch.arange(len(unit_start), device=device)[kept]
    unit_start, unit_queries, unit_first_position = unit_start[kept], unit_queries[kept], unit_first_position[kept]
    # A unit sees keys at positions 0 .. its last query's position.
    unit_keys = unit_first_position + unit_queries

    buckets, query_index, key_index, slots, rows = [], [], [], [], []
    row = 0
    for masked in (False, True):
        of_kind = ((unit_first_position > 0) == masked).nonzero().view(-1)
        order = of_kind[torch.argsort(unit_keys[of_kind], descending=True, stable=True)]
        sorted_keys, sorted_queries = torch.stack([unit_keys[order], unit_queries[order]]).tolist()
        ascending_keys = sorted_keys[::-1]
        start = 0
        while start < len(sorted_keys):
            longest = sorted_keys[start]
            shortest = BUCKET_LENGTH_RATIO * longest if longest > SHORT_UNIT_KEYS else 0
            end = len(sorted_keys) - bisect.bisect_left(ascending_keys, shortest)
            units = order[start:end]
            num_queries, num_keys = max(sorted_queries[start:end]), longest
            # Padding rows repeat the unit's last query / key: always in range, never seen by a
            # real query (keys past its position are masked), and outputs of padding rows are dropped.
            query_offset = torch.minimum(torch.arange(num_queries, device=device), unit_queries[units, None] - 1)
            key_position = torch.minimum(torch.arange(num_keys, device=device), unit_keys[units, None] - 1)
            query_slot = unit_start[units, None] + query_offset
            query_index.append(query_slot.view(-1))
            key_index.append(key_slots(unit_ids[units], key_position).view(-1))
            mask = None
            if masked:
                query_position = unit_first_position[units, None] + query_offset
                mask = (torch.arange(num_keys, device=device) <= query_position[..., None])[:, None]
            real = torch.arange(num_queries, device=device) < unit_queries[units, None]
            slots.append(query_slot[real])
            rows.append(row + torch.arange(len(units) * num_queries, device=device).view(len(units), -1)[real])
            buckets.append(Bucket(units=len(units), queries=num_queries, keys=num_keys, mask=mask))
            start, row = end, row + len(units) * num_queries
    output_index = torch.empty(local_tokens, dtype=torch.int64, device=device).scatter_(0, torch.cat(slots),
                                                                                         torch.cat(rows))
    return AttentionPlan(buckets=buckets, query_index=torch.cat(query_index), key_index=torch.cat(key_index),
                         output_index=output_index, query_rows=[b.units * b.queries for b in buckets],
                         key_rows=[b.units * b.keys for b in buckets])


def packed_causal_attention(query, key, value, seqlens_padded, cp_size=1, cp_rank=0, *, dropout_p=0.0, scale=None,
                            plan=None):
    """Causal attention within each sequence of CP rank `cp_rank`'s share of a packed batch.

    query: [T_local, heads, head_dim], this rank's slots in the zigzag layout.
    key: [cp_size * T_local, groups, head_dim], value: [cp_size * T_local, groups,
      value_head_dim], every rank's slots in rank order (an all-gather; this rank's own at
      cp_size 1). heads is a multiple of groups; the query heads of one group are
      contiguous (megatron's order). value_head_dim may differ from head_dim (MLA).
    seqlens_padded: [B] int64, the layout's padded lengths.
    dropout_p: attention-probability dropout, drawn from the default generator (fork an
      RNG state around the call for reproducibility). scale: None is 1/sqrt(head_dim).
    plan: an `AttentionPlan` to use instead (a shared-prefix pack's; seqlens_padded unused).
    Returns [T_local, heads * value_head_dim] in the query's dtype. Differentiable in all three.
    """
    if plan is None:
        plan = attention_plan(seqlens_padded, cp_size, cp_rank, query.shape[0])
    heads, groups, head_dim, value_head_dim = query.shape[1], key.shape[1], query.shape[2], value.shape[2]
    # One gather per input and one at the end: their backward is one index_add each, not one per bucket.
    queries = query.index_select(0, plan.query_index).split(plan.query_rows)
    keys = key.index_select(0, plan.key_index).split(plan.key_rows)
    values = value.index_select(0, plan.key_index).split(plan.key_rows)
    outputs = []
    for bucket, q, k, v in zip(plan.buckets, queries, keys, values):
        # [units * length, n, d] -> [units, n, length, d]
        q = q.view(bucket.units, bucket.queries, heads, head_dim).transpose(1, 2)
        k = k.view(bucket.units, bucket.keys, groups, head_dim).transpose(1, 2)
        v = v.view(bucket.units, bucket.keys, groups, value_head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bucket.mask, dropout_p=dropout_p,
                                             is_causal=bucket.mask is None, scale=scale,
                                             enable_gqa=heads != groups)
        outputs.append(out.transpose(1, 2).reshape(-1, heads * value_head_dim))
    return torch.cat(outputs).index_select(0, plan.output_index)


class _AllGatherSequence(torch.autograd.Function):
    """Concatenate every CP rank's [T_local, ...] along dim 0, in rank order.

    Backward: every rank's loss used every rank's keys, so the gradient of this rank's
    shard is the sum over ranks of the gradient its slice received: a reduce-scatter.
    Both ways are pairwise exchanges with every other rank (`_exchange`), not gloo's
    all_gather_into_tensor and reduce_scatter_tensor: gloo runs the reduce-scatter as an
    all-reduce of the whole tensor (docs/BENCHMARKS.md has the timings).
    """

    @staticmethod
    def forward(ctx, local, group):
        ctx.group = group
        gathered = local.new_empty((group.size() * local.shape[0], *local.shape[1:]))
        shards = gathered.chunk(group.size())
        shards[group.rank()].copy_(local)
        _exchange(group, [local.contiguous()] * group.size(), shards)
        return gathered

    @staticmethod
    def backward(ctx, grad_gathered):
        group = ctx.group
        pieces = list(grad_gathered.contiguous().chunk(group.size()))
        received = [torch.empty_like(piece) for piece in pieces]
        _exchange(group, pieces, received)
        received[group.rank()] = pieces[group.rank()]
        grad_local = received[0].clone()
        for piece in received[1:]:  # in rank order on every rank
            grad_local += piece
        return grad_local, None


def _exchange(group, outgoing, incoming):
    """Send outgoing[j] to every other rank j of `group` and receive incoming[j] from it, as
    one batch of point-to-point operations. Both lists hold one contiguous tensor per rank."""
    operations = []
    for peer in range(group.size()):
        if peer != group.rank():
            peer_rank = dist.get_global_rank(group, peer)
            operations += [dist.P2POp(dist.isend, outgoing[peer], peer_rank, group),
                           dist.P2POp(dist.irecv, incoming[peer], peer_rank, group)]
    if not operations:  # a group of one
        return
    for request in dist.batch_isend_irecv(operations):
        request.wait()


class ContextParallelTHDAttention(torch.nn.Module):
    """`core_attention` for megatron's layer spec: THD or bshd, any CP size, GQA.

    forward(query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
    packed_seq_params=None):
      THD (packed_seq_params.qkv_format == "thd"): query [T_local, heads, head_dim],
      key [T_local, groups, head_dim], value [T_local, groups, value_head_dim] ->
      [T_local, heads * value_head_dim] (MLA: value heads narrower than query heads).
      bshd (no packed_seq_params, CP 1 only): query [s, b, heads, head_dim], key/value
      [s, b, groups, head_dim], attention_mask None (causal) or bool [b, 1, s, s] with
      True = masked (megatron's convention) -> [s, b, heads * head_dim].
    Same dtype as the inputs.
    """

    # forward.py's shared-prefix layout needs a core attention that reads its units.
    reads_shared_prefix_units = True

    def __init__(self, config, layer_number=None, attn_mask_type=None, attention_type=None,
                 attention_dropout=None, softmax_scale=None, cp_comm_type=None, pg_collection=None,
                 **unused_release_specific):
        super().__init__()
        self.config = config
        self.softmax_scale = softmax_scale
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        cp_group = getattr(pg_collection, "cp", None)
        self.cp_group = cp_group if cp_group is not None else parallel_state.get_context_parallel_group()

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None, **unused_release_specific):
        if attention_bias is not None:
            raise NotImplementedError("ContextParallelTHDAttention does not support attention_bias")
        dropout_p = self.dropout_p if self.training else 0.0
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            return self._thd(query, key, value, packed_seq_params, dropout_p)
        if self.cp_group.size() > 1:
            raise NotImplementedError("ContextParallelTHDAttention supports context parallelism only for "
                                      "packed THD input (packed_seq_params.qkv_format='thd')")
        # [s, b, n, d] -> [b, n, s, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        mask = None if attention_mask is None else ~attention_mask
        out = self._sdpa(q, k, v, mask, dropout_p, is_causal=attention_mask is None)
        return out.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], -1)

    def _thd(self, query, key, value, packed_seq_params, dropout_p):
        cp_size, cp_rank = self.cp_group.size(), self.cp_group.rank()
        shared_prefix = isinstance(packed_seq_params, SharedPrefixSeqParams)
        if shared_prefix and cp_size > 1:
            raise ValueError(f"a shared-prefix pack is a CP 1 layout; this attention runs at CP {cp_size}")
        cu_seqlens_padded = packed_seq_params.cu_seqlens_q_padded
        if cu_seqlens_padded is None:
            cu_seqlens_padded = packed_seq_params.cu_seqlens_q
        seqlens_padded = (cu_seqlens_padded[1:] - cu_seqlens_padded[:-1]).long().to(query.device)
        if cp_size > 1:
            # Keys and values travel as one tensor: one collective each way, not two. Joined
            # along the head dimension: MLA's value heads are narrower than its key heads.
            key_value = _AllGatherSequence.apply(torch.cat([key, value], dim=-1), self.cp_group)
            key, value = key_value.split([key.shape[-1], value.shape[-1]], dim=-1)
        plan = shared_prefix_plan(packed_seq_params, query.shape[0]) if shared_prefix else None
        with tensor_parallel.get_cuda_rng_tracker().fork() if dropout_p else contextlib.nullcontext():
            return packed_causal_attention(query, key, value, seqlens_padded, cp_size, cp_rank, dropout_p=dropout_p,
                                           scale=self.softmax_scale, plan=plan)

    def _sdpa(self, q, k, v, mask, dropout_p, is_causal):
        # Grouped-query attention: megatron orders the query heads of one group contiguously.
        heads_per_group = q.shape[-3] // k.shape[-3]
        if heads_per_group > 1:
            k = k.repeat_interleave(heads_per_group, dim=-3)
            v = v.repeat_interleave(heads_per_group, dim=-3)
        with tensor_parallel.get_cuda_rng_tracker().fork() if dropout_p else contextlib.nullcontext():
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p,
                                                  is_causal=is_causal and mask is None, scale=self.softmax_scale)
