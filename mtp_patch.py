"""Megatron-Core MTP patches for RL: one behaviour on megatron-core 0.14 - 0.19.

RL training with a multi-token-prediction (MTP) head needs an MTP path that upstream
megatron-core gives only in some releases, and each release moves the API (see the table
in README.md). `patch_megatron_mtp()` replaces two functions on megatron-core's classes, so
every GPTModel, built before or after, gets this behaviour:

1. Decoupled MTP loss (`decouple=True`, the default): the MTP loss trains only the MTP
   layers. The trunk's hidden states and the token embeddings enter the MTP layers
   detached, and the MTP logits use a detached output-layer weight.
2. The MTP loss is normalised per token, with `mtp_loss_scaling_factor / mtp_num_layers`
   per depth, and a token count clamped to >= 1: a shard whose loss mask is all zeros
   (common under context parallelism with short responses) contributes exactly 0 and
   finite gradients, never 0/0 = NaN.
3. A forward with `labels=None` (a log-prob-only pass) skips the MTP layers and returns
   the logits; up to 0.16.1 it crashes upstream.
4. Activation recompute (`recompute_granularity="full"`) of an MTP layer passes tensors
   to the checkpoint and closes over everything else (packed-sequence parameters), and
   forwards `padding_mask` (0.18.2 crashes upstream on both counts).
5. Nothing else changes: with `decouple=False` the logits, the loss and every gradient
   are those of the unpatched model.
6. Under context parallelism the MTP token count is summed over the CP group, so the
   per-rank MTP losses add up (as megatron sums gradients over CP) to the CP=1 loss.
   After each forward, `model.mtp_losses` holds this rank's per-depth MTP losses
   ([mtp_num_layers] fp32, detached; None when no MTP loss was computed).

    from mtp_patch import patch_megatron_mtp, unpatch_megatron_mtp
    patch_megatron_mtp()             # returns 2 (functions replaced); again: returns 0
    ...
    unpatch_megatron_mtp()           # returns 2; the original function objects are back

Patched: `GPTModel._postprocess` (the MTP layers and their loss run there) and
`MultiTokenPredictionLayer._checkpointed_forward`. Every signature difference between
releases is probed once, when patching, and kept in the replacement's closure; a
forward pass never inspects a signature. Inference paths (an inference context,
speculative decoding, megatron's inference mode) run the release's own code unchanged.
Megatron's MoE overlap schedule (`overlap_moe_expert_parallel_comm`) runs the MTP layers
outside `_postprocess`; there only the detached output weight applies.

Imports only torch, the standard library and (when patching) megatron-core.
"""

import inspect
import warnings

import torch

# Where each replaced function lives: (module, class, function).
PATCHED_FUNCTIONS = (
    ("megatron.core.models.gpt.gpt_model", "GPTModel", "_postprocess"),
    ("megatron.core.transformer.multi_token_prediction", "MultiTokenPredictionLayer", "_checkpointed_forward"),
)
# Set on each replacement: the options it was made with. Guards against patching twice
# (whichever copy of this module patched first) and marks what `unpatch` may restore.
PATCH_MARK = "_mtp_patch_options"

# `GPTModel._postprocess` parameters of 0.14 - 0.19; a release that adds one is refused
# rather than silently dropping what the new parameter carries.
KNOWN_POSTPROCESS_PARAMETERS = {
    "self", "hidden_states", "input_ids", "position_ids", "labels", "rotary_pos_emb", "rotary_pos_cos",
    "rotary_pos_sin", "mtp_in_postprocess", "loss_mask", "decoder_input", "attention_mask",
    "inference_params", "packed_seq_params", "sequence_len_offset", "runtime_gather_output",
    "extra_block_kwargs", "inference_context",
    "is_spec_decode",                                                   # 0.17
    "padding_mask", "output_processor", "output_processor_context",    # 0.18+
}


