"""Weights between Megatron-Core and Hugging Face checkpoints: the name tables, load and export.

For the four MTP families megatron_model.py builds: MiMo (a Qwen2 decoder plus
`num_nextn_predict_layers` MTP layers), DeepSeek-V3 (MLA + MoE), GLM-4.5 (GQA + MoE) and
Qwen3.5 (gated DeltaNet + gated attention; its table and row layouts: qwen35_names.py).
Two moves:

    load_hf_into_megatron(model, "ckpt/")          # HF -> Megatron, each rank reads its slices
    for name, tensor in megatron_to_hf(model): ...  # Megatron -> HF, TP shards and EP experts gathered

vllm_sync.py sends `megatron_to_hf`'s tensors into a colocated vLLM engine; hf_export.py
writes them as a HF directory vLLM and transformers load.

The layouts differ in these ways, all handled here:
- names: `decoder.layers.{i}.self_attention.linear_qkv` is `model.layers.{i}.self_attn.{q,k,v}_proj`,
  MLA's `linear_{q,kv}_{down,up}_proj` and their norms are `self_attn.{q_a,q_b,kv_a,kv_b}...`,
  `mlp.router` is `mlp.gate` (its `expert_bias` buffer is `e_score_correction_bias`),
  `mlp.experts.local_experts.{e}` is `mlp.experts.{ep_rank * local + e}`. MiMo's MTP layers
  are `model.mtp_layers.{j}` with `token_layernorm`, `hidden_layernorm`, `input_proj`;
  DeepSeek's and GLM's are `model.layers.{num_layers + j}` with `enorm`, `hnorm`, `eh_proj`,
  `shared_head.norm`, plus a copy of the embedding and output layer in each. The MTP
  layer's submodule is `transformer_layer` up to megatron-core 0.16 and `mtp_model_layer`
  from 0.17; Transformer Engine layer specs fold the norms into the following linear
  layer (`linear_qkv.layer_norm_weight`, ...). All are accepted.
- `linear_qkv` interleaves per query group: [q heads of group 0, k0, v0, q heads of group 1, ...];
  HF keeps q, k and v apart.
- `linear_fc1` is [gate; up] (SwiGLU; experts and shared experts too). Under tensor
  parallelism each rank holds [gate shard; up shard], so the shards do not simply
  concatenate into the full tensor.
- Megatron's MTP computes `eh_proj(cat(embedding, hidden))`, as DeepSeek's and GLM's do;
  MiMo's (and vLLM's MiMo) `input_proj(cat(hidden, embedding))`: the halves swap.

FP8 block-quantized checkpoints load directly (safetensors_reader.py dequantizes them); the
export is never quantized: `megatron_to_hf` gives the parameters' dtype (hf_export.py
drops `quantization_config` from the config.json it copies).

Tensor and expert parallelism: every HF tensor travels whole. Loading slices it per rank
(each expert-parallel rank reads its own experts); exporting all-gathers it over the
tensor-parallel (experts: expert-tensor-parallel) group and the experts over the
expert-parallel group; vLLM's own weight loaders slice it again
for the rollout engine's tensor-parallel layout, so trainer and rollout engine may use
different tensor-parallel sizes. Under pipeline parallelism each stage names its layers
with the model's layer numbers and loads only its own; the export broadcasts every stage's
tensors to the other stages (the MTP layers, on the last stage, included).

Imports torch, the standard library, megatron-core and the project's safetensors_reader
and qwen35_names; no vLLM (the trainer and an HF export need none).
"""

import contextlib
import dataclasses
import json
import os
import re
import weakref

import torch
import torch.distributed as dist
from megatron.core import parallel_state

import qwen35_names
from safetensors_reader import SCALE_SUFFIX, CheckpointReader, fp8_block_size, quantization_problems

# `megatron_to_hf(layers=...)`: everything, the main model only, the MTP layers only, or
# what vLLM's MTP drafter holds (the MTP layers and the embedding and output layer it shares).
LAYER_SELECTIONS = ("all", "main", "mtp", "draft")
# The megatron tensors vLLM's MTP drafter shares with the main model.
DRAFT_SHARED_MEGATRON_NAMES = ("embedding.word_embeddings.weight", "output_layer.weight")

