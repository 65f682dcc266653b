"""Build a megatron-core GPTModel for a Hugging Face MTP config: MiMo, DeepSeek-V3, GLM-4.5 or Qwen3.5.

One builder for everything that needs the policy as a Megatron model: `train_grpo.py`,
the tests and the benchmarks. Each family's config maps one to one:

    all       RMSNorm, SwiGLU (gated linear unit, silu), RoPE (rope_theta), untied output
              layer, `num_nextn_predict_layers` MTP layers.
    MiMo      (Qwen2) grouped-query attention with bias on q/k/v only.
    DeepSeek  multi-latent attention (q/kv low-rank projections with their norms, a
              rotary part of the key shared by the heads, value heads narrower than
              query heads), plain RoPE or the published YaRN `rope_scaling` (every
              field, mscale_all_dim's softmax scale included); the first
              `first_k_dense_replace` layers dense, the rest MoE.
    GLM-4.5   grouped-query attention with q/k/v bias, RoPE on `partial_rotary_factor`
              of each head, optional q/k norms; dense first layers, then MoE.
    Qwen3.5   gated-DeltaNet linear attention (gdn_thd.py) on the layers `layer_types` marks
              linear, gated full attention (sigmoid output gate, q/k norms, RoPE on
              `partial_rotary_factor` of each head) on the others; every norm but the
              DeltaNet's own scales by (1 + weight); a full-attention MTP layer.
    MoE       routed experts (SequentialMLP) plus shared experts, sigmoid scores, the
              `e_score_correction_bias` used to pick experts (megatron's expert bias),
              group-limited top-k (`n_group`, `topk_group`; where top-k = 2 x topk_group,
              the one case megatron-core groups as transformers does), normalised top-k weights
              times `routed_scaling_factor`. The MTP layer is an MoE layer, as in both.

    model = build_gpt_model("runs/tiny-mimo", mtp=True)

The router during RL: no auxiliary load-balancing loss and no expert-bias updates (rate 0).
Both are pretraining controls that move routing towards balance; in RL they would move
each token's experts away from the ones the rollout engine used, for a batch far too
small to say anything about balance. The router's weights train with the rest.

megatron-core's parallel state must be initialised first (see cpu_backend.py). Written to
construct on megatron-core 0.14 - 0.19: config fields a release does not know are left out.
"""

import contextlib
import dataclasses

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt import gpt_layer_specs
from megatron.core.transformer import MLATransformerConfig, TransformerConfig

from cpu_backend import cuda_on_cpu
from hf_families import DENSE_FAMILIES, load_hf_config, model_family, mtp_layer_count, refuse_unsupported_fields


# The MTP loss is added to the LM loss with this weight (divided by the number of MTP
# layers). Set explicitly: up to megatron-core 0.15 the default is None and the MTP loss
# divides by it.
DEFAULT_MTP_LOSS_SCALING_FACTOR = 0.1
# Qwen3.5's `layer_types` entries: a gated-DeltaNet layer, a full-attention layer.
QWEN35_LAYER_TYPES = ("linear_attention", "full_attention")
# megatron-core's token dispatcher for MoE layers under expert parallelism. Its all-to-all
# takes each rank's split sizes, so expert-parallel ranks may hold micro-batches of any
# lengths (responses ending at EOS, data prompts, token budgets); the all-gather dispatcher
# needs as many tokens on every rank. Without expert parallelism the all-gather dispatcher
# (megatron's default) stays: it gathers only over the TP ranks of one micro-batch.
MOE_TOKEN_DISPATCHER = "alltoall"
# MLA's down projections, whole on every tensor-parallel rank under sequence parallelism.
MLA_DOWN_PROJECTIONS = ("linear_q_down_proj", "linear_kv_down_proj")
# A DeepSeek config's YaRN rope_scaling field -> MLATransformerConfig's.
YARN_FIELDS = {"factor": "rotary_scaling_factor", "original_max_position_embeddings": "original_max_position_embeddings",
               "beta_fast": "beta_fast", "beta_slow": "beta_slow", "mscale": "mscale", "mscale_all_dim": "mscale_all_dim"}