def patch_megatron_mtp(*, decouple=True):
    """Patch megatron-core's GPTModel and MTP layer classes; returns how many functions it replaced.

    decouple (bool, default True): the MTP loss trains only the MTP layers. RL runs report
        that an MTP loss flowing into the trunk and the shared output layer pulls the policy
        towards its own draft targets and can collapse its entropy; the MTP head should learn
        to draft for the policy, not reshape it. False lets the MTP loss train everything, as
        upstream does.

    Returns 0 and changes nothing when the patches are already in place with the same
    options. All or nothing: a release that lacks a piece the patches need raises
    RuntimeError naming the release and the piece, before anything is replaced.
    Tensors are untouched by patching; see the module docstring for what a forward does.
    """
    if not isinstance(decouple, bool):
        raise TypeError(f"decouple must be True or False, got {decouple!r}")
    options = {"decouple": decouple}
    megatron, targets = _import_megatron()
    marks = [getattr(vars(owner).get(name), PATCH_MARK, None) for owner, name in targets]
    if any(mark is not None for mark in marks):
        if marks == [options] * len(targets):
            return 0
        raise RuntimeError(f"megatron-core MTP patches are already in place with options {marks[0]}, "
                           f"not {options}: call unpatch_megatron_mtp() first")
    probes = _probe(megatron)
    replacements = {
        "_postprocess": _make_postprocess(vars(megatron["GPTModel"])["_postprocess"], megatron, probes, options),
        "_checkpointed_forward": _make_checkpointed_forward(
            vars(megatron["MultiTokenPredictionLayer"])["_checkpointed_forward"], megatron, probes),
    }
    for owner, name in targets:
        replacement = replacements[name]
        setattr(replacement, PATCH_MARK, options)
        setattr(owner, name, replacement)
    return len(replacements)


def unpatch_megatron_mtp():
    """Restore every function `patch_megatron_mtp` replaced (the same objects); returns how many."""
    try:
        _, targets = _import_megatron()
    except RuntimeError:
        return 0  # megatron-core gone or incomplete: nothing of ours can be in place
    restored = 0
    for owner, name in targets:
        current = vars(owner).get(name)
        if getattr(current, PATCH_MARK, None) is not None:
            setattr(owner, name, current.__wrapped__)
            restored += 1
    return restored


def _import_megatron():
    """megatron-core's pieces the patches use, and the (class, function name) pairs to replace."""
    try:
        from megatron.core import package_info
        version = package_info.__version__
    except ImportError:
        version = "(version unknown)"
    try:
        from megatron.core import parallel_state, tensor_parallel
        from megatron.core.models.gpt import gpt_model
        from megatron.core.transformer import multi_token_prediction
    except ImportError as error:
        raise RuntimeError(f"megatron-core {version} cannot be imported ({error}); "
                           "mtp_patch needs megatron-core 0.14 - 0.19") from error
    required = {
        "GPTModel": (gpt_model, "GPTModel"),
        "has_config_logger_enabled": (gpt_model, "has_config_logger_enabled"),
        "log_config_to_disk": (gpt_model, "log_config_to_disk"),
        "MultiTokenPredictionBlock": (multi_token_prediction, "MultiTokenPredictionBlock"),
        "MultiTokenPredictionLayer": (multi_token_prediction, "MultiTokenPredictionLayer"),
        "MTPLossAutoScaler": (multi_token_prediction, "MTPLossAutoScaler"),
        "MTPLossLoggingHelper": (multi_token_prediction, "MTPLossLoggingHelper"),
        "roll_tensor": (multi_token_prediction, "roll_tensor"),
        "checkpoint": (tensor_parallel, "checkpoint"),
    }
    missing = [f"{module.__name__}.{name}" for module, name in required.values() if not hasattr(module, name)]
    megatron = {key: getattr(module, name, None) for key, (module, name) in required.items()}
    for _, class_name, function_name in PATCHED_FUNCTIONS:
        owner = megatron[class_name]
        if owner is not None and function_name not in vars(owner):
            missing.append(f"{owner.__module__}.{class_name}.{function_name}")
    if missing:
        raise RuntimeError(f"megatron-core {version} lacks {', '.join(missing)}, which the MTP patches need "
                           "(written for megatron-core 0.14 - 0.19)")
    megatron.update(version=version, parallel_state=parallel_state)
    try:
        from megatron.core.inference.utils import InferenceMode  # 0.18+
        megatron["InferenceMode"] = InferenceMode
    except ImportError:
        megatron["InferenceMode"] = None
    targets = [(megatron[class_name], function_name) for _, class_name, function_name in PATCHED_FUNCTIONS]
    return megatron, targets


def _parameters(function):
    return set(inspect.signature(function).parameters)


