"""Gated DeltaNet (Qwen3.5's linear attention) in packed THD batches, on any device.

megatron-core 0.16.1's `GatedDeltaNet` holds the layer's weights and math (input projection
to q, k, v, the output gate z, beta and alpha; a short causal depthwise convolution; the
gated delta rule; a gated RMSNorm; the output projection), but its forward refuses packed
sequences and needs FLA's CUDA kernels. `PackedGatedDeltaNet` keeps its weights, names and
tensor-parallel split, and runs the math in torch (megatron-core's own
`torch_chunk_gated_delta_rule`) with every sequence of `PackedSeqParams.cu_seqlens_q`
starting afresh: the convolution sees zeros before a sequence's first token and the
recurrent state starts at zero. It does this by scattering the packed tokens into one
zero-padded row per sequence ([num_sequences, longest, channels]), running the batched
math, and gathering the rows back: padding sits after each sequence's tokens and both the
convolution and the recurrence are causal, so no real token sees it.

    spec = ModuleSpec(module=PackedGatedDeltaNet, submodules=GatedDeltaNetSubmodules(
        in_proj=ColumnParallelLinear, out_norm=WrappedTorchNorm, out_proj=RowParallelLinear))

Tensor parallelism is megatron's: each rank holds its share of key and value heads (the
input projection's rows [q_r; k_r; v_r; z_r; beta_r; alpha_r], the convolution's
[q_r; k_r; v_r]). Context parallelism is refused: a rank would need the recurrent state
and the last convolution inputs of the ranks before it (megatron-core's own CP variant is
not in 0.16.1). Imports torch and megatron-core only.
"""

import torch
import torch.nn.functional as F
from megatron.core.ssm import gated_delta_net
from megatron.core.ssm.gated_delta_net import GatedDeltaNet, torch_chunk_gated_delta_rule
from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region

# transformers' and FLA's l2norm: x / sqrt(sum(x^2) + eps) over the head dimension.
L2NORM_EPS = 1e-6


def l2norm(x):
    """x [..., head_dim] scaled to unit length along the last dimension (fp32 math, x's dtype)."""
    x32 = x.float()
    return (x32 * torch.rsqrt((x32 * x32).sum(-1, keepdim=True) + L2NORM_EPS)).to(x.dtype)


def sequence_boundaries(packed_seq_params, total):
    """cu_seqlens [num_sequences + 1] (int64) of a packed batch of `total` tokens: the padded
    boundaries where there are any (padding belongs to the sequence before it)."""
    boundaries = packed_seq_params.cu_seqlens_q_padded
    if boundaries is None:
        boundaries = packed_seq_params.cu_seqlens_q
    boundaries = boundaries.to(torch.int64)
    if int(boundaries[0]) != 0 or int(boundaries[-1]) != total:
        raise ValueError(f"cu_seqlens {boundaries.tolist()} do not cover the packed batch of {total} tokens; "
                         f"expected 0 first and {total} last")
    return boundaries


def token_slots(boundaries):
    """(sequence index [T], position in its sequence [T], longest length) for cu_seqlens [n + 1]."""
    lengths = boundaries.diff()
    sequence = torch.repeat_interleave(torch.arange(len(lengths), device=boundaries.device), lengths)
    position = torch.arange(int(boundaries[-1]), device=boundaries.device) - boundaries[sequence]
    return sequence, position, int(lengths.max())