def rope_settings(hf_config):
    """(rope_theta, YaRN fields or None) of a HF config: config.json's `rope_theta` and
    `rope_scaling`, or `rope_parameters` as transformers 5 writes them. None is plain RoPE;
    YaRN's fields are MLATransformerConfig's (`_yarn_fields`). ValueError names a scaling
    type or field this project does not build."""
    scaling = dict(hf_config.get("rope_scaling") or hf_config.get("rope_parameters") or {})
    nested_theta = scaling.pop("rope_theta", 10000)
    theta = hf_config.get("rope_theta", nested_theta)
    # transformers 5 copies partial_rotary_factor (GLM's) in beside the top-level one it
    # reads; Qwen3.5 publishes it there alone.
    if scaling.get("partial_rotary_factor") == partial_rotary_factor(hf_config):
        scaling.pop("partial_rotary_factor", None)
    # Qwen3.5's multimodal RoPE: a text token's three position ids (time, height, width) are
    # equal, so its sections and their interleaving rotate as plain RoPE does.
    if "Qwen3_5ForCausalLM" in (hf_config.get("architectures") or []):
        scaling.pop("mrope_section", None)
        scaling.pop("mrope_interleaved", None)
    # Published configs name the type "type" (DeepSeek-V3's), transformers 5 "rope_type", or both.
    kinds = {scaling.pop(key) for key in ("type", "rope_type") if key in scaling}
    kind = kinds.pop() if len(kinds) == 1 else None if not kinds else sorted(kinds)
    if kind in (None, "default") and not scaling:
        return theta, None
    if kind != "yarn":
        raise ValueError(f"rope_scaling type {kind!r}: not one this project builds; expected 'yarn' (DeepSeek "
                         "family only) or rope_scaling null (plain RoPE)")
    return theta, _yarn_fields(scaling, hf_config)


def partial_rotary_factor(hf_config):
    """The share of each head that RoPE rotates: config.json's top-level field, else the one in
    `rope_parameters` (Qwen3.5's), else 1."""
    nested = (hf_config.get("rope_parameters") or {}).get("partial_rotary_factor", 1.0)
    return hf_config.get("partial_rotary_factor", nested)


def _yarn_fields(scaling, hf_config):
    """MLATransformerConfig's YaRN fields for a DeepSeek config's rope_scaling (its type
    taken off). A field left out takes transformers' (and vLLM's) default."""
    unknown = sorted(set(scaling) - set(YARN_FIELDS) - {"truncate"})
    if unknown:
        raise ValueError(f"rope_scaling field(s) {', '.join(unknown)}: not part of the YaRN this project builds; "
                         f"expected only {', '.join(YARN_FIELDS)}")
    if scaling.get("truncate", True) is not True:
        raise ValueError(f"rope_scaling truncate={scaling['truncate']!r}: megatron-core and vLLM round YaRN's "
                         "correction range to whole dimensions; expected truncate true or absent")
    fields = {"factor": None, "original_max_position_embeddings": hf_config.get("max_position_embeddings"),
              "beta_fast": 32, "beta_slow": 1, **scaling}
    for name in ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow"):
        if isinstance(fields[name], bool) or not isinstance(fields[name], (int, float)) or fields[name] <= 0:
            raise ValueError(f"rope_scaling {name}={fields[name]!r}: expected a positive number")
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    # The attention factor on cos/sin: transformers takes mscale / mscale_all_dim's ratio
    # only when both are set (else mscale 1, mscale_all_dim 0), vLLM and megatron-core
    # always (defaults 1 and 0). They agree on both set, or mscale_all_dim unset and mscale 1.
    if not (mscale and mscale_all_dim) and (mscale_all_dim or mscale not in (None, 1)):
        raise ValueError(f"rope_scaling mscale={mscale!r}, mscale_all_dim={mscale_all_dim!r}: transformers and "
                         "vLLM scale YaRN's attention differently for this pair; expected both set (DeepSeek-V3: "
                         "1.0 and 1.0), or mscale_all_dim unset and mscale 1 or unset")
    fields.update(mscale=float(mscale or 1.0), mscale_all_dim=float(mscale_all_dim or 0.0))
    # mscale_all_dim also multiplies the softmax scale by yarn_get_mscale(factor,
    # mscale_all_dim)^2 in all three (megatron-core's MLA reads it from this config).
    return {"rope_type": "yarn", **{YARN_FIELDS[name]: value for name, value in fields.items() if name != "truncate"}}


