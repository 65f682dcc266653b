"""Causal core attention for packed THD batches under context parallelism, without Transformer Engine.

megatron-core's local `DotProductAttention` refuses packed THD input and context
parallelism; only Transformer Engine's attention does both, and it needs CUDA. This
module is a drop-in `core_attention` for megatron's layer spec that does both with
`torch.nn.functional.scaled_dot_product_attention`, so CP and THD run (and are tested)
on any machine. It is exact, not fast: every rank all-gathers the keys and values of the
whole packed batch and masks.

Layout (the one Transformer Engine expects, and cp_thd.py produces): each sequence is
padded to a multiple of 2*cp, cut into 2*cp chunks, and CP rank r holds chunks r and
2*cp-1-r of every sequence, sequences in order. `packed_seq_params.cu_seqlens_q_padded`
gives the global padded boundaries. A query attends to a key iff both belong to the same
sequence and the key's position is <= the query's. Padding sits at the end of each
sequence, so no real token ever sees a padding key. RoPE was already applied by megatron.

Imports torch, megatron-core and cp_thd (the layout).
"""

import contextlib

import torch
import torch.nn.functional as F
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel

from cp_thd import zigzag_slot_positions


class _AllGatherSequence(torch.autograd.Function):
    """Concatenate every CP rank's [T_local, ...] along dim 0, in rank order.

    Backward: every rank's loss used every rank's keys, so the gradient of this rank's
    shard is the sum over ranks of the gradient its slice received (all-reduce, slice).
    """

    @staticmethod
    def forward(ctx, local, group):
        ctx.group, ctx.rank, ctx.local_tokens = group, group.rank(), local.shape[0]
        shards = [torch.empty_like(local) for _ in range(group.size())]
        dist.all_gather(shards, local.contiguous(), group=group)
        return torch.cat(shards, dim=0)

    @staticmethod
    def backward(ctx, grad_gathered):
        grad_gathered = grad_gathered.contiguous()
        dist.all_reduce(grad_gathered, group=ctx.group)
        start = ctx.rank * ctx.local_tokens
        return grad_gathered[start:start + ctx.local_tokens], None


class ContextParallelTHDAttention(torch.nn.Module):
    """`core_attention` for megatron's layer spec: THD or bshd, any CP size, GQA.

    forward(query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
    packed_seq_params=None):
      THD (packed_seq_params.qkv_format == "thd"): query [T_local, heads, head_dim],
      key/value [T_local, groups, head_dim] -> [T_local, heads * head_dim].
      bshd (no packed_seq_params, CP 1 only): query [s, b, heads, head_dim], key/value
      [s, b, groups, head_dim], attention_mask None (causal) or bool [b, 1, s, s] with
      True = masked (megatron's convention) -> [s, b, heads * head_dim].
    Same dtype as the inputs.
    """

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
        cu_seqlens_padded = packed_seq_params.cu_seqlens_q_padded
        if cu_seqlens_padded is None:
            cu_seqlens_padded = packed_seq_params.cu_seqlens_q
        seqlens_padded = (cu_seqlens_padded[1:] - cu_seqlens_padded[:-1]).long()
        query_sequence, query_position = zigzag_slot_positions(seqlens_padded, cp_size, cp_rank)
        if cp_size > 1:
            key = _AllGatherSequence.apply(key, self.cp_group)
            value = _AllGatherSequence.apply(value, self.cp_group)
            slots = [zigzag_slot_positions(seqlens_padded, cp_size, rank) for rank in range(cp_size)]
            key_sequence = torch.cat([sequence for sequence, _ in slots])
            key_position = torch.cat([position for _, position in slots])
        else:
            key_sequence, key_position = query_sequence, query_position
        mask = (query_sequence[:, None] == key_sequence[None, :]) & (key_position[None, :] <= query_position[:, None])
        # [t, n, d] -> [n, t, d]: heads act as the batch of SDPA.
        q, k, v = (t.transpose(0, 1) for t in (query, key, value))
        out = self._sdpa(q, k, v, mask, dropout_p, is_causal=False)
        return out.transpose(0, 1).reshape(query.shape[0], -1)

    def _sdpa(self, q, k, v, mask, dropout_p, is_causal):
        # Grouped-query attention: megatron orders the query heads of one group contiguously.
        heads_per_group = q.shape[-3] // k.shape[-3]
        if heads_per_group > 1:
            k = k.repeat_interleave(heads_per_group, dim=-3)
            v = v.repeat_interleave(heads_per_group, dim=-3)
        with tensor_parallel.get_cuda_rng_tracker().fork() if dropout_p else contextlib.nullcontext():
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p,
                                                  is_causal=is_causal and mask is None, scale=self.softmax_scale)