def _probe(megatron):
    """Every signature difference the replacements depend on, read once."""
    version = megatron["version"]
    postprocess = _parameters(vars(megatron["GPTModel"])["_postprocess"])
    unknown = postprocess - KNOWN_POSTPROCESS_PARAMETERS
    if unknown:
        raise RuntimeError(f"megatron-core {version}: GPTModel._postprocess takes {sorted(unknown)}, "
                           "which the MTP patches do not know (written for megatron-core 0.14 - 0.19)")
    checkpointed = _parameters(vars(megatron["MultiTokenPredictionLayer"])["_checkpointed_forward"])
    # 0.14 - 0.17: (self, forward_func, *args, **kwargs); 0.18+: the layer's arguments by name.
    function_first = "forward_func" in checkpointed
    if not function_first and "hidden_states" not in checkpointed:
        raise RuntimeError(f"megatron-core {version}: MultiTokenPredictionLayer._checkpointed_forward"
                           f"{sorted(checkpointed)} has neither known form")
    return {
        "block_takes_padding_mask": "padding_mask" in _parameters(megatron["MultiTokenPredictionBlock"].forward),
        "roll_takes_packed_seq_params": "packed_seq_params" in _parameters(megatron["roll_tensor"]),
        "scales_logits": hasattr(megatron["GPTModel"], "_scale_logits"),  # 0.17+ (MuP)
        "checkpoint_function_first": function_first,
    }


def _make_postprocess(original, megatron, probes, options):
    """`GPTModel._postprocess` with the MTP behaviour above; inference paths go to `original`."""
    decouple = options["decouple"]
    inference_mode = megatron["InferenceMode"]
    process_mtp_loss = _make_process_mtp_loss(megatron, probes)

    def _postprocess(self, hidden_states, input_ids, position_ids, labels, **kwargs):
        """hidden_states [s, b, h] from the decoder -> per-token loss [b, s] with labels, else logits [b, s, V]."""
        if (kwargs.get("inference_context") is not None or kwargs.get("inference_params") is not None
                or kwargs.get("is_spec_decode") or (inference_mode is not None and inference_mode.is_active())):
            return original(self, hidden_states, input_ids, position_ids, labels, **kwargs)
        # This forward's per-depth MTP losses (detached), for logging: None until computed.
        self.mtp_losses = None
        mtp_in_postprocess = kwargs.get("mtp_in_postprocess")
        runtime_gather_output = kwargs.get("runtime_gather_output")
        packed_seq_params = kwargs.get("packed_seq_params")
        output_weight = None
        if self.share_embeddings_and_output_weights:
            output_weight = self.shared_embedding_or_output_weight()

        # Without labels there is no MTP loss to compute: skip the MTP layers, unless a
        # later pipeline stage (which computes the loss) expects their outputs.
        run_mtp = bool(mtp_in_postprocess) and (labels is not None or not self.post_process)
        if run_mtp:
            block_kwargs = dict(kwargs.get("extra_block_kwargs") or {})
            if probes["block_takes_padding_mask"]:
                block_kwargs["padding_mask"] = kwargs.get("padding_mask")
            mtp_input, embedding = hidden_states, self.embedding
            if decouple:
                # A leaf that requires grad: a reentrant recompute checkpoint of the MTP
                # layer returns a tensor without grad when none of its inputs requires it,
                # and the MTP layers would then get no gradient at all.
                mtp_input = hidden_states.detach().requires_grad_()
                embedding = _detached(self.embedding)
            mtp_output = self.mtp(
                input_ids=input_ids, position_ids=position_ids, hidden_states=mtp_input,
                attention_mask=kwargs.get("attention_mask"), inference_params=None,
                rotary_pos_emb=kwargs.get("rotary_pos_emb"), rotary_pos_cos=kwargs.get("rotary_pos_cos"),
                rotary_pos_sin=kwargs.get("rotary_pos_sin"), packed_seq_params=packed_seq_params,
                sequence_len_offset=kwargs.get("sequence_len_offset"), embedding=embedding, **block_kwargs)
            # The block returns [its input; depth 1; ...; depth n] along the sequence; put
            # the trunk's own hidden states (with their graph) back in front.
            if decouple:
                mtp_output = torch.cat([hidden_states, mtp_output[hidden_states.shape[0]:]])
            hidden_states = mtp_output

        if not self.post_process:
            return hidden_states

        carries_mtp_outputs = run_mtp or (bool(self.config.mtp_num_layers) and not mtp_in_postprocess)
        if carries_mtp_outputs and labels is None:
            hidden_states = torch.chunk(hidden_states, 1 + self.config.mtp_num_layers, dim=0)[0]
        elif carries_mtp_outputs:
            mtp_weight = output_weight
            if decouple:
                mtp_weight = (output_weight if output_weight is not None else self.output_layer.weight).detach()
            hidden_states, self.mtp_losses = process_mtp_loss(
                hidden_states=hidden_states, labels=labels, loss_mask=kwargs.get("loss_mask"),
                output_layer=self.output_layer, output_weight=mtp_weight,
                runtime_gather_output=runtime_gather_output, is_training=self.training,
                compute_language_model_loss=self.compute_language_model_loss, config=self.config,
                cp_group=self.cp_group, packed_seq_params=packed_seq_params,
                scale_logits=self._scale_logits if probes["scales_logits"] else None)

        output_processor = kwargs.get("output_processor")
        if output_processor is not None:  # 0.18+: a caller-supplied logits/loss head
            return output_processor(
                hidden_states=hidden_states, output_layer=self.output_layer, output_weight=output_weight,
                labels=labels, loss_mask=kwargs.get("loss_mask"), input_ids=input_ids, position_ids=position_ids,
                attention_mask=kwargs.get("attention_mask"), decoder_input=kwargs.get("decoder_input"),
                inference_context=None, packed_seq_params=packed_seq_params,
                runtime_gather_output=runtime_gather_output, context=kwargs.get("output_processor_context"),
                compute_language_model_loss=self.compute_language_model_loss, scale_logits=self._scale_logits,
                config=self.config)

        logits, _ = self.output_layer(hidden_states, weight=output_weight, runtime_gather_output=runtime_gather_output)
        if probes["scales_logits"]:
            logits = self._scale_logits(logits)
        if megatron["has_config_logger_enabled"](self.config):
            megatron["log_config_to_disk"](self.config, {
                "input_ids": input_ids, "position_ids": position_ids, "attention_mask": kwargs.get("attention_mask"),
                "decoder_input": kwargs.get("decoder_input"), "logits": logits}, prefix="input_and_logits")
        if labels is None:
            return logits.transpose(0, 1).contiguous()  # [s, b, V] -> [b, s, V]
        return self.compute_language_model_loss(labels, logits)

    _postprocess.__wrapped__ = original
    return _postprocess