def _group_limited_routing(hf_config):
    """(n_group, topk_group) where a token's experts come from its topk_group best expert
    groups, None where every group may serve it (n_group 1, or topk_group = n_group).

    megatron-core (0.14 - 0.19) scores a group by the sum of its top (top-k / topk_group) experts,
    transformers and vLLM by the sum of its top 2: they choose the same groups only where
    top-k = 2 x topk_group (DeepSeek-V3's 8 and 4). Elsewhere the routers would send a token
    to other experts than the rollout engine's, so such a config is refused by name."""
    num_groups, groups_per_token = hf_config.get("n_group") or 1, hf_config.get("topk_group") or 1
    top_k = hf_config["num_experts_per_tok"]
    if groups_per_token > num_groups:
        raise ValueError(f"topk_group={groups_per_token}: a token picks among n_group={num_groups} expert groups; "
                         f"expected topk_group <= n_group")
    if groups_per_token == num_groups:
        return None
    if top_k != 2 * groups_per_token:
        raise ValueError(f"n_group={num_groups}, topk_group={groups_per_token}, num_experts_per_tok={top_k}: "
                         f"megatron-core scores each expert group by its top num_experts_per_tok / topk_group "
                         f"experts, transformers and vLLM by their top 2; expected num_experts_per_tok = 2 x "
                         f"topk_group, or topk_group = n_group")
    return num_groups, groups_per_token


def _moe_fields(hf_config, expert_parallel):
    """TransformerConfig fields of DeepSeek-V3's and GLM-4.5's MoE layers."""
    num_experts = hf_config["n_routed_experts"]
    if num_experts % expert_parallel:
        raise ValueError(f"expert_parallel={expert_parallel} must divide n_routed_experts={num_experts}")
    if hf_config.get("scoring_func", "sigmoid") != "sigmoid" or not hf_config.get("norm_topk_prob", True):
        raise ValueError(f"scoring_func={hf_config.get('scoring_func')!r}, norm_topk_prob="
                         f"{hf_config.get('norm_topk_prob')}: megatron's sigmoid router normalises the top-k "
                         "weights; expected scoring_func 'sigmoid' and norm_topk_prob true")
    num_layers, num_dense = hf_config["num_hidden_layers"], hf_config.get("first_k_dense_replace", 0)
    grouping = _group_limited_routing(hf_config)
    return {
        "num_moe_experts": num_experts,
        "moe_ffn_hidden_size": hf_config["moe_intermediate_size"],
        "moe_router_topk": hf_config["num_experts_per_tok"],
        "moe_shared_expert_intermediate_size": hf_config["moe_intermediate_size"] * hf_config["n_shared_experts"],
        "moe_layer_freq": [0] * num_dense + [1] * (num_layers - num_dense),
        "moe_router_score_function": "sigmoid",
        "moe_router_enable_expert_bias": True,
        "moe_router_bias_update_rate": 0.0,
        "moe_router_topk_scaling_factor": hf_config.get("routed_scaling_factor", 1.0),
        "moe_router_num_groups": grouping and grouping[0],
        "moe_router_group_topk": grouping and grouping[1],
        "moe_router_load_balancing_type": "none",
        "moe_aux_loss_coeff": 0.0,
        "moe_router_dtype": "fp32",
        "moe_token_dispatcher_type": MOE_TOKEN_DISPATCHER if expert_parallel > 1 else "allgather",
        "moe_grouped_gemm": False,
        "expert_model_parallel_size": expert_parallel,
        # Routers that can replay the rollout engine's experts (forward.py sets when).
        "moe_enable_routing_replay": True,
    }


def qwen35_layer_types(hf_config):
    """Qwen3.5's per-layer mixer, "linear_attention" or "full_attention" per decoder layer:
    `layer_types`, else every `full_attention_interval`-th layer (4) full, as transformers does."""
    num_layers = hf_config["num_hidden_layers"]
    interval = hf_config.get("full_attention_interval", 4)
    layer_types = hf_config.get("layer_types") or [QWEN35_LAYER_TYPES[(layer + 1) % interval == 0]
                                                   for layer in range(num_layers)]
    unknown = sorted(set(layer_types) - set(QWEN35_LAYER_TYPES))
    if unknown or len(layer_types) != num_layers:
        raise ValueError(f"layer_types={layer_types!r}: expected {num_layers} entries (num_hidden_layers), each "
                         f"one of {QWEN35_LAYER_TYPES}")
    return layer_types