class PackedGatedDeltaNet(GatedDeltaNet):
    """megatron-core's GatedDeltaNet with a torch forward that also takes packed THD batches.

    forward(hidden_states [s, b, hidden], ..., packed_seq_params) -> (output [s, b, hidden],
    bias or None), hidden_states' dtype. With packed_seq_params (b = 1), each sequence of its
    cu_seqlens is mixed on its own; without, each batch row is one sequence.
    """

    def __init__(self, config, submodules, **options):
        if config.context_parallel_size > 1:
            raise ValueError(f"context_parallel_size={config.context_parallel_size}: gated DeltaNet layers need "
                             "the recurrent state and convolution inputs of the ranks before them (no context-"
                             "parallel gated DeltaNet in megatron-core 0.16.1 or here); expected 1")
        # megatron-core refuses to construct the layer without FLA, whose CUDA kernels its
        # forward calls; this forward calls none of them.
        had_fla = gated_delta_net.HAVE_FLA
        gated_delta_net.HAVE_FLA = True
        try:
            super().__init__(config, submodules, **options)
        finally:
            gated_delta_net.HAVE_FLA = had_fla
        # Split by rows over the tensor-parallel ranks, as megatron's own parallel layers
        # mark theirs (megatron-core marks these parallel but names no dimension).
        for param in (self.dt_bias, self.A_log, self.conv1d.weight):
            param.partition_dim, param.partition_stride = 0, 1

    def forward(self, hidden_states, attention_mask=None, key_value_states=None, inference_context=None,
                attention_bias=None, packed_seq_params=None, sequence_len_offset=None, **unused):
        if inference_context is not None:
            raise NotImplementedError("PackedGatedDeltaNet trains and scores; it keeps no inference cache")
        # cp_thd's SharedPrefixSeqParams: its units say which slots attend to which.
        if hasattr(packed_seq_params, "unit_starts"):
            raise NotImplementedError("the shared-prefix layout (cp_thd) shares one prompt between completions "
                                      "through the attention mask; a gated DeltaNet's recurrent state would have "
                                      "to fork at the prompt's end: expected plain packed sequences")
        if packed_seq_params is not None and hidden_states.shape[1] != 1:
            raise ValueError(f"packed THD batch of shape {tuple(hidden_states.shape)}: expected batch size 1")
        projected, _ = self.in_proj(hidden_states)  # [s, b, in_proj_dim / tp]
        if packed_seq_params is None:
            mixed = self._mix(projected.transpose(0, 1)).transpose(0, 1)
        else:
            sequence, position, longest = token_slots(sequence_boundaries(packed_seq_params, projected.shape[0]))
            rows = projected.new_zeros(int(sequence.max()) + 1, longest, projected.shape[-1])
            rows[sequence, position] = projected[:, 0]
            mixed = self._mix(rows)[sequence, position][:, None]
        return self.out_proj(mixed.contiguous())

    def _mix(self, projected):
        """The gated DeltaNet on rows that each hold one sequence from its start:
        projected [n, L, in_proj_dim / tp] -> [n, L, v_dim / tp]."""
        batch, length, _ = projected.shape
        tp = self.tp_size
        qkv, gate, beta, alpha = torch.split(
            projected, [(2 * self.qk_dim + self.v_dim) // tp, self.v_dim // tp, self.num_value_heads // tp,
                        self.num_value_heads // tp], dim=-1)
        # Causal depthwise convolution: conv1d pads kernel-1 zeros at both ends; the first
        # L outputs see only a row's own tokens and the zeros before them.
        qkv = self.act_fn(self.conv1d(qkv.transpose(1, 2))[..., :length]).transpose(1, 2)
        query, key, value = torch.split(qkv, [self.qk_dim // tp, self.qk_dim // tp, self.v_dim // tp], dim=-1)
        query = l2norm(query.reshape(batch, length, -1, self.key_head_dim))
        key = l2norm(key.reshape(batch, length, -1, self.key_head_dim))
        value = value.reshape(batch, length, -1, self.value_head_dim)
        repeat = self.num_value_heads // self.num_key_heads
        if repeat > 1:
            query, key = query.repeat_interleave(repeat, dim=2), key.repeat_interleave(repeat, dim=2)
        g = -self.A_log.float().exp() * F.softplus(alpha.float() + self.dt_bias)
        core, _ = torch_chunk_gated_delta_rule(query, key, value, g=g, beta=beta.sigmoid(),
                                               use_qk_l2norm_in_kernel=False)
        return self._gated_norm(core, gate.reshape(batch, length, -1, self.value_head_dim))

    def _gated_norm(self, core, gate):
        """RMSNorm of each value head times silu(gate): core, gate [..., heads, v_head_dim] ->
        [..., heads * v_head_dim] (megatron's `_apply_gated_norm`, without the torch.compile
        it is wrapped in, which would need a compiler on a CPU)."""
        # Every tensor-parallel rank scales its own heads by the one norm weight: the weight's
        # gradient on a rank is a partial sum over its heads. Identity forward, the sum over
        # the TP group backward (megatron-core's finalize_model_grads sums no such weight).
        weight = copy_to_tensor_model_parallel_region(self.out_norm.weight, group=self.pg_collection.tp)
        x = core.float()
        normed = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.out_norm.eps)).to(core.dtype) * weight
        return (normed * self.act_fn(gate.float())).to(core.dtype).flatten(-2)