def _detached(embedding):
    """The embedding module's output without a graph: the table belongs to the trunk."""
    def detached_embedding(input_ids, position_ids):
        with torch.no_grad():
            return embedding(input_ids=input_ids, position_ids=position_ids)
    return detached_embedding


def _make_process_mtp_loss(megatron, probes):
    """The MTP loss, one implementation for every release (0.17+'s `process_mtp_loss` shape).

    Differs from upstream (inline up to 0.16, `process_mtp_loss` from 0.17) in the token
    count: summed over the context-parallel group, so a CP shard's loss is its share of
    the sequence-level mean (summed over CP ranks, as megatron sums gradients, it equals
    the CP=1 loss; upstream averages per-shard means), and clamped to >= 1 (0/0 = NaN on
    a batch without loss tokens). With `calculate_per_token_loss` it normalises per rolled
    token and rescales by the unrolled count, as 0.17+ do.
    """
    roll_tensor = megatron["roll_tensor"]
    autoscaler = megatron["MTPLossAutoScaler"]
    logging_helper = megatron["MTPLossLoggingHelper"]
    parallel_state = megatron["parallel_state"]
    roll_takes_packed_seq_params = probes["roll_takes_packed_seq_params"]
    logs_to_tracker = hasattr(logging_helper, "save_loss_to_tracker")

    def process_mtp_loss(hidden_states, labels, loss_mask, output_layer, output_weight, runtime_gather_output,
                         is_training, compute_language_model_loss, config, cp_group, packed_seq_params,
                         scale_logits):
        """hidden_states [(1 + n) s, b, h] -> ([s, b, h] carrying the MTP loss to backward,
        [n] fp32 detached per-depth losses of this rank: summed over CP ranks, the means)."""
        num_layers = config.mtp_num_layers
        hidden_states_list = torch.chunk(hidden_states, 1 + num_layers, dim=0)
        hidden_states = hidden_states_list[0]
        roll_kwargs = {"shifts": -1, "dims": -1, "cp_group": cp_group}
        if roll_takes_packed_seq_params:
            roll_kwargs["packed_seq_params"] = packed_seq_params
        mtp_labels = labels.clone()
        if loss_mask is None:
            loss_mask = torch.ones_like(mtp_labels)
        original_num_tokens = _sum_over(loss_mask.sum(), cp_group)
        scale = config.mtp_loss_scaling_factor / num_layers
        losses = torch.zeros(num_layers, dtype=torch.float32, device=hidden_states.device)
        for depth in range(num_layers):
            mtp_logits, _ = output_layer(hidden_states_list[depth + 1], weight=output_weight,
                                         runtime_gather_output=runtime_gather_output)
            mtp_labels, _ = roll_tensor(mtp_labels, **roll_kwargs)
            if scale_logits is not None:
                mtp_logits = scale_logits(mtp_logits)
            loss_mask, num_tokens = roll_tensor(loss_mask, **roll_kwargs)
            num_tokens = _sum_over(num_tokens, cp_group).clamp(min=1)
            mtp_loss = loss_mask * compute_language_model_loss(mtp_labels, mtp_logits)
            losses[depth] = torch.sum(mtp_loss).detach() / num_tokens
            # 0.19 replaced this logger with one that also wants acceptance counts.
            if is_training and logs_to_tracker:
                logging_helper.save_loss_to_tracker(
                    losses[depth], depth, num_layers,
                    avg_group=parallel_state.get_data_parallel_group(with_context_parallel=True))
            if config.calculate_per_token_loss:
                mtp_loss = scale * mtp_loss * (original_num_tokens / num_tokens)
            else:
                mtp_loss = scale * mtp_loss / num_tokens
            hidden_states = autoscaler.apply(hidden_states, mtp_loss)
        return hidden_states, losses

    return process_mtp_loss