def _qwen35_fields(hf_config, tensor_parallel, context_parallel):
    """TransformerConfig fields of Qwen3.5's hybrid trunk (gated DeltaNet + gated attention)."""
    if context_parallel > 1:
        raise ValueError(f"context_parallel={context_parallel}: Qwen3.5's gated-DeltaNet layers have no "
                         "context-parallel form here (a rank would need the recurrent state of the ranks "
                         "before it; megatron-core 0.16.1 has none either); expected 1")
    if hf_config.get("mtp_num_hidden_layers", 0) > 1:
        raise ValueError(f"mtp_num_hidden_layers={hf_config['mtp_num_hidden_layers']}: Qwen3.5 keeps one mtp.fc "
                         "and its norms for every MTP layer, megatron one per layer; expected 0 or 1")
    for field in ("linear_num_key_heads", "linear_num_value_heads"):
        if hf_config[field] % tensor_parallel:
            raise ValueError(f"tensor_parallel={tensor_parallel} must divide {field}={hf_config[field]}")
    return {"experimental_attention_variant": "gated_delta_net",
            "linear_attention_freq": [int(kind == "linear_attention") for kind in qwen35_layer_types(hf_config)],
            **{field: hf_config[field] for field in ("linear_conv_kernel_dim", "linear_key_head_dim",
                                                     "linear_value_head_dim", "linear_num_key_heads",
                                                     "linear_num_value_heads")},
            "attention_output_gate": True, "qk_layernorm": True}


