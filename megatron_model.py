"""Build a megatron-core GPTModel for a MiMo-style Hugging Face config (Qwen2 + MTP).

One builder for everything that needs the policy as a Megatron model: `train_grpo.py`,
the tests and the benchmarks. The config maps one to one:

    RMSNorm, SwiGLU (gated linear unit, silu), RoPE (rope_theta), bias on q/k/v only,
    grouped-query attention (num_key_value_heads), untied output layer, and
    `num_nextn_predict_layers` MTP layers.

    model = build_gpt_model("runs/tiny-mimo", mtp=True)

megatron-core's parallel state must be initialised first (see cpu_backend.py). Written to
construct on megatron-core 0.14 - 0.19: config fields a release does not know are left out.
"""

import dataclasses
import json
import os

import torch
import torch.nn.functional as F
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt import gpt_layer_specs
from megatron.core.transformer import TransformerConfig


# The MTP loss is added to the LM loss with this weight (divided by the number of MTP
# layers). Set explicitly: up to megatron-core 0.15 the default is None and the MTP loss
# divides by it.
DEFAULT_MTP_LOSS_SCALING_FACTOR = 0.1
# The Hugging Face architectures this builder (and weight_sync's name map) reproduces.
SUPPORTED_ARCHITECTURES = ("MiMoForCausalLM",)


def load_hf_config(model):
    """A HF config as a dict, from a checkpoint directory, a config.json path, or a dict."""
    if isinstance(model, dict):
        return model
    path = os.path.join(model, "config.json") if os.path.isdir(model) else model
    if not os.path.exists(path):
        raise FileNotFoundError(f"no config.json at {path!r}: expected a Hugging Face checkpoint directory")
    with open(path) as f:
        return json.load(f)


def transformer_config(hf_config, *, mtp=True, tensor_parallel=1, context_parallel=1, sequence_parallel=False,
                       params_dtype=torch.float32, recompute=False,
                       mtp_loss_scaling_factor=DEFAULT_MTP_LOSS_SCALING_FACTOR, **overrides):
    """megatron-core `TransformerConfig` for a MiMo/Qwen2 HF config dict."""
    num_heads = hf_config["num_attention_heads"]
    num_kv_heads = hf_config.get("num_key_value_heads", num_heads)
    # megatron-core splits whole query groups across tensor-parallel ranks; with fewer KV
    # heads than ranks some releases build the model anyway and produce garbage gradients.
    if num_kv_heads % tensor_parallel:
        raise ValueError(f"tensor_parallel={tensor_parallel} must divide num_key_value_heads={num_kv_heads}")
    fields = {
        "num_layers": hf_config["num_hidden_layers"],
        "hidden_size": hf_config["hidden_size"],
        "ffn_hidden_size": hf_config["intermediate_size"],
        "num_attention_heads": num_heads,
        "num_query_groups": num_kv_heads,
        "kv_channels": hf_config.get("head_dim", hf_config["hidden_size"] // num_heads),
        "normalization": "RMSNorm",
        "layernorm_epsilon": hf_config.get("rms_norm_eps", 1e-6),
        "gated_linear_unit": True,
        "activation_func": F.silu,
        "add_bias_linear": False,
        "add_qkv_bias": True,
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
        "tensor_model_parallel_size": tensor_parallel,
        "context_parallel_size": context_parallel,
        "sequence_parallel": sequence_parallel and tensor_parallel > 1,
        "params_dtype": params_dtype,
        "bf16": params_dtype == torch.bfloat16,
        "use_cpu_initialization": not torch.cuda.is_available(),
        # Fusions need CUDA kernels; the unfused paths are exact on every device.
        "bias_activation_fusion": False,
        "bias_dropout_fusion": False,
        "masked_softmax_fusion": False,
        "persist_layer_norm": False,
        "apply_rope_fusion": False,
        "gradient_accumulation_fusion": False,
        "mtp_num_layers": hf_config.get("num_nextn_predict_layers", 0) if mtp else None,
        "mtp_loss_scaling_factor": mtp_loss_scaling_factor,
    }
    if mtp and not fields["mtp_num_layers"]:
        fields["mtp_num_layers"] = None
    if recompute:
        fields.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    known = {field.name for field in dataclasses.fields(TransformerConfig)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ValueError(f"{unknown} are not TransformerConfig fields in this megatron-core release")
    fields.update(overrides)
    # Our own defaults that an older release does not know are left out.
    return TransformerConfig(**{name: value for name, value in fields.items() if name in known})


def transformer_engine_usable():
    """True when Transformer Engine imports and a GPU is present (its attention needs CUDA)."""
    if not torch.cuda.is_available():
        return False
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def layer_spec_for(attention):
    """The decoder layer spec for attention "te", "thd" or "local".

    "te": Transformer Engine's spec. "thd": megatron's local spec with
    `ContextParallelTHDAttention` (packed THD and context parallelism on any device).
    "local": megatron's local spec unchanged (bshd only, CP 1: the independent reference
    the tests compare against).
    """
    if attention == "te":
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec()
    spec = gpt_layer_specs.get_gpt_layer_local_spec(normalization="RMSNorm")
    if attention == "thd":
        # Imported here: a Transformer Engine user copies this module without cp_attention.
        from cp_attention import ContextParallelTHDAttention
        spec.submodules.self_attention.submodules.core_attention = ContextParallelTHDAttention
    elif attention != "local":
        raise ValueError(f"attention={attention!r}; expected 'te', 'thd' or 'local'")
    return spec


def build_gpt_model(model, *, mtp=True, attention="auto", **config_options):
    """A MiMo-style `GPTModel` with the architecture of `model` (dir, config.json or dict).

    Weights are megatron's random init; load real ones with weight_sync.py. `attention`:
    "auto" is Transformer Engine where usable, else "thd" (see `layer_spec_for`); `config_options` go to
    `transformer_config` (tensor_parallel, context_parallel, params_dtype, recompute, ...).
    """
    if attention == "auto":
        attention = "te" if transformer_engine_usable() else "thd"
    hf_config = load_hf_config(model)
    config = transformer_config(hf_config, mtp=mtp, **config_options)
    layer_spec = layer_spec_for(attention)
    mtp_block_spec = None
    if config.mtp_num_layers:
        mtp_block_spec = gpt_layer_specs.get_gpt_mtp_block_spec(config, layer_spec,
                                                                use_transformer_engine=attention == "te")
    return GPTModel(
        config=config,
        transformer_layer_spec=layer_spec,
        vocab_size=hf_config["vocab_size"],
        max_sequence_length=hf_config.get("max_position_embeddings", 4096),
        position_embedding_type="rope",
        rotary_base=int(hf_config.get("rope_theta", 10000)),
        share_embeddings_and_output_weights=hf_config.get("tie_word_embeddings", False),
        mtp_block_spec=mtp_block_spec,
    )