# How a megatron tensor becomes HF tensors. "copy": same tensor; "qkv": split per query
# group into q, k, v; "gate_up": [gate; up] halves; "swap_halves": eh_proj <-> input_proj.
# Inside a transformer layer (decoder layer or the MTP layer's), keyed by megatron suffix:
TRANSFORMER_LAYER_NAMES = {
    "input_layernorm.weight": ("copy", ("input_layernorm.weight",)),
    "self_attention.linear_qkv.layer_norm_weight": ("copy", ("input_layernorm.weight",)),
    "self_attention.linear_qkv.weight": ("qkv", ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                                 "self_attn.v_proj.weight")),
    "self_attention.linear_qkv.bias": ("qkv", ("self_attn.q_proj.bias", "self_attn.k_proj.bias",
                                               "self_attn.v_proj.bias")),
    "self_attention.linear_proj.weight": ("copy", ("self_attn.o_proj.weight",)),
    "pre_mlp_layernorm.weight": ("copy", ("post_attention_layernorm.weight",)),
    "mlp.linear_fc1.layer_norm_weight": ("copy", ("post_attention_layernorm.weight",)),
    "mlp.linear_fc1.weight": ("gate_up", ("mlp.gate_proj.weight", "mlp.up_proj.weight")),
    "mlp.linear_fc2.weight": ("copy", ("mlp.down_proj.weight",)),
}
# GLM's optional per-head q/k norms.
QK_NORM_NAMES = {
    "self_attention.q_layernorm.weight": ("copy", ("self_attn.q_norm.weight",)),
    "self_attention.k_layernorm.weight": ("copy", ("self_attn.k_norm.weight",)),
}
# DeepSeek's multi-latent attention: low-rank q and kv projections, each with its norm
# (folded into the up-projection by Transformer Engine specs). Rows keep HF's order
# (heads outermost; kv_a_proj_with_mqa is [kv latent; shared rotary key]), so all copy.
MLA_NAMES = {
    "self_attention.linear_q_proj.weight": ("copy", ("self_attn.q_proj.weight",)),
    "self_attention.linear_q_down_proj.weight": ("copy", ("self_attn.q_a_proj.weight",)),
    "self_attention.q_layernorm.weight": ("copy", ("self_attn.q_a_layernorm.weight",)),
    "self_attention.linear_q_up_proj.layer_norm_weight": ("copy", ("self_attn.q_a_layernorm.weight",)),
    "self_attention.linear_q_up_proj.weight": ("copy", ("self_attn.q_b_proj.weight",)),
    "self_attention.linear_kv_down_proj.weight": ("copy", ("self_attn.kv_a_proj_with_mqa.weight",)),
    "self_attention.kv_layernorm.weight": ("copy", ("self_attn.kv_a_layernorm.weight",)),
    "self_attention.linear_kv_up_proj.layer_norm_weight": ("copy", ("self_attn.kv_a_layernorm.weight",)),
    "self_attention.linear_kv_up_proj.weight": ("copy", ("self_attn.kv_b_proj.weight",)),
}
# An MoE layer's router (its expert bias is DeepSeek's e_score_correction_bias, a buffer in
# both) and shared experts; the routed experts are `ROUTED_EXPERT` below.
MOE_NAMES = {
    "mlp.router.weight": ("copy", ("mlp.gate.weight",)),
    "mlp.router.expert_bias": ("copy", ("mlp.gate.e_score_correction_bias",)),
    "mlp.shared_experts.linear_fc1.weight": ("gate_up", ("mlp.shared_experts.gate_proj.weight",
                                                         "mlp.shared_experts.up_proj.weight")),
    "mlp.shared_experts.linear_fc2.weight": ("copy", ("mlp.shared_experts.down_proj.weight",)),
}
ROUTED_EXPERT = re.compile(r"mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.weight")
# The MTP layer's own tensors. MiMo keeps them under `model.mtp_layers.{j}` with its own
# names; DeepSeek and GLM under `model.layers.{num_layers + j}`, where each MTP layer also
# stores a copy of the embedding and output layer (`MTP_SHARED_COPIES`, by main-model name).
MIMO_MTP_NAMES = {
    "enorm.weight": ("copy", ("token_layernorm.weight",)),
    "hnorm.weight": ("copy", ("hidden_layernorm.weight",)),
    "eh_proj.weight": ("swap_halves", ("input_proj.weight",)),
    "final_layernorm.weight": ("copy", ("final_layernorm.weight",)),
}
DEEPSEEK_MTP_NAMES = {
    "enorm.weight": ("copy", ("enorm.weight",)),
    "hnorm.weight": ("copy", ("hnorm.weight",)),
    "eh_proj.weight": ("copy", ("eh_proj.weight",)),
    "final_layernorm.weight": ("copy", ("shared_head.norm.weight",)),
}
MTP_SHARED_COPIES = {"model.embed_tokens.weight": "embed_tokens.weight", "lm_head.weight": "shared_head.head.weight"}
MODEL_NAMES = {
    "embedding.word_embeddings.weight": ("copy", ("model.embed_tokens.weight",)),
    "decoder.final_layernorm.weight": ("copy", ("model.norm.weight",)),
    "output_layer.weight": ("copy", ("lm_head.weight",)),
}
DECODER_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
MTP_LAYER = re.compile(r"mtp\.layers\.(\d+)\.(?:(transformer_layer|mtp_model_layer)\.)?(.+)")
# HF config fields that shapes cannot check (4 heads of 64 and 8 of 32 have the same
# q_proj), against the megatron config field they must equal.
ATTENTION_GEOMETRY = (("num_attention_heads", "num_attention_heads"),
                      ("num_key_value_heads", "num_query_groups"),
                      ("head_dim", "kv_channels"),
                      ("n_routed_experts", "num_moe_experts"),
                      ("qk_nope_head_dim", "qk_head_dim"),
                      ("qk_rope_head_dim", "qk_pos_emb_head_dim"))