def _attention_fields(hf_config, family, tensor_parallel):
    """TransformerConfig fields of the family's attention."""
    num_heads = hf_config["num_attention_heads"]
    if family == "deepseek":
        if num_heads % tensor_parallel:
            raise ValueError(f"tensor_parallel={tensor_parallel} must divide num_attention_heads={num_heads}")
        theta, yarn = rope_settings(hf_config)
        return {"multi_latent_attention": True, "num_query_groups": num_heads, "q_lora_rank": hf_config["q_lora_rank"],
                "kv_lora_rank": hf_config["kv_lora_rank"], "qk_head_dim": hf_config["qk_nope_head_dim"],
                "qk_pos_emb_head_dim": hf_config["qk_rope_head_dim"], "v_head_dim": hf_config["v_head_dim"],
                "kv_channels": hf_config["v_head_dim"], "qk_layernorm": True, "rotary_base": theta,
                "add_qkv_bias": False, **(yarn or {"rope_type": "rope"})}
    if rope_settings(hf_config)[1]:
        raise ValueError(f"rope_scaling type 'yarn': the {family} path builds plain RoPE (YaRN is built for the "
                         "DeepSeek family); expected rope_scaling null")
    num_kv_heads = hf_config.get("num_key_value_heads", num_heads)
    # megatron-core splits whole query groups across tensor-parallel ranks; with fewer KV
    # heads than ranks some releases build the model anyway and produce garbage gradients.
    if num_kv_heads % tensor_parallel:
        raise ValueError(f"tensor_parallel={tensor_parallel} must divide num_key_value_heads={num_kv_heads}")
    return {"num_query_groups": num_kv_heads,
            "kv_channels": hf_config.get("head_dim", hf_config["hidden_size"] // num_heads),
            "add_qkv_bias": family == "mimo" or hf_config.get("attention_bias", False),
            "qk_layernorm": hf_config.get("use_qk_norm", False)}


def transformer_config(hf_config, *, mtp=True, tensor_parallel=1, context_parallel=1, expert_parallel=1,
                       pipeline_parallel=1, sequence_parallel=None, params_dtype=torch.float32, recompute=False,
                       mtp_loss_scaling_factor=DEFAULT_MTP_LOSS_SCALING_FACTOR, **overrides):
    """megatron-core `TransformerConfig` (an `MLATransformerConfig` for DeepSeek) for a HF config dict.

    sequence_parallel: None is on where megatron-core needs it, for MoE layers under tensor
    parallelism (their token dispatcher splits the sequence over the TP ranks: without it
    every rank routes every token and the experts' gradients come out TP-fold).
    pipeline_parallel: stages of num_hidden_layers / pipeline_parallel layers each (`_with_stages`).
    """
    family = model_family(hf_config)
    refuse_unsupported_fields(hf_config)
    if expert_parallel > 1 and family in DENSE_FAMILIES:
        name = {"mimo": "MiMo", "qwen3.5": "Qwen3.5"}[family]
        raise ValueError(f"expert_parallel={expert_parallel}: the {name} model has no experts; expected 1")
    if sequence_parallel is None:
        sequence_parallel = family not in DENSE_FAMILIES
    if family not in DENSE_FAMILIES and tensor_parallel > 1 and not sequence_parallel:
        raise ValueError(f"sequence_parallel=False at tensor_parallel={tensor_parallel}: {family}'s MoE layers "
                         "train under tensor parallelism only with sequence parallelism; leave it None")
    fields = {
        "num_layers": hf_config["num_hidden_layers"],
        "hidden_size": hf_config["hidden_size"],
        "ffn_hidden_size": hf_config["intermediate_size"],
        "num_attention_heads": hf_config["num_attention_heads"],
        "normalization": "RMSNorm",
        "layernorm_epsilon": hf_config.get("rms_norm_eps", 1e-6),
        "gated_linear_unit": True,
        "activation_func": F.silu,
        "add_bias_linear": False,
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
        "tensor_model_parallel_size": tensor_parallel,
        "context_parallel_size": context_parallel,
        "sequence_parallel": sequence_parallel and tensor_parallel > 1,
        "params_dtype": params_dtype,
        "bf16": params_dtype == torch.bfloat16,
        "use_cpu_initialization": not torch.cuda.is_available(),
        # Fusions need CUDA kernels; the unfused paths are exact on every device.
        **dict.fromkeys(("bias_activation_fusion", "bias_dropout_fusion", "masked_softmax_fusion", "persist_layer_norm",
                         "apply_rope_fusion", "gradient_accumulation_fusion"), False),
        "mtp_num_layers": mtp_layer_count(hf_config) if mtp else None,
        "mtp_loss_scaling_factor": mtp_loss_scaling_factor,
    }
    fields.update(_attention_fields(hf_config, family, tensor_parallel))
    if family == "qwen3.5":
        fields.update(_qwen35_fields(hf_config, tensor_parallel, context_parallel))
    if family not in DENSE_FAMILIES:
        fields.update(_moe_fields(hf_config, expert_parallel))
    if mtp and not fields["mtp_num_layers"]:
        fields["mtp_num_layers"] = None
    if recompute:
        fields.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    fields.update(_pipeline_fields(hf_config, pipeline_parallel, params_dtype))
    config_class = MLATransformerConfig if family == "deepseek" else TransformerConfig
    return _with_stages(_with_overrides(config_class, fields, overrides), pipeline_parallel)


def _pipeline_fields(hf_config, pipeline_parallel, params_dtype):
    """TransformerConfig fields of `pipeline_parallel` stages ({} for one): layers split
    evenly, the MTP layers on the last stage (megatron-core's placement without a custom
    layout); ValueError where the stages do not divide the layers."""
    if pipeline_parallel == 1:
        return {}
    num_layers = hf_config["num_hidden_layers"]
    if num_layers % pipeline_parallel:
        raise ValueError(f"pipeline_parallel={pipeline_parallel} must divide num_hidden_layers={num_layers} "
                         "(every stage holds as many layers)")
    return {"pipeline_model_parallel_size": pipeline_parallel, "pipeline_dtype": params_dtype}


def _with_stages(config, pipeline_parallel):
    """`config`, which under pipeline parallelism sends the shape of each hidden state ahead
    of it between stages: packed micro-batches differ in length (`variable_seq_lengths`).
    Set after construction: the config's check refuses the flag beside megatron's all-gather
    MoE dispatcher (set for dense models, and for MoE ones without expert parallelism), whose
    all-gather there spans the TP ranks of one micro-batch, as long with stages as without."""
    if pipeline_parallel > 1:
        config.variable_seq_lengths = True
    return config


def _with_overrides(config_class, fields, overrides):
    """config_class(**fields) with the caller's `overrides` on top, each of which must be a
    field of config_class in this megatron-core release."""
    known = {field.name for field in dataclasses.fields(config_class)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ValueError(f"{unknown} are not {config_class.__name__} fields in this megatron-core release")
    fields.update(overrides)
    # Our own defaults that an older release does not know are left out.
    return config_class(**{name: value for name, value in fields.items() if name in known})


def transformer_engine_usable():
    """True when Transformer Engine imports and a GPU is present (its attention needs CUDA)."""
    if not torch.cuda.is_available():
        return False
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def layer_spec_for(attention, config=None):
    """The decoder's layer spec for attention "te", "thd" or "local".

    "te": Transformer Engine's spec. "thd": megatron's local spec with
    `ContextParallelTHDAttention` (packed THD and context parallelism on any device).
    "local": megatron's local spec unchanged (bshd only, CP 1: the independent reference
    the tests compare against). With an MoE `config` (DeepSeek, GLM) a block spec: one
    layer spec per layer, dense or MoE as `config.moe_layer_freq` says.
    """
    if attention not in ("te", "thd", "local"):
        raise ValueError(f"attention={attention!r}; expected 'te', 'thd' or 'local'")
    if config is not None and _gated_delta_net(config):
        return _qwen35_block_spec(attention, config)
    moe = config is not None and config.num_moe_experts
    if moe:
        spec = gpt_layer_specs.get_gpt_decoder_block_spec(config, use_transformer_engine=attention == "te",
                                                          normalization="RMSNorm")
        layer_specs = spec.layer_specs
    elif attention == "te":
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec()
    else:
        spec = gpt_layer_specs.get_gpt_layer_local_spec(normalization="RMSNorm")
        layer_specs = [spec]
    if attention == "thd":
        # Imported here: a Transformer Engine user copies this module without cp_attention.
        from cp_attention import ContextParallelTHDAttention
        for layer_spec in layer_specs:
            layer_spec.submodules.self_attention.submodules.core_attention = ContextParallelTHDAttention
        if config is not None and config.sequence_parallel:
            _for_sequence_parallel(spec)
    return spec


class SequenceParallelRMSNorm(torch.nn.RMSNorm):
    """torch's RMSNorm in a megatron-core norm slot, under sequence parallelism too.

    The local spec's torch-norm wrapper (megatron's choice without apex or Transformer
    Engine) refuses sequence parallelism outright. Under it each tensor-parallel rank
    normalises its own slice of the sequence, so the weight's gradient on a rank is a
    partial sum: the weight is marked `sequence_parallel`, as Transformer Engine's norms
    are, and `trainer.sum_tensor_parallel_partial_grads` (megatron-core's
    `finalize_model_grads` likewise) sums it over the TP group. Input [..., hidden], any
    float dtype; output the same shape and dtype.
    """

    def __init__(self, config, hidden_size, eps=1e-5, **unused_norm_options):
        if config.normalization != "RMSNorm":
            raise ValueError(f"normalization={config.normalization!r}; SequenceParallelRMSNorm is RMSNorm")
        super().__init__(hidden_size, eps=eps)
        self.weight.sequence_parallel = config.sequence_parallel


class ReplicatedLinear(torch.nn.Linear):
    """A linear layer every tensor-parallel rank holds whole: MLA's q and kv down
    projections under sequence parallelism (Transformer Engine's "duplicated" mode).

    megatron-core's local spec builds them column-parallel and gathers their outputs; the
    gather's backward keeps each rank's own columns, which drops the other ranks' share
    of the gradient of the rotary key part that every head reads (9e-3 relative error at
    TP 2). Whole, each rank projects its own slice of the sequence and MLA all-gathers the
    rotary part with a backward that sums. The weight's gradient is then a partial sum:
    marked `sequence_parallel` like the norms. forward(x [..., in]) -> (x @ W.T [..., out],
    None), megatron's (output, bias) pair.
    """

    def __init__(self, input_size, output_size, *, config, init_method, bias=False, **unused_linear_options):
        super().__init__(input_size, output_size, bias=bias, dtype=config.params_dtype)
        with torch.no_grad():
            init_method(self.weight)
        for param in self.parameters():
            param.sequence_parallel = config.sequence_parallel

    def forward(self, hidden_states):
        return super().forward(hidden_states), None


class ZeroCenteredRMSNorm(torch.nn.Module):
    """Qwen3.5's RMSNorm in a megatron-core norm slot: x / rms(x) * (1 + weight), in fp32.

    The weight is stored as the checkpoint stores it (0 for a scale of 1), so weights move
    between HF and Megatron unchanged, bit for bit. (megatron's own
    `layernorm_zero_centered_gamma` would also reach the gated DeltaNet's output norm, which
    scales by its weight alone.) Input [..., hidden], any float dtype; output the same.
    """

    def __init__(self, config, hidden_size, eps=1e-6, **unused_norm_options):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype))
        self.weight.sequence_parallel = config.sequence_parallel

    def forward(self, hidden_states):
        x = hidden_states.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x * (1.0 + self.weight.float())).type_as(hidden_states)


