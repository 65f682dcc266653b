"""Packed (THD) batches split across context-parallel ranks, with exact position ids.

A THD batch concatenates variable-length sequences with no padding between them
(`cu_seqlens` marks the boundaries). Under context parallelism (CP) of size `cp`, each
sequence is padded to a multiple of `2*cp`, cut into `2*cp` equal chunks, and rank `r`
keeps chunks `r` and `2*cp-1-r` of every sequence, sequences in order ("zigzag": with a
causal mask, an early chunk and a late chunk together cost every rank the same work).
This is the layout Transformer Engine's THD context-parallel attention expects.

    batch = pack_thd(input_ids, seqlens, cp_size=4, cp_rank=rank)
    labels = batch.pack(all_labels)              # any per-token tensor, same layout
    logprobs = batch.unpack(local_logprobs, cp_group)   # back to [T_total, ...]
    shared = pack_shared_prefix(input_ids, seqlens, group_size=8, shared_lengths=lengths)  # GRPO groups, CP 1

Every slot of the local layout is computed from its place in its padded sequence, so
position ids are right for every rank by construction: a real token's position is its
index in its own sequence; a padding slot gets `seqlen - 1` (a valid position of the same
sequence, so rotary tables and MTP never see an out-of-range value). The whole batch is a
handful of tensor ops on the input's device with a single device-to-host sync, no Python
loop over sequences.

`pack_shared_prefix` is the other layout (CP 1): a GRPO group's completions share their
prompt, so each group's common prefix is stored once, then each completion's remaining
tokens ("segments"); a segment attends to its group's prefix and causally to itself
(cp_attention reads the units from `SharedPrefixSeqParams`), every token keeps its own
position. The same values as the per-sequence layout, on fewer tokens.

Imports only torch, the standard library and megatron-core's `PackedSeqParams`.
"""

import dataclasses
import math

import torch
import torch.distributed as dist
from megatron.core.packed_seq_params import PackedSeqParams

# Each CP rank holds two chunks of every sequence: one from the front, its mirror from the back.
CHUNKS_PER_RANK = 2
PADDING_INDEX = -1
INTEGER_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


