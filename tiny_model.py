"""Tiny MiMo-style checkpoint: a Qwen2 decoder plus multi-token-prediction (MTP) layers.

MiMo is the smallest architecture that both megatron-core's GPT+MTP and vLLM's MTP
drafting support exactly, and vLLM loads it from a plain Hugging Face directory with no
remote code. This module writes such a directory with seeded random weights and a
character-level tokenizer, so tests and the default `train_grpo.py` run need no download
and take the same loading path a real checkpoint takes.

    python tiny_model.py --out runs/tiny-mimo

Imports only torch, the standard library, and safetensors/tokenizers (both come with vLLM).
"""

import argparse
import json
import os
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
# The built-in models, as `mimo_config` keywords. "tiny" (2 decoder layers, the defaults)
# trains in seconds per step. "deep" stacks 16 thin layers against the one MTP layer: a
# draft then costs a small part of a target step, which is what makes MTP drafting pay
# (with 2 layers a draft costs half a target step and drafting slows decoding down).
BUILTIN_SIZES = {
    "tiny": {},
    "deep": {"hidden_size": 128, "num_layers": 16, "num_heads": 2, "num_kv_heads": 1, "ffn_hidden_size": 512},
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


def mimo_config(hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=64,
                ffn_hidden_size=512, num_mtp_layers=1, vocab_size=VOCAB_SIZE,
                max_position_embeddings=1024, rope_theta=10000.0, rms_norm_eps=1e-6):
    """The config.json dict vLLM reads as MiMoForCausalLM (model_type qwen2)."""
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}")
    if vocab_size < len(tokenizer_vocab()):
        raise ValueError(f"vocab_size={vocab_size} is smaller than the tokenizer's {len(tokenizer_vocab())} tokens")
    vocab = tokenizer_vocab()
    return {
        "architectures": ["MiMoForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": hidden_size,
        "intermediate_size": ffn_hidden_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "num_nextn_predict_layers": num_mtp_layers,
        "vocab_size": vocab_size,
        "max_position_embeddings": max_position_embeddings,
        "rope_theta": rope_theta,
        "rms_norm_eps": rms_norm_eps,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "bos_token_id": vocab[BOS_TOKEN],
        "eos_token_id": vocab[EOS_TOKEN],
        "pad_token_id": vocab[PAD_TOKEN],
        "torch_dtype": "float32",
    }


def decoder_layer_weights(prefix, config, generator, init_std):
    """Qwen2 decoder layer tensors under `prefix` (qkv carry a bias, o_proj does not)."""
    hidden, ffn = config["hidden_size"], config["intermediate_size"]
    q_size = config["num_attention_heads"] * config["head_dim"]
    kv_size = config["num_key_value_heads"] * config["head_dim"]

    def normal(*shape):
        return torch.randn(*shape, generator=generator) * init_std

    return {
        f"{prefix}.input_layernorm.weight": torch.ones(hidden),
        f"{prefix}.self_attn.q_proj.weight": normal(q_size, hidden),
        f"{prefix}.self_attn.q_proj.bias": normal(q_size),
        f"{prefix}.self_attn.k_proj.weight": normal(kv_size, hidden),
        f"{prefix}.self_attn.k_proj.bias": normal(kv_size),
        f"{prefix}.self_attn.v_proj.weight": normal(kv_size, hidden),
        f"{prefix}.self_attn.v_proj.bias": normal(kv_size),
        f"{prefix}.self_attn.o_proj.weight": normal(hidden, q_size),
        f"{prefix}.post_attention_layernorm.weight": torch.ones(hidden),
        f"{prefix}.mlp.gate_proj.weight": normal(ffn, hidden),
        f"{prefix}.mlp.up_proj.weight": normal(ffn, hidden),
        f"{prefix}.mlp.down_proj.weight": normal(hidden, ffn),
    }


def mimo_weights(config, seed=0, init_std=0.02):
    """Seeded random MiMo state dict in Hugging Face naming, MTP layers included (fp32)."""
    generator = torch.Generator().manual_seed(seed)
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    weights = {
        "model.embed_tokens.weight": torch.randn(vocab, hidden, generator=generator) * init_std,
        "model.norm.weight": torch.ones(hidden),
        "lm_head.weight": torch.randn(vocab, hidden, generator=generator) * init_std,
    }
    for layer in range(config["num_hidden_layers"]):
        weights.update(decoder_layer_weights(f"model.layers.{layer}", config, generator, init_std))
    for layer in range(config["num_nextn_predict_layers"]):
        prefix = f"model.mtp_layers.{layer}"
        weights.update(decoder_layer_weights(prefix, config, generator, init_std))
        weights[f"{prefix}.token_layernorm.weight"] = torch.ones(hidden)
        weights[f"{prefix}.hidden_layernorm.weight"] = torch.ones(hidden)
        # input_proj acts on cat(hidden, embedding): [hidden, 2 * hidden].
        weights[f"{prefix}.input_proj.weight"] = torch.randn(hidden, 2 * hidden, generator=generator) * init_std
        weights[f"{prefix}.final_layernorm.weight"] = torch.ones(hidden)
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


def build_tiny_mimo(out_dir, seed=0, **sizes):
    """Write a tiny MiMo checkpoint to `out_dir` and return the path.

    `sizes` are `mimo_config` keywords (hidden_size, num_layers, num_heads, num_kv_heads,
    head_dim, ffn_hidden_size, num_mtp_layers, vocab_size, max_position_embeddings, ...).
    Skips the work when `out_dir` already holds a checkpoint written with the same config
    and seed, so callers can use it as a cache.
    """
    config = mimo_config(**sizes)
    # The tokenizer's config is in the stamp too: a cache written before a change to it
    # (the chat template, say) is rewritten.
    stamp = {"config": config, "tokenizer": tokenizer_config(config["max_position_embeddings"]), "seed": seed}
    stamp_path = os.path.join(out_dir, "tiny_model_stamp.json")
    if os.path.exists(stamp_path):
        with open(stamp_path) as f:
            if json.load(f) == stamp:
                return out_dir
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    write_tokenizer(out_dir, config["max_position_embeddings"])
    weights = mimo_weights(config, seed=seed)
    save_file({name: tensor.contiguous() for name, tensor in weights.items()},
              os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    # The stamp goes last: an interrupted write is never mistaken for a finished one.
    with open(stamp_path, "w") as f:
        json.dump(stamp, f, indent=2)
    return out_dir


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="runs/tiny-mimo", help="directory to write the checkpoint into")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    parser.add_argument("--builtin", choices=sorted(BUILTIN_SIZES), default="tiny",
                        help="start from this built-in model's sizes; the flags below override them")
    parser.add_argument("--hidden-size", type=int, default=None, help="model width (tiny: 256)")
    parser.add_argument("--num-layers", type=int, default=None, help="decoder layers (tiny: 2)")
    parser.add_argument("--num-heads", type=int, default=None, help="attention heads (tiny: 4)")
    parser.add_argument("--num-kv-heads", type=int, default=None,
                        help="key/value heads (GQA); tensor parallel size must divide it (tiny: 2)")
    parser.add_argument("--head-dim", type=int, default=None, help="size of one head; vLLM-CPU rejects 16 (tiny: 64)")
    parser.add_argument("--ffn-hidden-size", type=int, default=None, help="SwiGLU inner width (tiny: 512)")
    parser.add_argument("--num-mtp-layers", type=int, default=None, help="multi-token-prediction layers (tiny: 1)")
    args = parser.parse_args()
    overrides = {name: value for name, value in vars(args).items()
                 if name not in ("out", "seed", "builtin") and value is not None}
    path = build_tiny_mimo(args.out, seed=args.seed, **{**BUILTIN_SIZES[args.builtin], **overrides})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