def _gated_delta_net(config):
    """Whether `config` builds Qwen3.5's gated-DeltaNet layers (a field megatron-core < 0.16 lacks)."""
    return getattr(config, "experimental_attention_variant", None) == "gated_delta_net"


def _qwen35_layer_spec(attention, layer_type):
    """One Qwen3.5 decoder layer on megatron's local spec: gated DeltaNet (gdn_thd.py) or
    full attention with q/k norms (packed THD core attention unless `attention` is
    "local"), SwiGLU, every norm zero-centred but the DeltaNet's gated output norm."""
    from megatron.core.ssm.gated_delta_net import GatedDeltaNetSubmodules
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    spec = gpt_layer_specs.get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm")
    _zero_centred_norms(spec)
    if layer_type == "linear_attention":
        # Imported here, as cp_attention is: the other families never need it.
        from gdn_thd import PackedGatedDeltaNet
        spec.submodules.self_attention = ModuleSpec(module=PackedGatedDeltaNet, submodules=GatedDeltaNetSubmodules(
            in_proj=ColumnParallelLinear, out_norm=WrappedTorchNorm, out_proj=RowParallelLinear))
    elif attention == "thd":
        from cp_attention import ContextParallelTHDAttention
        spec.submodules.self_attention.submodules.core_attention = ContextParallelTHDAttention
    return spec