def pack_thd(input_ids, seqlens, *, cp_size=1, cp_rank=0, tp_size=1, sequence_parallel=False, pad_multiple=1,
             pad_id=0):
    """Pad, split and lay out a packed batch for context-parallel rank `cp_rank`.

    Args:
        input_ids: [T_total] integer tensor, the B sequences concatenated.
        seqlens: [B] integer tensor or list, each >= 1, summing to T_total.
        cp_size, cp_rank: context-parallel size and this rank's place in it.
        tp_size, sequence_parallel: sequence parallel over tp > 1 ranks needs T_local % tp == 0.
        pad_multiple, pad_id: every padded length is also a multiple of pad_multiple (8 for
            FP8 kernels); padding slots hold token pad_id.

    Returns a `ThdBatch` of T_local = sum(seqlens_padded) // cp_size tokens. Every padded
    length is the smallest multiple of lcm(2*cp_size if cp_size > 1 else 1, pad_multiple)
    that holds the sequence, except the last one, which grows by as few of those multiples
    as make the total divide by tp*cp (sequence parallel only): never more padding than
    aligning every sequence to tp*cp*2 (and pad_multiple), the usual rule.
    """
    _check_layout(cp_size, cp_rank, tp_size, pad_multiple)
    seqlens = _checked_seqlens(input_ids, seqlens)
    seqlens_padded = _padded_lengths(seqlens, cp_size, tp_size if sequence_parallel else 1, pad_multiple)

    # The local layout is 2B runs of consecutive slots (two chunks per sequence; at cp 1 the
    # sequence's two halves). Within a run, position = slot + a per-run constant, and so is
    # the input index; padding (positions past the sequence's length) is a run's tail.
    run_lengths, position_minus_slot = _zigzag_runs(seqlens_padded, cp_size, cp_rank)
    sequence_starts = torch.cumsum(seqlens, 0) - seqlens
    # Both runs of a sequence share its length and start.
    run_seqlens, run_sequence_starts = (torch.stack([v, v], 1).view(-1) for v in (seqlens, sequence_starts))
    run_starts = torch.cumsum(run_lengths, 0) - run_lengths
    run_padding = (run_starts + run_lengths + position_minus_slot - run_seqlens).clamp_(min=0).minimum(run_lengths)
    # The one device-to-host sync: checks the lengths and sizes the outputs together.
    shortest, total, total_padded, longest_padded, local_padding = torch.stack(
        [seqlens.min(), seqlens.sum(), seqlens_padded.sum(), seqlens_padded.max(), run_padding.sum()]).tolist()
    if shortest < 1:
        first_bad = int(torch.nonzero(seqlens < 1)[0])
        raise ValueError(f"seqlens[{first_bad}] = {int(seqlens[first_bad])}: every sequence length must be >= 1")
    _check_total(total, input_ids)
    local_tokens = total_padded // cp_size

    # Two passes each (a fill and a cumsum) give every slot its position and input index as
    # if no slot were padding; one gather reads the ids. The few padding slots (at most
    # 2*cp-1 per sequence, plus the tp top-up) are then overwritten in place: at memory
    # speed, with no per-slot masks (a masked write costs several passes on CPU).
    position_ids = _slot_plus_run_value(run_lengths, position_minus_slot, local_tokens)
    index = _slot_plus_run_value(run_lengths, run_sequence_starts + position_minus_slot, local_tokens)
    padding_run = _run_of_each_slot(run_padding, local_padding)
    padding_slot = _slot_plus_run_value(run_padding, run_starts + run_lengths - run_padding
                                        - (torch.cumsum(run_padding, 0) - run_padding), local_padding)
    # Padding reads its sequence's last token and position: always in range.
    last_position = (run_seqlens - 1).index_select(0, padding_run)
    position_ids.index_copy_(0, padding_slot, last_position)
    index.index_copy_(0, padding_slot, last_position + run_sequence_starts.index_select(0, padding_run))
    local_input_ids = input_ids.index_select(0, index).index_fill_(0, padding_slot, pad_id)
    index.index_fill_(0, padding_slot, PADDING_INDEX)
    return ThdBatch(input_ids=local_input_ids, position_ids=position_ids, index=index, seqlens=seqlens,
                    seqlens_padded=seqlens_padded, packed_seq_params=_packed_seq_params(seqlens_padded, longest_padded),
                    cp_size=cp_size, cp_rank=cp_rank, num_tokens=total)


def _checked_seqlens(input_ids, seqlens):
    """`seqlens` as [B] int64 on input_ids' device, after the shape and dtype checks."""
    _check_integer_tensor("input_ids", input_ids)
    if input_ids.dim() != 1:
        raise ValueError(f"input_ids must be 1-D [T_total] (the sequences concatenated), "
                         f"got shape {tuple(input_ids.shape)}")
    seqlens = torch.as_tensor(seqlens, device=input_ids.device)
    if seqlens.dim() != 1 or len(seqlens) == 0:
        raise ValueError(f"seqlens must be 1-D [B] with B >= 1 sequence lengths, got shape {tuple(seqlens.shape)}")
    _check_integer_tensor("seqlens", seqlens)
    return seqlens.to(torch.int64)


def _padded_lengths(seqlens, cp_size, sequence_parallel_size, pad_multiple):
    """[B] int64: each length up to a multiple of lcm(2*cp or 1, pad_multiple), the last one
    topped up so that the local token count divides by the sequence-parallel size."""
    multiple = math.lcm(CHUNKS_PER_RANK * cp_size if cp_size > 1 else 1, pad_multiple)
    seqlens_padded = (seqlens + multiple - 1) // multiple * multiple
    if sequence_parallel_size > 1:
        # T_local = total / cp must divide by tp, i.e. total by tp*cp. Both the total and
        # this target are multiples of `multiple`, so the top-up keeps the last sequence
        # splittable into 2*cp chunks.
        total_multiple = math.lcm(multiple, sequence_parallel_size * cp_size)
        seqlens_padded[-1] += (-seqlens_padded.sum()) % total_multiple
    return seqlens_padded


