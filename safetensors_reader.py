"""The tensors of a HF checkpoint's safetensors files, read whole or by slice.

FP8 block-quantized checkpoints (DeepSeek-V3/R1/V3.1's published weights: config.json's
`quantization_config` {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]})
are read directly: each `X.weight` stored as float8_e4m3fn beside its `X.weight_scale_inv`
(float32, one scale per 128 x 128 block, [ceil(rows/128), ceil(cols/128)]) is dequantized
on read, weight times its block's scale, in fp32 (the caller casts to its own dtype).
A reader reads only the blocks a slice touches. What DeepSeek leaves in bf16 (norms,
embedding, output layer, routers, MTP's eh_proj) has no scale and reads as stored.

Imports torch, the standard library and safetensors.
"""

import glob
import os

import torch
from safetensors import safe_open

# An FP8 weight `X.weight` keeps its per-block dequantization scales in `X.weight_scale_inv`
# (DeepSeek's name: the inverse of the scale it quantized with, so dequantizing multiplies).
SCALE_SUFFIX = "_scale_inv"
# The FP8 formats and block quantization fields this loader reads (see `fp8_block_size`).
FP8_DTYPES = {"F8_E4M3": torch.float8_e4m3fn}
FP8_QUANTIZATION = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}


def fp8_block_size(hf_config):
    """(rows, cols) of the FP8 blocks a HF config's `quantization_config` declares; None
    when it declares none. ValueError for any other quantization, naming the field: its
    weights would load as garbage. `activation_scheme` says how the checkpoint's own
    inference quantizes activations; training in bf16/fp32 needs only "dynamic" (no stored
    activation scales)."""
    quantization = hf_config.get("quantization_config")
    if not quantization:
        return None
    for field, expected in FP8_QUANTIZATION.items():
        if quantization.get(field, expected) != expected:
            raise ValueError(f"quantization_config.{field}={quantization.get(field)!r}: the loader reads FP8 "
                             f"block-quantized weights only, expected {field} {expected!r}")
    block = quantization.get("weight_block_size")
    if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ValueError(f"quantization_config.weight_block_size={block!r}: expected two positive block sides, "
                         "as DeepSeek-V3's [128, 128] (per-tensor or per-channel FP8 is not read)")
    return tuple(block)


def dequantize_fp8_blocks(weight, scale, block):
    """weight (FP8, [rows, cols]) times the scale of the block each element lies in ->
    fp32. `scale` has one entry per `block` (rows, cols) tile starting at weight[0, 0]; the
    last tiles may be cut short (ragged edges: 576 rows are 4 whole blocks and a half)."""
    rows, cols = weight.shape
    expanded = scale.float().repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    return weight.float() * expanded


class CheckpointReader:
    """The tensors of every *.safetensors file in a directory, read whole or as slices;
    FP8 block-quantized weights dequantized (fp32) when `block` (rows, cols) is given."""

    def __init__(self, hf_dir, stack, block=None):
        paths = sorted(glob.glob(os.path.join(hf_dir, "*.safetensors")))
        if not paths:
            raise FileNotFoundError(f"no *.safetensors file in {hf_dir!r}")
        self.files, self.block = {}, block
        for path in paths:
            handle = stack.enter_context(safe_open(path, framework="pt"))
            for name in handle.keys():
                self.files[name] = handle

    def shape(self, name):
        return tuple(self.files[name].get_slice(name).get_shape())

    def dtype(self, name):
        """safetensors' name of the stored dtype: "F32", "BF16", "F8_E4M3", ..."""
        return self.files[name].get_slice(name).get_dtype()

    def is_quantized(self, name):
        return self.block is not None and name + SCALE_SUFFIX in self.files

    def read(self, name, dim=0, start=None, stop=None):
        """The tensor, or its [start:stop) slice along `dim`; only that slice is read (of an
        FP8 weight, the whole blocks it touches, then dequantized and cut to the slice)."""
        if self.is_quantized(name):
            return self._read_dequantized(name, dim, start, stop)
        return self._read_stored(name, dim, start, stop)

    def _read_stored(self, name, dim, start, stop):
        if start is None:
            return self.files[name].get_tensor(name)
        index = tuple(slice(start, stop) if d == dim else slice(None) for d in range(dim + 1))
        return self.files[name].get_slice(name)[index]

    def _read_dequantized(self, name, dim, start, stop):
        # The slice widened to whole blocks along `dim`, so each row (or column) read meets
        # the scale of its own block: block b holds [b * side, (b + 1) * side).
        length, side = self.shape(name)[dim], self.block[dim]
        start, stop = (0, length) if start is None else (start, stop)
        first, last = start // side, -(-stop // side)
        weight = self._read_stored(name, dim, first * side, min(last * side, length))
        scale = self._read_stored(name + SCALE_SUFFIX, dim, first, last)
        return dequantize_fp8_blocks(weight, scale, self.block).narrow(dim, start - first * side, stop - start)


def quantization_problems(checkpoint, expected):
    """Each FP8 weight of `expected` must come with its scale, one per block, and each scale
    with an FP8 weight under a config.json that declares the blocks."""
    problems = []
    for name in sorted(expected & set(checkpoint.files)):
        stored, scale = checkpoint.dtype(name), name + SCALE_SUFFIX
        if scale in checkpoint.files and checkpoint.block is None:
            problems.append(f"{scale}: an FP8 block scale, but config.json has no quantization_config; expected "
                            'quant_method "fp8" with its weight_block_size')
        elif checkpoint.is_quantized(name):
            blocks = tuple(-(-length // side) for length, side in zip(checkpoint.shape(name), checkpoint.block))
            if stored not in FP8_DTYPES:
                problems.append(f"{name}: stored as {stored} beside {scale}; expected {' or '.join(FP8_DTYPES)}")
            if checkpoint.shape(scale) != blocks:
                problems.append(f"{scale}: shape {checkpoint.shape(scale)}, expected {blocks} (one scale per "
                                f"{checkpoint.block[0]} x {checkpoint.block[1]} block of {checkpoint.shape(name)})")
        elif stored.startswith("F8"):
            problems.append(f"{name}: stored as {stored} without {scale}; expected a scale per block")
    return problems