def _qwen35_block_spec(attention, config):
    """Qwen3.5's decoder: one layer spec per layer as `config.linear_attention_freq` says
    (1 gated DeltaNet, 0 full attention), a zero-centred final norm."""
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
    if attention == "te":
        raise ValueError("attention='te': Qwen3.5's layers are built on megatron's local spec only (gated "
                         "DeltaNet from gdn_thd.py); expected 'thd' or 'local'")
    return TransformerBlockSubmodules(
        layer_specs=[_qwen35_layer_spec(attention, ("full_attention", "linear_attention")[linear])
                     for linear in config.linear_attention_freq],
        layer_norm=ZeroCenteredRMSNorm)


def _swap_modules(spec, swap):
    """In place, through ModuleSpecs and their submodule dataclasses (block, layer,
    attention, MTP): each field whose name or class `swap` maps gets the mapped class."""
    from megatron.core.transformer.spec_utils import ModuleSpec
    if isinstance(spec, ModuleSpec):
        _swap_modules(spec.submodules, swap)
    elif isinstance(spec, (list, tuple)):
        for item in spec:
            _swap_modules(item, swap)
    elif dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        for field in dataclasses.fields(spec):
            value = getattr(spec, field.name)
            new = swap.get(field.name) or (swap.get(value) if isinstance(value, type) else None)
            if new is not None:
                setattr(spec, field.name, new)
            else:
                _swap_modules(value, swap)


def _zero_centred_norms(spec):
    """Every torch norm of a local spec (MTP's too) becomes `ZeroCenteredRMSNorm`, in place."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    _swap_modules(spec, {WrappedTorchNorm: ZeroCenteredRMSNorm})


def _for_sequence_parallel(spec):
    """Make a local (thd) spec runnable under sequence parallelism, in place: every torch
    norm becomes `SequenceParallelRMSNorm`, every MLA down projection `ReplicatedLinear`."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    _swap_modules(spec, {WrappedTorchNorm: SequenceParallelRMSNorm, **dict.fromkeys(MLA_DOWN_PROJECTIONS,
                                                                                     ReplicatedLinear)})


