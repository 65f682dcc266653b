"""Qwen3.5's Hugging Face <-> Megatron name table and row layouts (for hf_weights.py).

Qwen3.5 (`Qwen3_5ForCausalLM`) keeps apart what megatron-core fuses, in an order megatron's
tensor-parallel split does not keep:

    megatron (per tensor-parallel rank r)                 HF (whole)
    self_attention.in_proj   [q_r; k_r; v_r; z_r; b_r; a_r] linear_attn.in_proj_qkv [q; k; v],
                                                            in_proj_z, in_proj_b, in_proj_a
    self_attention.conv1d    [q_r; k_r; v_r]                linear_attn.conv1d [q; k; v]
    self_attention.linear_qkv per query group g:            self_attn.q_proj per head h:
                             [q heads; gate heads; k_g; v_g] [q_h; gate_h], k_proj, v_proj

Each such megatron tensor is a list of row ranges of HF tensors (`row_sections`): loading
concatenates the ranges a rank holds, exporting writes each rank's rows back where they
came from. Both are plain copies, so HF -> Megatron -> HF is bit for bit. Everything else
maps one to one (`LAYER_NAMES`, `MTP_NAMES`); every norm weight is stored as HF stores it
(megatron_model.ZeroCenteredRMSNorm scales by 1 + weight, as Qwen3.5 does).

The MTP block: HF keeps `mtp.fc` (on cat(embedding, hidden), megatron's `eh_proj` order),
`mtp.pre_fc_norm_{embedding,hidden}`, `mtp.norm` once, and its decoder layers under
`mtp.layers.{j}`; megatron keeps them per MTP layer, so one MTP layer maps exactly.
Imports nothing.
"""

# Megatron suffix inside a decoder layer -> (kind, HF suffixes); "rows": `row_sections`.
LAYER_NAMES = {
    "self_attention.in_proj.weight": ("rows", ("linear_attn.in_proj_qkv.weight", "linear_attn.in_proj_z.weight",
                                               "linear_attn.in_proj_b.weight", "linear_attn.in_proj_a.weight")),
    "self_attention.conv1d.weight": ("rows", ("linear_attn.conv1d.weight",)),
    "self_attention.dt_bias": ("copy", ("linear_attn.dt_bias",)),
    "self_attention.A_log": ("copy", ("linear_attn.A_log",)),
    "self_attention.out_norm.weight": ("copy", ("linear_attn.norm.weight",)),
    "self_attention.out_proj.weight": ("copy", ("linear_attn.out_proj.weight",)),
    "self_attention.linear_qkv.weight": ("rows", ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                                  "self_attn.v_proj.weight")),
}
# The MTP layer's own tensors, under `mtp.` (its decoder layer is under `mtp.layers.{j}.`).
MTP_NAMES = {
    "enorm.weight": ("copy", ("pre_fc_norm_embedding.weight",)),
    "hnorm.weight": ("copy", ("pre_fc_norm_hidden.weight",)),
    "eh_proj.weight": ("copy", ("fc.weight",)),
    "final_layernorm.weight": ("copy", ("norm.weight",)),
}
MTP_PREFIX = "mtp."


def mtp_layer_prefix(mtp_layer):
    """The HF prefix of MTP layer `mtp_layer`'s decoder layer."""
    return f"{MTP_PREFIX}layers.{mtp_layer}."


def _gdn_sections(config, rank, size, with_gates):
    """The gated DeltaNet's in_proj (`with_gates`) or conv1d rows of rank `rank` of `size`."""
    qk = config.linear_num_key_heads * config.linear_key_head_dim
    v = config.linear_num_value_heads * config.linear_value_head_dim
    heads = config.linear_num_value_heads

    def share(name_index, offset, rows):
        return name_index, offset + rank * rows // size, offset + (rank + 1) * rows // size

    sections = [share(0, 0, qk), share(0, qk, qk), share(0, 2 * qk, v)]
    if with_gates:
        sections += [share(1, 0, v), share(2, 0, heads), share(3, 0, heads)]
    return sections


def _gated_qkv_sections(config, rank, size):
    """linear_qkv's rows of rank `rank` of `size`: per local query group, its heads' queries,
    their output gates (HF: each head's [query; gate] in q_proj), the group's key and value."""
    head_dim, groups = config.kv_channels, config.num_query_groups
    heads_per_group = config.num_attention_heads // groups
    sections = []
    for group in range(rank * groups // size, (rank + 1) * groups // size):
        heads = range(group * heads_per_group, (group + 1) * heads_per_group)
        sections += [(0, 2 * head * head_dim, (2 * head + 1) * head_dim) for head in heads]
        sections += [(0, (2 * head + 1) * head_dim, (2 * head + 2) * head_dim) for head in heads]
        sections += [(1, group * head_dim, (group + 1) * head_dim), (2, group * head_dim, (group + 1) * head_dim)]
    return sections


def row_sections(megatron_name, config, rank, size):
    """[(HF name index, first row, end row)] that make up, in order, the rows tensor-parallel
    rank `rank` of `size` holds of megatron tensor `megatron_name` (a "rows" kind in
    LAYER_NAMES). `config`: the model's TransformerConfig."""
    if megatron_name.endswith("self_attention.in_proj.weight"):
        return _gdn_sections(config, rank, size, with_gates=True)
    if megatron_name.endswith("self_attention.conv1d.weight"):
        return _gdn_sections(config, rank, size, with_gates=False)
    if megatron_name.endswith("self_attention.linear_qkv.weight"):
        return _gated_qkv_sections(config, rank, size)
    raise ValueError(f"{megatron_name!r} is not a Qwen3.5 tensor laid out in row sections; expected one of "
                     f"{sorted(name for name, (kind, _) in LAYER_NAMES.items() if kind == 'rows')}")


def hf_row_counts(megatron_name, config):
    """The number of rows of each HF tensor that `megatron_name` maps to, in name order."""
    counts = {}
    for index, _, end in row_sections(megatron_name, config, 0, 1):
        counts[index] = max(counts.get(index, 0), end)
    return [counts[index] for index in sorted(counts)]