def _packed_seq_params(seqlens_padded, longest_padded):
    """megatron-core's PackedSeqParams ("thd") of the padded layout.

    cu_seqlens_q/kv are the *padded* boundaries too, for two reasons:
    - megatron's MTP `roll_tensor` (packed path) cuts the local tensor at
      cu_seqlens_q // cp_size; only the padded boundaries, multiples of 2*cp, land on the
      local sequence starts. Real boundaries would roll tokens across sequences.
    - Transformer Engine reads cu_seqlens as "tokens that take part in attention" and
      cu_seqlens_padded as "where each sequence sits in memory". Padding sits at the end
      of each sequence and the mask is causal, so no real token ever attends to a padding
      slot: treating padding as tokens leaves every real output exact. Equal tensors also
      mean "no padding between sequences" to TE, which keeps every attention backend
      (FlashAttention included) eligible. Real lengths stay in `ThdBatch.seqlens`.
    """
    cu_seqlens_padded = torch.nn.functional.pad(torch.cumsum(seqlens_padded, 0), (1, 0)).to(torch.int32)
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu_seqlens_padded, cu_seqlens_kv=cu_seqlens_padded,
        cu_seqlens_q_padded=cu_seqlens_padded, cu_seqlens_kv_padded=cu_seqlens_padded,
        max_seqlen_q=longest_padded, max_seqlen_kv=longest_padded,
    )