def _moe_and_mla_know_transformer_engine_is_absent():
    """Without Transformer Engine, megatron-core 0.16's MoE and MLA modules break on import
    details: MLA takes TE to be present because TE's extension module imports (its classes
    are then placeholders) and fails in isinstance(); the MoE utilities' import of TE names
    stops before `te_general_gemm`, which the router then reads (NameError). Tell both what
    the extension module knows; with TE installed nothing changes."""
    from megatron.core.extensions import transformer_engine as te_extension
    from megatron.core.transformer import multi_latent_attention
    from megatron.core.transformer.moe import moe_utils
    if getattr(te_extension, "HAVE_TE", True):
        return
    if hasattr(multi_latent_attention, "HAVE_TE"):
        multi_latent_attention.HAVE_TE = False
    # MLA accepts a whole (non-parallel) down projection only as the `Linear` it imports
    # beside TE's placeholders (modelopt's, which no norm or gradient rule knows):
    # ReplicatedLinear is that layer here.
    if hasattr(multi_latent_attention, "Linear"):
        multi_latent_attention.Linear = ReplicatedLinear
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def build_gpt_model(model, *, mtp=True, attention="auto", **config_options):
    """A `GPTModel` with the architecture of `model` (dir, config.json or dict): MiMo, DeepSeek-V3, GLM-4.5 or Qwen3.5.

    Weights are megatron's random init, on the current GPU when there is one; load real ones
    with hf_weights.py. `attention`:
    "auto" is Transformer Engine where usable, else "thd" (see `layer_spec_for`); `config_options` go to
    `transformer_config` (tensor_parallel, context_parallel, expert_parallel, pipeline_parallel,
    params_dtype, recompute, ...). With pipeline_parallel > 1 (megatron's groups initialised
    with it) this rank's stage: its layers (`decoder.layers.{i}` numbered from 0 on every
    stage), the embedding on the first stage, final norm, output layer and MTP layers on the
    last, which also holds a copy of the word embeddings for its MTP layers (megatron ties
    the two copies: equal at construction, their gradients summed over the embedding group).
    """
    hf_config = load_hf_config(model)
    if attention == "auto":
        qwen35 = model_family(hf_config) == "qwen3.5"
        attention = "te" if transformer_engine_usable() and not qwen35 else "thd"
    config = transformer_config(hf_config, mtp=mtp, **config_options)
    if config.multi_latent_attention or config.num_moe_experts:
        _moe_and_mla_know_transformer_engine_is_absent()
    layer_spec = layer_spec_for(attention, config)
    mtp_block_spec = None
    if config.mtp_num_layers:
        # Qwen3.5's MTP layer is a full-attention layer, whatever the decoder's last one is.
        qwen35 = _gated_delta_net(config)
        mtp_block_spec = gpt_layer_specs.get_gpt_mtp_block_spec(
            config, _qwen35_layer_spec(attention, "full_attention") if qwen35 else layer_spec,
            use_transformer_engine=attention == "te")
        if qwen35:
            _zero_centred_norms(mtp_block_spec)
        if attention == "thd" and config.sequence_parallel:
            _for_sequence_parallel(mtp_block_spec)
    staged = config.pipeline_model_parallel_size > 1
    # The last stage's copy of the word embeddings is all-reduced from `.cuda()` as it is built.
    with cuda_on_cpu() if staged else contextlib.nullcontext():
        model = GPTModel(
            config=config,
            transformer_layer_spec=layer_spec,
            vocab_size=hf_config["vocab_size"],
            max_sequence_length=hf_config.get("max_position_embeddings", 4096),
            position_embedding_type="rope",
            rotary_percent=partial_rotary_factor(hf_config),
            rotary_base=int(rope_settings(hf_config)[0]),
            share_embeddings_and_output_weights=hf_config.get("tie_word_embeddings", False),
            mtp_block_spec=mtp_block_spec,
            pre_process=not staged or parallel_state.is_pipeline_first_stage(),
            post_process=not staged or parallel_state.is_pipeline_last_stage(),
        )
    if torch.cuda.is_available():
        # megatron puts its own layers' weights on the current GPU; torch's norms (the local
        # spec without apex) and ReplicatedLinear start on the host. All of it on the GPU.
        model.cuda(torch.cuda.current_device())
    return model
