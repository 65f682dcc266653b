"""The Hugging Face MTP checkpoints this project builds, read from their config.json: which
architecture is which family, how many MTP layers it declares, and whether every field is
one the builder reads, knows to be inert, or implements at the value given.

    hf_config = load_hf_config("runs/tiny-mimo")      # a dict
    model_family(hf_config)                           # "mimo", "deepseek", "glm" or "qwen3.5"
    mtp_layer_count(hf_config)                        # 1
    refuse_unsupported_fields(hf_config)              # ValueError naming each field it would not honour

megatron_model.py builds from these configs, flag_checks.py and flags.py read them before
any model is built; hf_weights.py maps the same families' tensor names. Imports the
standard library only.
"""

import json
import os

# The Hugging Face architectures this builder (and hf_weights' name map) reproduces.
SUPPORTED_ARCHITECTURES = ("MiMoForCausalLM", "DeepseekV3ForCausalLM", "Glm4MoeForCausalLM", "Qwen3_5ForCausalLM")
FAMILIES = dict(zip(SUPPORTED_ARCHITECTURES, ("mimo", "deepseek", "glm", "qwen3.5")))
# The families without experts.
DENSE_FAMILIES = ("mimo", "qwen3.5")


def load_hf_config(model):
    """A HF config as a dict, from a checkpoint directory, a config.json path, or a dict."""
    if isinstance(model, dict):
        return model
    path = os.path.join(model, "config.json") if os.path.isdir(model) else model
    if not os.path.exists(path):
        raise FileNotFoundError(f"no config.json at {path!r}: expected a Hugging Face checkpoint directory")
    with open(path) as f:
        return json.load(f)


def model_family(hf_config):
    """"mimo", "deepseek", "glm" or "qwen3.5" for a HF config dict; ValueError naming the architectures we build."""
    architectures = hf_config.get("architectures") or []
    for architecture in architectures:
        if architecture in FAMILIES:
            return FAMILIES[architecture]
    raise ValueError(f"architecture {', '.join(architectures) or '(none in config.json)'} is not one this project "
                     f"builds; expected {', '.join(SUPPORTED_ARCHITECTURES)}")


def mtp_layer_count(hf_config):
    """The MTP layers a HF config declares: num_nextn_predict_layers (MiMo, DeepSeek-V3,
    GLM), else mtp_num_hidden_layers (Qwen3.5's MTP block); 0 without."""
    return hf_config.get("num_nextn_predict_layers", hf_config.get("mtp_num_hidden_layers", 0))


# Every config.json field of the published MiMo, DeepSeek-V3 and GLM-4.5 checkpoints is
# either built from (read by `transformer_config`), or has no effect on training
# (`INERT_FIELDS`), or is checked against what this builder does (`FIELD_VALUES`). Any other
# field is refused by name: ignored, it could silently change the model.
READ_FIELDS = {
    "architectures", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "intermediate_size", "vocab_size", "max_position_embeddings", "rope_theta", "rms_norm_eps",
    "tie_word_embeddings", "num_nextn_predict_layers", "partial_rotary_factor", "use_qk_norm", "attention_bias",
    "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_routed_experts",
    "n_shared_experts", "num_experts_per_tok", "moe_intermediate_size", "routed_scaling_factor", "n_group",
    "topk_group", "first_k_dense_replace", "rope_scaling", "rope_parameters", "quantization_config",
    "layer_types", "full_attention_interval", "linear_conv_kernel_dim", "linear_key_head_dim",
    "linear_value_head_dim", "linear_num_key_heads", "linear_num_value_heads", "mtp_num_hidden_layers"}
# Metadata, inference settings (caching, expert placement, the sliding window's extent when
# it is off, the dtype an inference engine keeps gated-DeltaNet states in) and pretraining's
# load-balancing loss, which RL leaves off (see the docstring).
INERT_FIELDS = {
    "model_type", "auto_map", "transformers_version", "torch_dtype", "dtype", "use_cache", "bos_token_id",
    "eos_token_id", "pad_token_id", "initializer_range", "pretraining_tp", "ep_size", "aux_loss_alpha", "seq_aux",
    "sliding_window", "max_window_layers", "mamba_ssm_dtype"}
# field -> (the values this builder implements, as said in a refusal). Absent is the default.
FIELD_VALUES = {
    "hidden_act": (("silu",), "SwiGLU with silu"),
    "attention_dropout": ((0, 0.0), "no dropout"),
    "use_sliding_window": ((False,), "full attention in every layer"),
    "mlp_bias": ((False,), "MLPs without bias"),
    "scoring_func": (("sigmoid",), "megatron's sigmoid router"),
    "topk_method": (("noaux_tc",), "top-k by score plus e_score_correction_bias, group-limited"),
    "norm_topk_prob": ((True,), "top-k weights normalised to sum 1"),
    "moe_layer_freq": ((1,), "every layer from first_k_dense_replace on an MoE layer"),
    "rope_interleave": ((True,), "DeepSeek's interleaved rotary layout"),
    "attn_output_gate": ((True,), "Qwen3.5's gated full attention, the one transformers and vLLM build"),
    "mtp_use_dedicated_embeddings": ((False,), "an MTP block that shares the main model's embedding"),
}
# quantization_config fields of the FP8 block-quantized checkpoints hf_weights.py dequantizes.
FP8_BLOCK_QUANTIZATION = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}


def unsupported_fields(hf_config):
    """Every config.json field this builder would not honour, one line each naming the field,
    its value and what is supported; [] when it builds the config as it says."""
    problems = [f"{field}={hf_config[field]!r}: not a field this project reads or knows to be inert; expected the "
                f"fields of the published {', '.join(SUPPORTED_ARCHITECTURES)} configs"
                for field in sorted(set(hf_config) - READ_FIELDS - INERT_FIELDS - set(FIELD_VALUES))
                if not field.startswith("_")]
    for field, (values, meaning) in FIELD_VALUES.items():
        if field in hf_config and hf_config[field] not in values:
            problems.append(f"{field}={hf_config[field]!r}: this project builds {meaning}; expected "
                            f"{' or '.join(repr(value) for value in values)}")
    quantization = hf_config.get("quantization_config") or {}
    for field, expected in FP8_BLOCK_QUANTIZATION.items():
        if quantization and quantization.get(field, expected) != expected:
            problems.append(f"quantization_config.{field}={quantization.get(field)!r}: FP8 block-quantized "
                            f"weights are read (hf_weights.py); expected {field} {expected!r}")
    return problems


def refuse_unsupported_fields(hf_config):
    """ValueError listing `unsupported_fields`, before anything is built; None when there are none."""
    problems = unsupported_fields(hf_config)
    if problems:
        raise ValueError("config.json has fields this project does not implement:\n  " + "\n  ".join(problems))