# ---------------------------------------------------------------------------------------
# Names and layouts
# ---------------------------------------------------------------------------------------

def _is_moe(config):
    return config is not None and bool(getattr(config, "num_moe_experts", None))


def _is_qwen35(config):
    return config is not None and getattr(config, "experimental_attention_variant", None) == "gated_delta_net"


def mtp_hf_prefix(config, mtp_layer):
    """The HF prefix of MTP layer `mtp_layer`: MiMo's `model.mtp_layers.{j}.` for a dense model,
    DeepSeek's (and GLM's) `model.layers.{num_layers + j}.` for an MoE one."""
    if _is_moe(config):
        return f"model.layers.{config.num_layers + mtp_layer}."
    if _is_qwen35(config):
        return qwen35_names.mtp_layer_prefix(mtp_layer)
    return f"model.mtp_layers.{mtp_layer}."


def _layer_names(config):
    """Megatron suffix -> (kind, HF suffixes) inside one transformer layer of this model."""
    table = dict(TRANSFORMER_LAYER_NAMES)
    if config is not None and getattr(config, "multi_latent_attention", False):
        table.update(MLA_NAMES)
    elif config is not None and config.qk_layernorm:
        table.update(QK_NORM_NAMES)
    if _is_moe(config):
        table.update(MOE_NAMES)
    if _is_qwen35(config):
        table.update(qwen35_names.LAYER_NAMES)
    return table


def _expert_parallel_rank_and_size():
    if not parallel_state.model_parallel_is_initialized():
        return 0, 1
    return parallel_state.get_expert_model_parallel_rank(), parallel_state.get_expert_model_parallel_world_size()