def _sum_over(count, group):
    """A token count summed over `group` (a no-op outside torch.distributed or at size 1)."""
    if group is None or not torch.distributed.is_initialized() or group.size() == 1:
        return count
    count = count.clone()
    torch.distributed.all_reduce(count, group=group)
    return count


def _make_checkpointed_forward(original, megatron, probes):
    """`MultiTokenPredictionLayer._checkpointed_forward` that checkpoints tensors only.

    `tensor_parallel.checkpoint` saves its arguments with `save_for_backward`, which takes
    tensors and None only: 0.14 - 0.17 pass every argument through it (packed-sequence
    parameters fail), 0.18 does not accept the `padding_mask` its own forward passes.
    Quantized (fp8/fp4) recompute goes through Transformer Engine in the release's own code.
    """
    checkpoint = megatron["checkpoint"]
    function_first = probes["checkpoint_function_first"]

    def _checkpointed_forward(self, *function, **arguments):
        if self.config.fp8 or getattr(self.config, "fp4", None):
            return original(self, *function, **arguments)
        forward_func = function[0] if function_first else self._proj_and_transformer_layer
        # In the order the layer passes them, hidden_states first: with
        # distribute_saved_activations the checkpoint splits its first argument.
        tensor_names = [name for name, value in arguments.items() if value is None or torch.is_tensor(value)]
        others = {name: value for name, value in arguments.items() if name not in tensor_names}

        def recompute(*tensors):
            return forward_func(**dict(zip(tensor_names, tensors)), **others)

        if self.config.recompute_method == "uniform":
            if self.config.recompute_num_layers != 1:
                raise ValueError(f"recompute_num_layers={self.config.recompute_num_layers}: "
                                 "MTP layers recompute one layer at a time (expected 1)")
            return checkpoint(recompute, self.config.distribute_saved_activations,
                              *(arguments[name] for name in tensor_names))
        if self.config.recompute_method == "block":
            warnings.warn("recompute_method='block' is not supported for MTP layers; running them without recompute")
            return forward_func(**arguments)
        raise ValueError(f"recompute_method={self.config.recompute_method!r}: expected 'uniform' or 'block'")

    _checkpointed_forward.__wrapped__ = original
    return _checkpointed_forward
