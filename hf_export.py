"""A Megatron model written out as a Hugging Face checkpoint directory: the tensors
hf_weights.megatron_to_hf gathers, saved as `model.safetensors` beside the source
checkpoint's config and tokenizer, published whole.

    save_hf_checkpoint(model, "ckpt/", "out/")  # every rank calls it; rank 0 writes
    copy_hf_metadata("ckpt/", "out/")           # the config and tokenizer files alone

The directory loads in vLLM and transformers like the source. It is written beside its
place and renamed into it, so a reader never sees it half written, and a write that fails
(a full disk) leaves nothing behind and is an ExportError on every rank. The config.json
copied drops `quantization_config`: the tensors are the trainer's (bf16 or fp32), never FP8.

Imports torch, the standard library, safetensors and hf_weights.
"""

import json
import os
import shutil

import torch.distributed as dist
from safetensors import SafetensorError
from safetensors.torch import save_file

from hf_weights import megatron_to_hf

# The files of a HF checkpoint directory that are not weights; copied as they are on save.
HF_METADATA_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                     "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt",
                     "tokenizer.model", "chat_template.jinja")
SAFETENSORS_FILE = "model.safetensors"


def save_hf_checkpoint(model, source_dir, out_dir):
    """Write the megatron model as a HF directory: `model.safetensors` plus `source_dir`'s config and tokenizer.

    Call on every rank (tensor-parallel shards are gathered); global rank 0 writes, the
    others wait until it has. The result loads in vLLM and transformers like the source
    checkpoint. It is written beside `out_dir` and renamed into place whole, so `out_dir`
    is never half written, with the files' permissions the umask gives. Returns `out_dir`;
    a write that fails (a full disk) leaves no `.partial` and is an ExportError on every rank.
    """
    writes = not dist.is_initialized() or dist.get_rank() == 0
    tensors = {}
    for name, tensor in megatron_to_hf(model):  # every rank takes part in the gathers
        if writes:
            tensors[name] = tensor.to("cpu", copy=True).contiguous()
    problem = None
    if writes:
        staging = out_dir.rstrip("/") + ".partial"
        try:
            shutil.rmtree(staging, ignore_errors=True)
            os.makedirs(staging)
            copy_hf_metadata(source_dir, staging)
            save_file(tensors, os.path.join(staging, SAFETENSORS_FILE), metadata={"format": "pt"})
            _publish(staging, out_dir)
        except (OSError, SafetensorError) as error:  # safetensors reports a full disk as its own error
            shutil.rmtree(staging, ignore_errors=True)
            problem = f"{out_dir} could not be written ({error}); nothing of it was left behind"
    if dist.is_initialized():
        # Rank 0's verdict reaches every rank (it also waits for rank 0's write, as a barrier would).
        holder = [problem]
        dist.broadcast_object_list(holder, src=0)
        problem = holder[0]
    if problem:
        raise ExportError(problem)
    return out_dir


class ExportError(OSError):
    """A HF export that could not be written (a full disk), named with why; its folder is as it was."""


def copy_hf_metadata(source_dir, out_dir):
    """Copy `source_dir`'s config and tokenizer files into `out_dir`, config.json without its
    `quantization_config`: the tensors written beside it are the trainer's (bf16 or fp32),
    never FP8. vLLM built from such a copy creates unquantized layers (train_grpo's engines
    for an FP8 checkpoint: load_format "dummy", then Megatron's dequantized weights pushed)."""
    config_path = os.path.join(source_dir, "config.json")
    config = {}
    if os.path.exists(config_path):
        with open(config_path) as f:
            config = json.load(f)
    # The remote code auto_map names (MiMo's configuration_mimo.py, ...): without it, a
    # published config with a model_type only that code defines does not load.
    # A reference is "module.Class", "repo--module.Class", or a list of them (tokenizers).
    references = [reference for value in config.get("auto_map", {}).values()
                  for reference in (value if isinstance(value, list) else [value]) if reference]
    remote_code = {reference.split("--")[-1].rsplit(".", 1)[0] + ".py" for reference in references}
    for file_name in (*HF_METADATA_FILES, *sorted(remote_code)):
        source = os.path.join(source_dir, file_name)
        if os.path.exists(source):
            shutil.copyfile(source, os.path.join(out_dir, file_name))
    if config.pop("quantization_config", None) is not None:
        with open(os.path.join(out_dir, "config.json"), "w") as f:
            json.dump(config, f, indent=2)


def _publish(staging, out_dir):
    """Move the finished `staging` folder to `out_dir` (replacing an earlier one only once the
    new one is whole), every file readable as the umask allows: safetensors writes its file
    owner-only, as a temporary file."""
    umask = os.umask(0)
    os.umask(umask)
    for name in os.listdir(staging):
        os.chmod(os.path.join(staging, name), 0o666 & ~umask)
    earlier = out_dir.rstrip("/") + ".old"
    if os.path.exists(out_dir):
        shutil.rmtree(earlier, ignore_errors=True)
        os.replace(out_dir, earlier)
    os.replace(staging, out_dir)
    shutil.rmtree(earlier, ignore_errors=True)