def _layer_hf_names(rest, prefix, config, expert_rank):
    """(kind, HF names) of megatron suffix `rest` in the transformer layer at `prefix`, or None.
    Routed experts are numbered globally: EP rank r holds experts r * local + i."""
    match = ROUTED_EXPERT.fullmatch(rest)
    if match and _is_moe(config):
        expert = expert_rank * (config.num_moe_experts // _expert_parallel_rank_and_size()[1]) + int(match.group(1))
        if match.group(2) == "linear_fc1":
            return "gate_up", (f"{prefix}mlp.experts.{expert}.gate_proj.weight",
                               f"{prefix}mlp.experts.{expert}.up_proj.weight")
        return "copy", (f"{prefix}mlp.experts.{expert}.down_proj.weight",)
    table = _layer_names(config)
    if rest in table:
        kind, suffixes = table[rest]
        return kind, tuple(prefix + suffix for suffix in suffixes)
    return None


def hf_names_for(megatron_name, config=None, expert_rank=None):
    """(kind, HF names) for one megatron tensor name; ValueError when there is none.

    `config` (the model's TransformerConfig) selects the family's names: None or a dense
    config is MiMo; multi-latent attention is DeepSeek; experts put the MTP layers at
    `model.layers.{num_layers + j}`. `expert_rank`: the expert-parallel rank whose local
    experts the name counts (default: this rank's).
    """
    if expert_rank is None:
        expert_rank = _expert_parallel_rank_and_size()[0]
    found = None
    if megatron_name in MODEL_NAMES:
        found = MODEL_NAMES[megatron_name]
    match = DECODER_LAYER.fullmatch(megatron_name)
    if match:
        found = _layer_hf_names(match.group(2), f"model.layers.{match.group(1)}.", config, expert_rank)
    match = MTP_LAYER.fullmatch(megatron_name)
    if match:
        layer, inner, rest = match.groups()
        prefix = mtp_hf_prefix(config, int(layer))
        if inner:
            found = _layer_hf_names(rest, prefix, config, expert_rank)
        elif _is_qwen35(config):
            if rest in qwen35_names.MTP_NAMES:
                kind, suffixes = qwen35_names.MTP_NAMES[rest]
                found = kind, tuple(qwen35_names.MTP_PREFIX + suffix for suffix in suffixes)
        else:
            table = DEEPSEEK_MTP_NAMES if _is_moe(config) else MIMO_MTP_NAMES
            if rest in table:
                kind, suffixes = table[rest]
                found = kind, tuple(prefix + suffix for suffix in suffixes)
    if found is None:
        raise ValueError(f"megatron parameter {megatron_name!r} has no Hugging Face name: expected a MiMo, "
                         "DeepSeek-V3, GLM-4.5 or Qwen3.5 GPT built by megatron_model.py with megatron's local or TE "
                         "spec")
    return found


def _interleave_qkv(q, k, v, groups):
    """[q; k; v] (HF) -> per query group [q_g; k_g; v_g] (megatron); weights or biases."""
    rest = q.shape[1:]
    return torch.cat([q.reshape(groups, -1, *rest), k.reshape(groups, -1, *rest), v.reshape(groups, -1, *rest)],
                     dim=1).reshape(-1, *rest)


def _split_qkv(qkv, groups, heads_per_group, head_dim):
    """Per query group [q_g; k_g; v_g] (megatron) -> q, k, v (HF)."""
    rest = qkv.shape[1:]
    grouped = qkv.reshape(groups, (heads_per_group + 2) * head_dim, *rest)
    q, k, v = grouped.split([heads_per_group * head_dim, head_dim, head_dim], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def _swap_halves(weight):
    """eh_proj [hidden, 2*hidden] on cat(embedding, hidden) <-> input_proj on cat(hidden, embedding)."""
    half = weight.shape[1] // 2
    return torch.cat([weight[:, half:], weight[:, :half]], dim=1)


def unwrap_model(model):
    """The GPTModel inside `model`: DDP and Float16Module keep it in `.module`."""
    while hasattr(model, "module"):
        model = model.module
    return model


@dataclasses.dataclass
class _Entry:
    megatron_name: str
    param: torch.Tensor
    kind: str
    hf_names: tuple
    is_mtp: bool
    # A routed expert: split over the expert-tensor-parallel group, held by one EP rank.
    is_expert: bool


def _tensor_parallel(entry):
    """(group, size, rank) that `entry`'s tensor is split over; (None, 1, 0) when whole."""
    if not getattr(entry.param, "tensor_model_parallel", False):
        return None, 1, 0
    if entry.is_expert:
        size = parallel_state.get_expert_tensor_parallel_world_size()
        return parallel_state.get_expert_tensor_parallel_group(), size, parallel_state.get_expert_tensor_parallel_rank()
    size = parallel_state.get_tensor_model_parallel_world_size()
    return parallel_state.get_tensor_model_parallel_group(), size, parallel_state.get_tensor_model_parallel_rank()


# Per GPTModel: megatron name -> (the model's name for it, kind, HF names, is_mtp, is_expert). Every push and draft
# check maps every tensor's name through regular expressions: once per model is enough (the
# tensors themselves are looked up on each call, so a buffer a `.to()` replaced is current).
_NAME_MAPS = weakref.WeakKeyDictionary()


def _global_name(name, layer_offset):
    """A megatron name with its decoder layer numbered over the whole model: each pipeline
    stage numbers its own layers from 0, its first being layer `layer_offset` of the model."""
    match = DECODER_LAYER.fullmatch(name)
    if match is None or not layer_offset:
        return name
    return f"decoder.layers.{int(match.group(1)) + layer_offset}.{match.group(2)}"


def _plan(model):
    """One `_Entry` per megatron tensor, in the model's order (layer by layer): the
    parameters, and the routers' expert biases (buffers, as in HF). Under pipeline
    parallelism this stage's, named with the model's layer numbers."""
    model = unwrap_model(model)
    tensors = dict(model.named_parameters())
    for name, buffer in model.named_buffers():
        if name.endswith("router.expert_bias"):
            tensors[name] = buffer
    # megatron numbers a layer's `layer_number` over the whole model, from 1.
    layers = model.decoder.layers
    layer_offset = layers[0].layer_number - 1 if len(layers) else 0
    names = _NAME_MAPS.setdefault(model, {})
    for name in tensors.keys() - names.keys():
        global_name = _global_name(name, layer_offset)
        names[name] = (global_name, *hf_names_for(global_name, model.config), name.startswith("mtp."),
                       ROUTED_EXPERT.search(name) is not None)
    return [_Entry(names[name][0], tensor, *names[name][1:]) for name, tensor in tensors.items()]


def _full_hf_shapes(entry, config):
    """The shapes the HF tensors of `entry` have (whole, not per rank)."""
    full = list(entry.param.shape)
    full[getattr(entry.param, "partition_dim", 0)] *= _tensor_parallel(entry)[1]
    if entry.kind == "qkv":
        rest = full[1:]
        return [(config.num_attention_heads * config.kv_channels, *rest),
                (config.num_query_groups * config.kv_channels, *rest),
                (config.num_query_groups * config.kv_channels, *rest)]
    if entry.kind == "gate_up":
        return [(full[0] // 2, *full[1:])] * 2
    if entry.kind == "rows":
        return [(rows, *full[1:]) for rows in qwen35_names.hf_row_counts(entry.megatron_name, config)]
    return [tuple(full)]


def _hf_names_on_every_expert_rank(entry, config):
    """`entry`'s HF names as each expert-parallel rank counts them (the rank's own experts)."""
    if not entry.is_expert:
        return [entry.hf_names]
    return [hf_names_for(entry.megatron_name, config, expert_rank=rank)[1]
            for rank in range(_expert_parallel_rank_and_size()[1])]


def _mtp_shared_copy_names(config):
    """HF name of each copy of the embedding and output layer that DeepSeek's layout keeps
    in its MTP layers -> the main model's HF name it copies."""
    if not _is_moe(config) or not config.mtp_num_layers:
        return {}
    return {mtp_hf_prefix(config, layer) + suffix: main
            for layer in range(config.mtp_num_layers) for main, suffix in MTP_SHARED_COPIES.items()}


def _is_mtp_hf_name(name, config):
    if _is_qwen35(config):
        return name.startswith(qwen35_names.MTP_PREFIX)
    if not _is_moe(config):
        return name.startswith("model.mtp_layers.")
    match = re.match(r"model\.layers\.(\d+)\.", name)
    return match is not None and int(match.group(1)) >= config.num_layers


# ---------------------------------------------------------------------------------------
# HF -> Megatron
# ---------------------------------------------------------------------------------------

def _read_local_shard(entry, checkpoint, config):
    """This rank's part of `entry` in megatron layout, reading only the slices it needs."""
    param, names = entry.param, entry.hf_names
    _, size, rank = _tensor_parallel(entry)
    if entry.kind == "qkv":
        groups = param.shape[0] // ((config.num_attention_heads // config.num_query_groups + 2) * config.kv_channels)
        q_rows = groups * (config.num_attention_heads // config.num_query_groups) * config.kv_channels
        kv_rows = groups * config.kv_channels
        return _interleave_qkv(checkpoint.read(names[0], 0, rank * q_rows, (rank + 1) * q_rows),
                               checkpoint.read(names[1], 0, rank * kv_rows, (rank + 1) * kv_rows),
                               checkpoint.read(names[2], 0, rank * kv_rows, (rank + 1) * kv_rows), groups)
    if entry.kind == "gate_up":
        rows = param.shape[0] // 2
        return torch.cat([checkpoint.read(name, 0, rank * rows, (rank + 1) * rows) for name in names])
    if entry.kind == "rows":
        return torch.cat([checkpoint.read(names[index], 0, start, end) for index, start, end
                          in qwen35_names.row_sections(entry.megatron_name, config, rank, size)])
    if size > 1:
        rows = param.shape[param.partition_dim]
        tensor = checkpoint.read(names[0], param.partition_dim, rank * rows, (rank + 1) * rows)
    else:
        tensor = checkpoint.read(names[0])
    return _swap_halves(tensor) if entry.kind == "swap_halves" else tensor


def _check_checkpoint(plan, checkpoint, hf_config, config, hf_dir):
    """Every mismatch between checkpoint and model, as readable lines (empty: they match)."""
    problems = []
    for hf_field, megatron_field in ATTENTION_GEOMETRY:
        if hf_field in hf_config and hf_config[hf_field] != getattr(config, megatron_field, None):
            problems.append(f"config.json {hf_field}={hf_config[hf_field]}, the model has "
                            f"{megatron_field}={getattr(config, megatron_field, None)}")
    expected = set()
    for entry in plan:
        shapes = _full_hf_shapes(entry, config)
        for names in _hf_names_on_every_expert_rank(entry, config):
            for name, shape in zip(names, shapes):
                expected.add(name)
                if name not in checkpoint.files:
                    problems.append(f"{name}: missing (expected shape {shape}, for megatron {entry.megatron_name})")
                elif checkpoint.shape(name) != shape:
                    problems.append(f"{name}: expected shape {shape}, checkpoint has {checkpoint.shape(name)} "
                                    f"(megatron {entry.megatron_name})")
    # DeepSeek's layout stores the embedding and output layer again in each MTP layer:
    # megatron shares the main model's, so the copies are read by nothing.
    expected.update(_mtp_shared_copy_names(config))
    problems += quantization_problems(checkpoint, expected)
    problems, expected, model_has_mtp = _union_over_stages(problems, expected, any(entry.is_mtp for entry in plan))
    expected.update(name + SCALE_SUFFIX for name in list(expected) if checkpoint.is_quantized(name))
    for name in sorted(set(checkpoint.files) - expected):
        # A checkpoint with MTP layers loads into a model built without them (mtp=False).
        if not model_has_mtp and _is_mtp_hf_name(name, config):
            continue
        problems.append(f"{name}: in the checkpoint, but the model has no such tensor "
                        f"(shape {checkpoint.shape(name)})")
    if problems:
        raise ValueError(f"checkpoint {hf_dir!r} does not match the model ({len(problems)} problem(s)); "
                         "nothing was loaded:\n  " + "\n  ".join(problems))


def _union_over_stages(problems, expected, has_mtp):
    """(problems, expected HF names, whether the model has MTP layers) of the whole model:
    each pipeline stage's gathered over the pipeline group (unchanged without stages), so
    that every stage refuses together and none takes another stage's tensors for strays."""
    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return problems, expected, has_mtp
    group = parallel_state.get_pipeline_model_parallel_group()
    stages = [None] * group.size()
    dist.all_gather_object(stages, (problems, expected, has_mtp), group=group)
    return (list(dict.fromkeys(problem for stage in stages for problem in stage[0])),
            set().union(*(stage[1] for stage in stages)), any(stage[2] for stage in stages))


@torch.no_grad()
def load_hf_into_megatron(model, hf_dir):
    """Copy a HF checkpoint (MiMo, DeepSeek-V3, GLM-4.5; safetensors, MTP layers optional) into a megatron GPTModel.

    Call on every rank. Each tensor-parallel rank reads only the slices of the file it
    holds, each expert-parallel rank only its own experts (safetensors slicing; nothing
    else of the file is read into memory). Tensors
    are cast to the parameter dtype (bf16 checkpoint into fp32 model and back is exact).
    FP8 block-quantized weights (config.json's `quantization_config`, see `fp8_block_size`)
    are dequantized block by block in fp32 and then cast: exactly weight x scale.
    Everything is checked before anything is copied: a missing, unexpected or wrongly
    shaped tensor, or attention geometry that differs from config.json, raises ValueError
    naming each tensor with its expected and actual shape, and the model stays as it was.
    MTP layers in the checkpoint are skipped when the model has none.
    """
    model = unwrap_model(model)
    plan = _plan(model)
    hf_config_path = os.path.join(hf_dir, "config.json")
    hf_config = {}
    if os.path.exists(hf_config_path):
        with open(hf_config_path) as f:
            hf_config = json.load(f)
    with contextlib.ExitStack() as stack:
        checkpoint = CheckpointReader(hf_dir, stack, fp8_block_size(hf_config))
        _check_checkpoint(plan, checkpoint, hf_config, model.config, hf_dir)
        for entry in plan:
            entry.param.copy_(_read_local_shard(entry, checkpoint, model.config))


# ---------------------------------------------------------------------------------------
# Megatron -> HF
# ---------------------------------------------------------------------------------------

def _gather_shards(entry):
    """All tensor-parallel ranks' shards of `entry`, in rank order (just the tensor without TP)."""
    local = entry.param.detach()
    group, size, _ = _tensor_parallel(entry)
    if size == 1:
        return [local]
    shards = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(shards, local.contiguous(), group=group)
    return shards


def _hf_tensors(entry, config):
    """`entry`'s whole HF tensors (tensor-parallel shards gathered), in `entry.hf_names` order."""
    shards = _gather_shards(entry)
    if entry.kind == "gate_up":
        halves = [shard.chunk(2) for shard in shards]
        if len(halves) == 1:  # whole: the halves are views, not copies
            return halves[0]
        return torch.cat([gate for gate, _ in halves]), torch.cat([up for _, up in halves])
    if entry.kind == "rows":
        return _rows_to_hf(entry, config, shards)
    full = shards[0] if len(shards) == 1 else torch.cat(shards, dim=entry.param.partition_dim)
    if entry.kind == "qkv":
        return _split_qkv(full, config.num_query_groups, config.num_attention_heads // config.num_query_groups,
                          config.kv_channels)
    if entry.kind == "swap_halves":
        return (_swap_halves(full),)
    return (full,)


def _rows_to_hf(entry, config, shards):
    """The HF tensors of a "rows" entry (qwen35_names.row_sections) from every rank's shard."""
    counts = qwen35_names.hf_row_counts(entry.megatron_name, config)
    tensors = [shards[0].new_empty((rows, *shards[0].shape[1:])) for rows in counts]
    for rank, shard in enumerate(shards):
        sections = qwen35_names.row_sections(entry.megatron_name, config, rank, len(shards))
        for (index, start, end), rows in zip(sections, shard.split([end - start for _, start, end in sections])):
            tensors[index][start:end] = rows
    return tensors


def _on_every_expert_rank(entry, config, tensors):
    """(names, tensors) of this routed expert on each expert-parallel rank (gathered over EP)."""
    names_per_rank = _hf_names_on_every_expert_rank(entry, config)
    if len(names_per_rank) == 1:
        return [(entry.hf_names, tensors)]
    group = parallel_state.get_expert_model_parallel_group()
    gathered = []
    for tensor in tensors:
        copies = [torch.empty_like(tensor) for _ in names_per_rank]
        dist.all_gather(copies, tensor.contiguous(), group=group)
        gathered.append(copies)
    return [(names, [copies[rank] for copies in gathered]) for rank, names in enumerate(names_per_rank)]


@torch.no_grad()
def megatron_to_hf(model, layers="all"):
    """Yield `(hf_name, tensor)` for the megatron GPTModel, whole tensors in HF layout.

    Call on every tensor-, expert- and pipeline-parallel rank (shards are all-gathered,
    each pipeline stage's tensors broadcast to the other stages; every rank receives every
    tensor, every expert and layer included). One megatron tensor is gathered at a
    time, so the extra memory is one tensor (times the expert-parallel size), not a
    model. Tensors keep the parameters' dtype and device and may share storage with them
    (without parallelism most are views): copy before modifying. `layers`: "all",
    "main" (everything but the MTP layers), "mtp" (the MTP layers only; they share
    embedding and output layer with the main model) or "draft" (the MTP layers,
    embedding and output layer: what vLLM's MTP drafter holds). DeepSeek's and GLM's
    layout keeps a copy of the embedding and output layer in each MTP layer: "all" yields
    those copies too, last. Order: layer by layer, as the model holds them (stage by stage).
    """
    if layers not in LAYER_SELECTIONS:
        raise ValueError(f"layers={layers!r}: expected one of {LAYER_SELECTIONS}")
    model = unwrap_model(model)
    shared_copies = _mtp_shared_copy_names(model.config) if layers == "all" else {}
    main_tensors = {}
    for name, tensor in _over_stages(model, layers):
        if name in shared_copies.values():
            main_tensors[name] = tensor
        yield name, tensor
    for copy_name, main_name in shared_copies.items():
        yield copy_name, main_tensors[main_name]


def _selected(model, layers):
    """This stage's entries of the `megatron_to_hf` selection `layers`."""
    for entry in _plan(model):
        in_draft = entry.is_mtp or entry.megatron_name in DRAFT_SHARED_MEGATRON_NAMES
        if (layers == "main" and entry.is_mtp) or (layers == "mtp" and not entry.is_mtp) or (
                layers == "draft" and not in_draft):
            continue
        # A later stage's copy of the word embeddings (its MTP layers' input) is the first
        # stage's tensor: megatron keeps the two equal.
        if not model.pre_process and entry.megatron_name == "embedding.word_embeddings.weight":
            continue
        yield entry


def _stage_tensors(model, layers):
    """(hf_name, tensor) of this stage's selected entries, TP shards and EP experts gathered."""
    for entry in _selected(model, layers):
        for names, tensors in _on_every_expert_rank(entry, model.config, _hf_tensors(entry, model.config)):
            yield from zip(names, tensors)


def _over_stages(model, layers):
    """`_stage_tensors` of every pipeline stage in stage order, on every stage: each stage
    first tells the others the names, shapes and dtypes it will send, then broadcasts its
    tensors one by one over the pipeline group."""
    group = parallel_state.get_pipeline_model_parallel_group() if parallel_state.model_parallel_is_initialized() \
        else None
    if group is None or group.size() == 1:
        yield from _stage_tensors(model, layers)
        return
    config = model.config
    mine = [(name, shape, entry.param.dtype) for entry in _selected(model, layers)
            for names in _hf_names_on_every_expert_rank(entry, config)
            for name, shape in zip(names, _full_hf_shapes(entry, config))]
    stages = [None] * group.size()
    dist.all_gather_object(stages, mine, group=group)
    ranks, device = dist.get_process_group_ranks(group), next(model.parameters()).device
    local = _stage_tensors(model, layers)
    for stage, listed in enumerate(stages):
        for name, shape, dtype in listed:
            if stage == group.rank():
                _, tensor = next(local)
                tensor = tensor.contiguous()
            else:
                tensor = torch.empty(shape, dtype=dtype, device=device)
            dist.broadcast(tensor, src=ranks[stage], group=group)
            yield name, tensor