@dataclasses.dataclass
class ThdBatch:
    """One CP rank's share of a packed batch (T_local slots) and how to map values in and out.

    input_ids [T_local] (input dtype), position_ids [T_local] int64, index [T_local] int64
    (the input position of the token each slot holds, -1 for padding), seqlens and
    seqlens_padded [B] int64, packed_seq_params (megatron-core, "thd"), and the layout:
    cp_size, cp_rank, num_tokens (T_total).
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    index: torch.Tensor
    seqlens: torch.Tensor
    seqlens_padded: torch.Tensor
    packed_seq_params: PackedSeqParams
    cp_size: int
    cp_rank: int
    num_tokens: int

    def pack(self, values, pad_value=0):
        """[T_total, ...] -> [T_local, ...], laid out like `input_ids`; padding slots hold `pad_value`."""
        if values.dim() == 0 or values.shape[0] != self.num_tokens:
            raise ValueError(f"values must be [T_total={self.num_tokens}, ...] (one row per input token), "
                             f"got shape {tuple(values.shape)}")
        is_padding = (self.index < 0).view(-1, *[1] * (values.dim() - 1))
        return values.index_select(0, self.index.clamp(min=0)).masked_fill(is_padding, pad_value)

    def merge_shards(self, shards):
        """Every rank's [T_local, ...] shard, in rank order -> [T_total, ...] (padding dropped).

        The inverse of `pack` when all shards are at hand (after your own gather, or in
        one process); `unpack` gathers them for you. Gradients flow to every shard.
        """
        local_tokens = self.index.shape[0]
        if len(shards) != self.cp_size or any(shard.shape[:1] != (local_tokens,) for shard in shards):
            raise ValueError(f"expected {self.cp_size} shards of [T_local={local_tokens}, ...], got shapes "
                             f"{[tuple(shard.shape) for shard in shards]}")
        return torch.cat(list(shards)).index_select(0, self._slot_of_each_token())

    def unpack(self, local, cp_group=None):
        """This rank's [T_local, ...] -> [T_total, ...], gathering the other ranks' shards.

        A collective over `cp_group` (None: the default group) when cp_size > 1. Gradients
        flow to this rank's own shard only: the gathered copies are constants, so each
        rank computing the same loss on the full tensor gets the gradient for its own
        tokens, once, with no backward communication.
        """
        if local.dim() == 0 or local.shape[0] != self.index.shape[0]:
            raise ValueError(f"local must be [T_local={self.index.shape[0]}, ...], got shape {tuple(local.shape)}")
        if self.cp_size == 1:
            return self.merge_shards([local])
        if not dist.is_initialized():
            raise ValueError(f"unpack with cp_size={self.cp_size} gathers over torch.distributed, which is not "
                             f"initialised; with every shard at hand use merge_shards")
        group_size, group_rank = dist.get_world_size(cp_group), dist.get_rank(cp_group)
        if (group_size, group_rank) != (self.cp_size, self.cp_rank):
            raise ValueError(f"cp_group has size {group_size} and this process is its rank {group_rank}, but the "
                             f"batch was packed for cp_size={self.cp_size}, cp_rank={self.cp_rank}")
        sent = local.detach().contiguous()
        shards = [torch.empty_like(sent) for _ in range(self.cp_size)]
        dist.all_gather(shards, sent, group=cp_group)
        shards[self.cp_rank] = local
        return self.merge_shards(shards)

    def _slot_of_each_token(self):
        """[T_total] int64: for each input token, its slot in the rank-ordered concatenation of all shards."""
        sequence = _run_of_each_slot(self.seqlens, self.num_tokens)
        token = torch.arange(self.num_tokens, device=sequence.device)
        position = token - (torch.cumsum(self.seqlens, 0) - self.seqlens).index_select(0, sequence)
        return zigzag_gathered_slot(self.seqlens_padded, self.cp_size, sequence, position, self.index.shape[0])


def _zigzag_runs(seqlens_padded, cp_size, cp_rank):
    """CP rank `cp_rank`'s share of each sequence as two runs of consecutive slots: chunk
    cp_rank, then chunk 2*cp-1-cp_rank (at cp_size 1: the sequence's two halves, in order).

    seqlens_padded: [B] int64, each a multiple of 2*cp_size (any length at cp_size 1).
    Returns (run_lengths [2B] int64, position_minus_slot [2B] int64): within a run, a slot's
    padded position in its sequence is slot + position_minus_slot.
    """
    chunk = seqlens_padded // (CHUNKS_PER_RANK * cp_size)
    mirror = CHUNKS_PER_RANK * cp_size - 1 - cp_rank
    run_lengths = torch.stack([chunk, seqlens_padded // cp_size - chunk], 1).view(-1)
    run_starts = torch.cumsum(run_lengths, 0) - run_lengths
    position_minus_slot = torch.stack([cp_rank * chunk, mirror * chunk], 1).view(-1) - run_starts
    return run_lengths, position_minus_slot


def zigzag_gathered_slot(seqlens_padded, cp_size, sequence, position, local_tokens=None):
    """Where padded position `position` of sequence `sequence` sits once every rank's shard is
    concatenated in rank order (an all-gather of [T_local, ...] shards along dim 0).

    seqlens_padded: [B] int64 (the layout's); sequence, position: int64 tensors of one shape,
    0 <= position < seqlens_padded[sequence]. Returns int64 of that shape, in
    [0, cp_size * T_local).
    `local_tokens` (T_local) spares the device-to-host sync when the caller knows it.
    """
    if local_tokens is None:
        local_tokens = int(seqlens_padded.sum()) // cp_size
    local_lengths = seqlens_padded // cp_size
    local_start = (torch.cumsum(local_lengths, 0) - local_lengths)[sequence]
    if cp_size == 1:
        return local_start + position
    chunk = (seqlens_padded // (CHUNKS_PER_RANK * cp_size))[sequence]
    chunk_id, within_chunk = position // chunk, position % chunk
    in_front_half = chunk_id < cp_size
    rank = torch.where(in_front_half, chunk_id, CHUNKS_PER_RANK * cp_size - 1 - chunk_id)
    offset = torch.where(in_front_half, within_chunk, chunk + within_chunk)
    return rank * local_tokens + local_start + offset


def _slot_plus_run_value(run_lengths, run_values, total):
    """[total] int64: slot + run_values[run], for `total` = sum(run_lengths) consecutive
    slots, each in its run.

    One fill and one cumsum: ones (the slope), plus at each run's first slot the step from
    the previous run's value (an empty run's step lands on the slot it shares with the next
    run, and the steps add up). No per-slot run id, no gather.
    """
    run_starts = torch.cumsum(run_lengths, 0) - run_lengths
    steps = torch.diff(run_values, prepend=run_values.new_zeros(1))
    increments = torch.ones(total + 1, dtype=torch.int64, device=run_lengths.device)
    increments[0] = 0  # the cumsum counts slots from 0
    increments.index_add_(0, run_starts, steps)
    return increments[:total].cumsum_(0)


def _run_of_each_slot(run_lengths, total):
    """[total] int64: the run each of `total` = sum(run_lengths) consecutive slots belongs to.

    The count of run ends at or before each slot: a cumsum over end markers (an empty run
    puts its marker on the same slot as the one before it, so it is skipped). Same as
    `repeat_interleave(arange(R), run_lengths)`, whose CPU kernel starts threads even for a
    handful of elements: a fixed cost per call, larger than the work itself on a busy machine.
    """
    ends = torch.cumsum(run_lengths, 0)
    markers = torch.zeros(total + 1, dtype=torch.int64, device=run_lengths.device)
    markers.index_add_(0, ends, torch.ones_like(ends))
    return markers[:total].cumsum_(0)


def _check_layout(cp_size, cp_rank, tp_size, pad_multiple):
    for name, value in (("cp_size", cp_size), ("tp_size", tp_size), ("pad_multiple", pad_multiple)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} = {value!r}: expected an integer >= 1")
    if not isinstance(cp_rank, int) or not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank = {cp_rank!r}: expected an integer in [0, cp_size={cp_size})")


def _check_total(total, input_ids):
    if total != input_ids.numel():
        raise ValueError(f"seqlens sum to {total} but input_ids holds {input_ids.numel()} tokens: "
                         f"expected the lengths of the concatenated sequences")


def _check_integer_tensor(name, tensor):
    if not isinstance(tensor, torch.Tensor) or tensor.dtype not in INTEGER_DTYPES:
        kind = tensor.dtype if isinstance(tensor, torch.Tensor) else type(tensor).__name__
        raise ValueError(f"{name} must be an integer tensor, got {kind}")


# ---------------------------------------------------------------------------------------
# Shared-prefix layout (CP 1): each group's common prefix once, then its members' segments
# ---------------------------------------------------------------------------------------

@dataclasses.dataclass
class SharedPrefixSeqParams(PackedSeqParams):
    """megatron-core's PackedSeqParams of a shared-prefix pack, and its attention units.

    To megatron the pack is one sequence (cu_seqlens [0, T_pack]): its MTP roll takes each
    slot's next slot, and RoPE must read per-token frequencies at `ThdBatch`-style
    position ids (forward.py hands megatron those). The attention reads the units: unit u
    is the slots [unit_starts[u], unit_starts[u] + unit_lengths[u]); they see the slots
    [context_starts[u], + context_lengths[u]) (the group's shared prefix; none for the
    prefix itself), then each other causally. All [units] int64.
    """
    unit_starts: torch.Tensor = None
    unit_lengths: torch.Tensor = None
    context_starts: torch.Tensor = None
    context_lengths: torch.Tensor = None


def pack_shared_prefix(input_ids, seqlens, *, group_size, shared_lengths):
    """Lay out groups of `group_size` consecutive sequences with each group's first tokens once.

    Args:
        input_ids: [T_total] integer tensor, the B sequences concatenated.
        seqlens: [B] integer tensor or list, each >= 1; B a multiple of group_size.
        group_size: sequences per group (GRPO's completions of one prompt).
        shared_lengths: [B // group_size] integer tensor: S_g, how many leading tokens every
            member of group g has in common and stores once (0 <= S_g < each member's length).
            The caller checks they are common (forward.py's `shared_prefix_lengths`): this
            layout stores member 0's.

    Each group is laid out as its prefix (tokens [0, S_g) of member 0), then each member's
    segment: its tokens [S_g, length - 1). A sequence's last token is not stored: nothing
    reads its outputs (it has no next token to predict) and its id only feeds outputs that
    predict past the end; callers take labels from the whole sequences. Returns a
    `SharedPrefixBatch`: `pack` and `unpack` map per-token values as `ThdBatch`'s do
    (unpack gives each member the prefix's values, and 0 at its last token).
    """
    seqlens = _checked_seqlens(input_ids, seqlens)
    device = input_ids.device
    shared_lengths, shared_per_sequence, total = _checked_shared_lengths(input_ids, seqlens, group_size,
                                                                         shared_lengths)
    num_groups = len(seqlens) // group_size

    # Runs of consecutive slots, per group: its prefix, then each member's segment.
    sequence_starts = torch.cumsum(seqlens, 0) - seqlens
    segment_lengths = seqlens - 1 - shared_per_sequence
    run_lengths = torch.cat([shared_lengths[:, None], segment_lengths.view(num_groups, group_size)], 1).view(-1)
    run_sources = torch.cat([sequence_starts[::group_size, None],
                             (sequence_starts + shared_per_sequence).view(num_groups, group_size)], 1).view(-1)
    run_first_positions = torch.cat([torch.zeros_like(shared_lengths)[:, None],
                                     shared_per_sequence.view(num_groups, group_size)], 1).view(-1)
    run_starts = torch.cumsum(run_lengths, 0) - run_lengths
    packed_tokens = int(run_lengths.sum())
    index = _slot_plus_run_value(run_lengths, run_sources - run_starts, packed_tokens)
    position_ids = _slot_plus_run_value(run_lengths, run_first_positions - run_starts, packed_tokens)

    prefix_starts = run_starts[::group_size + 1]
    slot = _shared_prefix_slot_of_token(seqlens, sequence_starts, shared_per_sequence, run_starts, group_size,
                                        total)

    boundaries = torch.tensor([0, packed_tokens], dtype=torch.int32, device=device)
    params = SharedPrefixSeqParams(
        qkv_format="thd", cu_seqlens_q=boundaries, cu_seqlens_kv=boundaries, cu_seqlens_q_padded=boundaries,
        cu_seqlens_kv_padded=boundaries, max_seqlen_q=packed_tokens, max_seqlen_kv=packed_tokens,
        unit_starts=run_starts, unit_lengths=run_lengths,
        # A segment's context is its group's prefix, which starts at the position it does.
        context_starts=prefix_starts.repeat_interleave(group_size + 1), context_lengths=run_first_positions)
    return SharedPrefixBatch(input_ids=input_ids.index_select(0, index), position_ids=position_ids, index=index,
                             slot_of_token=slot, packed_seq_params=params, num_tokens=total)


def _checked_shared_lengths(input_ids, seqlens, group_size, shared_lengths):
    """(shared_lengths [G] int64, the same per sequence [B] int64, T_total), after checking
    `group_size` and `shared_lengths` against `seqlens` [B] int64 (one device-to-host sync)."""
    if not isinstance(group_size, int) or group_size < 1 or len(seqlens) % group_size:
        raise ValueError(f"group_size = {group_size!r}: expected an integer >= 1 that divides the "
                         f"{len(seqlens)} sequences")
    num_groups = len(seqlens) // group_size
    shared_lengths = torch.as_tensor(shared_lengths, device=input_ids.device)
    _check_integer_tensor("shared_lengths", shared_lengths)
    if shared_lengths.shape != (num_groups,):
        raise ValueError(f"shared_lengths has shape {tuple(shared_lengths.shape)}; expected ({num_groups},), one "
                         f"per group of {group_size} sequences")
    shared_lengths = shared_lengths.long()
    shared_per_sequence = shared_lengths.repeat_interleave(group_size)
    total, shortest, too_long = torch.stack([seqlens.sum(), seqlens.min(),
                                             (shared_per_sequence >= seqlens).sum() + (shared_lengths < 0).sum()]
                                            ).tolist()
    _check_total(total, input_ids)
    if shortest < 1 or too_long:
        raise ValueError(f"shared_lengths {shared_lengths.tolist()} with seqlens {seqlens.tolist()}: every "
                         "sequence length must be >= 1 and every shared length in [0, each member's length)")
    return shared_lengths, shared_per_sequence, total


def _shared_prefix_slot_of_token(seqlens, sequence_starts, shared_per_sequence, run_starts, group_size, total):
    """[T_total] int64: where each input token's values live in the pack: its group's prefix,
    its segment, or nowhere (PADDING_INDEX: a sequence's last token, which is not stored).

    seqlens, sequence_starts, shared_per_sequence: [B] int64; run_starts: [G * (group_size +
    1)] int64, the first slot of each group's prefix, then of each member's segment."""
    prefix_starts = run_starts[::group_size + 1]
    segment_starts = run_starts.view(-1, group_size + 1)[:, 1:].reshape(-1)
    sequence = _run_of_each_slot(seqlens, total)
    position = torch.arange(total, device=seqlens.device) - sequence_starts.index_select(0, sequence)
    shared = shared_per_sequence.index_select(0, sequence)
    slot = torch.where(position < shared, prefix_starts.repeat_interleave(group_size).index_select(0, sequence),
                       segment_starts.index_select(0, sequence) - shared) + position
    return torch.where(position == seqlens.index_select(0, sequence) - 1, torch.full_like(slot, PADDING_INDEX), slot)


@dataclasses.dataclass
class SharedPrefixBatch:
    """A shared-prefix pack (`pack_shared_prefix`): T_pack slots, CP 1.

    input_ids [T_pack] (input dtype), position_ids [T_pack] int64 (each token's position in
    its own sequence), index [T_pack] int64 (the input token each slot holds),
    slot_of_token [T_total] int64 (each input token's slot, -1 for a sequence's last
    token, which is not stored), packed_seq_params (`SharedPrefixSeqParams`), num_tokens
    (T_total).
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    index: torch.Tensor
    slot_of_token: torch.Tensor
    packed_seq_params: SharedPrefixSeqParams
    num_tokens: int
    cp_size: int = 1
    cp_rank: int = 0

    def pack(self, values, pad_value=0):
        """[T_total, ...] -> [T_pack, ...]: each slot the value of the token it holds (a prefix
        slot: member 0's). `pad_value` is unused (no slot is padding); kept for ThdBatch's call."""
        if values.dim() == 0 or values.shape[0] != self.num_tokens:
            raise ValueError(f"values must be [T_total={self.num_tokens}, ...] (one row per input token), "
                             f"got shape {tuple(values.shape)}")
        return values.index_select(0, self.index)

    def unpack(self, local, cp_group=None):
        """[T_pack, ...] -> [T_total, ...]: every member reads its prefix's slots; a sequence's
        last token gets 0. Differentiable; `cp_group` is unused (CP 1)."""
        if local.dim() == 0 or local.shape[0] != self.index.shape[0]:
            raise ValueError(f"local must be [T_pack={self.index.shape[0]}, ...], got shape {tuple(local.shape)}")
        with_zero = torch.cat([local, local.new_zeros((1, *local.shape[1:]))])
        return with_zero.index_select(0, torch.where(self.slot_of_token < 0, len(local), self.slot_of_token))
