"""Megatron-Core MTP patches for RL: one behaviour on megatron-core 0.14 - 0.19.

RL training with a multi-token-prediction (MTP) head needs an MTP path that upstream
megatron-core gives only in some releases, and each release moves the API (see the table
in docs/MTP_MATRIX.md). `patch_megatron_mtp()` replaces three functions of megatron-core (two on
0.14/0.15), so every GPTModel, built before or after, gets this behaviour:

1. Decoupled MTP loss (`decouple=True`, the default): the MTP loss trains only the MTP
   layers. The trunk's hidden states and the token embeddings enter the MTP layers
   detached, and the MTP logits use a detached output-layer weight.
2. The MTP loss is normalised per token, with `mtp_loss_scaling_factor / depths` per depth
   (one depth per MTP layer unless item 10 says more), and a token count clamped to >= 1: a shard whose loss mask is all zeros
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
   ([depths] fp32, detached; None when no MTP loss was computed).
7. Packed sequences (0.16+) roll by one position per MTP depth with one all-gather over
   the CP group and a vectorised index map (`roll_packed`), not megatron's loop over
   sequences with an isend/irecv pair per sequence and roll: same values, exactly.
8. Explicit MTP targets: a packing whose slots are not one sequence after another (one
   slot serving several sequences, as a GRPO group's shared prompt does) sets
   `packed_seq_params.mtp_targets` (MTP_TARGETS_ATTRIBUTE): per depth (rows [E] int64,
   labels [E] int64, weights [E] fp32, policy_rows [E] int64), each target the label a
   slot's MTP output at that depth predicts, and the slot whose main output predicts that
   same label. The depth's loss is then sum(weights * CE(logits[rows], labels)) /
   sum(weights): a slot may carry several targets, and labels and mask are not rolled.
9. Policy targets: inside `mtp_policy_target.policy_target(T, loss)` (T > 0) depth d at
   position i learns the policy's detached distribution softmax(z[i + d] / T) (z the main
   logits, rolled like the labels or read at `policy_rows`) by a vocab-parallel loss
   (mtp_policy_target.py): loss="ce", the soft cross entropy, or "tv", the total variation
   1 - sum_v min(p, q) (with a small cross-entropy anchor), which maximises the draft
   acceptance below directly; under the sampled loss's weights and normalisation; one
   more output-layer pass.
   `model.mtp_acceptance` then holds per depth the mean of sum_v min(p, q) over its tokens (p
   the policy's, q the head's distribution): a sampled draft's chance of acceptance.
10. Depths past the MTP layers (`set_mtp_depths(model, depths)`): the layers run again in
   turn on their own outputs, depth d by layer (d - 1) % layers, each depth's inputs rolled
   once more, as vLLM drafts past a model's MTP layers; every depth has its loss (item 2,
   normalised by the depths), targets and acceptance. Without it a model trains one depth
   per MTP layer.

    from mtp_patch import patch_megatron_mtp, unpatch_megatron_mtp
    patch_megatron_mtp()             # returns 3 (functions replaced; 2 on 0.14/0.15); again: 0
    set_mtp_depths(model, 3)         # a GPTModel with one MTP layer trains it at depths 1, 2 and 3
    ...
    unpatch_megatron_mtp()           # returns 3; the original function objects are back

What is replaced, and where megatron's own code still runs: docs/MTP_MATRIX.md.

Imports only torch, the standard library, mtp_policy_target (item 9) and (when patching)
megatron-core.
"""

import contextlib
import inspect
import warnings

import torch

from mtp_policy_target import all_reduced, policy_target_loss, policy_target_temperature, soft_depth_loss

# Where each replaced function lives: (module, class or None for a module global, function).
PATCHED_FUNCTIONS = (
    ("megatron.core.models.gpt.gpt_model", "GPTModel", "_postprocess"),
    ("megatron.core.transformer.multi_token_prediction", "MultiTokenPredictionLayer", "_checkpointed_forward"),
    # `_get_embeddings` looks it up in its module at every call. Replaced only where it has
    # a packed path (0.16+): 0.14/0.15's MTP layers refuse packed sequences.
    ("megatron.core.transformer.multi_token_prediction", None, "roll_tensor"),
)
# Set on each replacement: the options it was made with. Guards against patching twice
# (whichever copy of this module patched first) and marks what `unpatch` may restore.
PATCH_MARK = "_mtp_patch_options"
# Where a model keeps the MTP depths it trains (item 10 above; absent: one per MTP layer).
MTP_DEPTHS_ATTRIBUTE = "mtp_train_depths"
# Where a packing puts explicit MTP targets (item 8 above) on its PackedSeqParams.
MTP_TARGETS_ATTRIBUTE = "mtp_targets"

# Zigzag THD layout: CP rank r holds chunks r and 2*cp-1-r of every padded sequence.
# A copy of cp_thd.CHUNKS_PER_RANK, as `_roll_source_index`'s arithmetic is of
# cp_thd.zigzag_gathered_slot's: this module imports no project module but
# mtp_policy_target, so that the two can be copied alone. A test keeps them equal
# (test_mtp_patch_roll_index_map_agrees_with_the_zigzag_layout_it_copies).
CHUNKS_PER_RANK = 2
# What megatron rolls in at the last position of each sequence.
ROLL_FILL_VALUE = 0
# Where `roll_packed` keeps a batch's index map: on its PackedSeqParams, for the next rolls.
ROLL_SOURCE_ATTRIBUTE = "_mtp_patch_roll_source"

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
    """Patch megatron-core's GPTModel, its MTP layers and packed roll; returns how many functions
    it replaced (3; 2 on 0.14/0.15, which have no packed roll).

    decouple (bool, default True): the MTP loss trains only the MTP layers. RL runs report
        that an MTP loss flowing into the trunk and the shared output layer pulls the policy
        towards its own draft targets and can collapse its entropy; the MTP head should learn
        to draft for the policy, not reshape it. False lets the MTP loss train everything, as
        upstream does.

    Returns 0 and changes nothing when the patches are already in place with the same
    options. All or nothing: a release that lacks a piece the patches need raises
    RuntimeError naming the release and the piece, before anything is replaced.
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
    replacements = {}
    if "roll_tensor" in [name for _, name in targets]:
        replacements["roll_tensor"] = _make_roll_tensor(megatron["roll_tensor"])
    # The MTP loss rolls labels and its mask with the same roll as the MTP layers.
    replacements["_postprocess"] = _make_postprocess(vars(megatron["GPTModel"])["_postprocess"], megatron, probes,
                                                     options, replacements.get("roll_tensor"))
    replacements["_checkpointed_forward"] = _make_checkpointed_forward(
        vars(megatron["MultiTokenPredictionLayer"])["_checkpointed_forward"], megatron, probes)
    for owner, name in targets:
        replacement = replacements[name]
        setattr(replacement, PATCH_MARK, options)
        setattr(owner, name, replacement)
    return len(targets)


def patched():
    """Whether `patch_megatron_mtp`'s functions are in place (with any options)."""
    try:
        _, targets = _import_megatron()
    except RuntimeError:
        return False
    return all(getattr(vars(owner).get(name), PATCH_MARK, None) is not None for owner, name in targets)


def set_mtp_depths(model, depths):
    """Train `depths` MTP depths on `model` (a GPTModel with MTP layers; item 10 above):
    past its MTP layers they run again in turn on their own outputs, as vLLM drafts. depths:
    a positive multiple of the model's MTP layers (on this pipeline stage: all of them)."""
    layers = model.config.mtp_num_layers or 0
    if not layers:
        raise ValueError(f"depths={depths}: the model has no MTP layers to train at any depth")
    if not isinstance(depths, int) or depths < 1 or depths % layers:
        raise ValueError(f"depths={depths!r}: expected a positive multiple of the model's {layers} MTP layers "
                         "(the layers run again in turn, whole rounds only)")
    setattr(model, MTP_DEPTHS_ATTRIBUTE, depths)


def mtp_depths(model):
    """How many MTP depths `model` trains: `set_mtp_depths`' count, else one per MTP layer (0 without)."""
    return getattr(model, MTP_DEPTHS_ATTRIBUTE, None) or (model.config.mtp_num_layers or 0)


def unpatch_megatron_mtp():
    """Restore every function `patch_megatron_mtp` replaced (the same objects); returns how many."""
    try:
        _, targets = _import_megatron()
    except RuntimeError:  # megatron-core gone or incomplete: nothing of ours can be in place
        return 0
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
    modules = {module.__name__: module for module in (gpt_model, multi_token_prediction)}
    owners = [modules[module_name] if class_name is None else megatron[class_name]
              for module_name, class_name, _ in PATCHED_FUNCTIONS]
    for owner, (_, class_name, function_name) in zip(owners, PATCHED_FUNCTIONS):
        # A missing class, or module global, is already in `missing`.
        if class_name is not None and owner is not None and function_name not in vars(owner):
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
    targets = [(owner, function_name) for owner, (_, _, function_name) in zip(owners, PATCHED_FUNCTIONS)
               if function_name != "roll_tensor" or "packed_seq_params" in _parameters(megatron["roll_tensor"])]
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
        "scales_logits": hasattr(megatron["GPTModel"], "_scale_logits"),  # 0.17+ (MuP)
        "checkpoint_function_first": function_first,
    }


def _make_postprocess(original, megatron, probes, options, packed_roll):
    """`GPTModel._postprocess` with the MTP behaviour above; inference paths go to `original`.
    `packed_roll`: the replacement `roll_tensor` (0.16+), or None where megatron's has no packed path."""
    decouple = options["decouple"]
    inference_mode = megatron["InferenceMode"]
    process_mtp_loss = _make_process_mtp_loss(megatron, packed_roll)

    def _postprocess(self, hidden_states, input_ids, position_ids, labels, **kwargs):
        """hidden_states [s, b, h] from the decoder -> per-token loss [b, s] with labels, else logits [b, s, V]."""
        if (kwargs.get("inference_context") is not None or kwargs.get("inference_params") is not None
                or kwargs.get("is_spec_decode") or (inference_mode is not None and inference_mode.is_active())):
            return original(self, hidden_states, input_ids, position_ids, labels, **kwargs)
        # This forward's per-depth MTP losses and acceptances (detached), for logging: None until computed.
        self.mtp_losses = self.mtp_acceptance = None
        mtp_in_postprocess = kwargs.get("mtp_in_postprocess")
        output_weight = None
        if self.share_embeddings_and_output_weights:
            output_weight = self.shared_embedding_or_output_weight()

        # Without labels there is no MTP loss to compute: skip the MTP layers, unless a
        # later pipeline stage (which computes the loss) expects their outputs.
        run_mtp = bool(mtp_in_postprocess) and (labels is not None or not self.post_process)
        if run_mtp:
            hidden_states = _run_mtp_layers(self, hidden_states, input_ids, position_ids, kwargs,
                                            probes["block_takes_padding_mask"], decouple)
        if not self.post_process:
            return hidden_states

        carries_mtp_outputs = run_mtp or (bool(self.config.mtp_num_layers) and not mtp_in_postprocess)
        if carries_mtp_outputs and labels is None:
            hidden_states = torch.chunk(hidden_states, 1 + mtp_depths(self), dim=0)[0]
        elif carries_mtp_outputs:
            mtp_weight = output_weight
            if decouple:
                mtp_weight = (output_weight if output_weight is not None else self.output_layer.weight).detach()
            hidden_states, self.mtp_losses, self.mtp_acceptance = process_mtp_loss(
                hidden_states=hidden_states, labels=labels, loss_mask=kwargs.get("loss_mask"),
                output_layer=self.output_layer, output_weight=mtp_weight,
                runtime_gather_output=kwargs.get("runtime_gather_output"), is_training=self.training,
                compute_language_model_loss=self.compute_language_model_loss, config=self.config,
                cp_group=self.cp_group, packed_seq_params=kwargs.get("packed_seq_params"),
                scale_logits=self._scale_logits if probes["scales_logits"] else None, num_depths=mtp_depths(self))
        return _output_head(self, hidden_states, input_ids, position_ids, labels, output_weight, kwargs, megatron,
                            probes["scales_logits"])

    _postprocess.__wrapped__ = original
    return _postprocess


def _run_mtp_layers(model, hidden_states, input_ids, position_ids, kwargs, block_takes_padding_mask, decouple):
    """The MTP block on the trunk's hidden states [s, b, h] -> [trunk; depth 1; ...; depth n]
    along the sequence. Decoupled, the block sees the trunk (hidden states and embedding)
    without its graph, and the trunk's own hidden states keep theirs."""
    block_kwargs = dict(kwargs.get("extra_block_kwargs") or {})
    if block_takes_padding_mask:
        block_kwargs["padding_mask"] = kwargs.get("padding_mask")
    mtp_input, embedding = hidden_states, model.embedding
    if decouple:
        # A leaf that requires grad: a reentrant recompute checkpoint of the MTP layer returns
        # a tensor without grad when none of its inputs requires it (no MTP gradient at all).
        mtp_input = hidden_states.detach().requires_grad_()
        embedding = _detached(model.embedding)
    with _layers_in_turn(model.mtp, mtp_depths(model)):
        mtp_output = model.mtp(
            input_ids=input_ids, position_ids=position_ids, hidden_states=mtp_input,
            attention_mask=kwargs.get("attention_mask"), inference_params=None,
            rotary_pos_emb=kwargs.get("rotary_pos_emb"), rotary_pos_cos=kwargs.get("rotary_pos_cos"),
            rotary_pos_sin=kwargs.get("rotary_pos_sin"), packed_seq_params=kwargs.get("packed_seq_params"),
            sequence_len_offset=kwargs.get("sequence_len_offset"), embedding=embedding, **block_kwargs)
    # [its input; depth 1; ...; depth n]: the trunk's own hidden states (with their graph) go back in front.
    if decouple:
        mtp_output = torch.cat([hidden_states, mtp_output[hidden_states.shape[0]:]])
    return mtp_output


@contextlib.contextmanager
def _layers_in_turn(block, depths):
    """The MTP block running `depths` layers, its own again in turn past their count (item
    10 above): megatron's block runs each of its layers once, on the one before's output."""
    layers = block.layers
    if depths == len(layers):
        yield
        return
    block.layers = torch.nn.ModuleList(layers[depth % len(layers)] for depth in range(depths))
    try:
        yield
    finally:
        block.layers = layers


def _output_head(model, hidden_states, input_ids, position_ids, labels, output_weight, kwargs, megatron,
                 scales_logits):
    """The main model's head on [s, b, h]: a caller's output processor (0.18+), else the
    output layer -> per-token loss [b, s] with labels, logits [b, s, V] without."""
    runtime_gather_output = kwargs.get("runtime_gather_output")
    output_processor = kwargs.get("output_processor")
    if output_processor is not None:  # 0.18+: a caller-supplied logits/loss head
        return output_processor(
            hidden_states=hidden_states, output_layer=model.output_layer, output_weight=output_weight,
            labels=labels, loss_mask=kwargs.get("loss_mask"), input_ids=input_ids, position_ids=position_ids,
            attention_mask=kwargs.get("attention_mask"), decoder_input=kwargs.get("decoder_input"),
            inference_context=None, packed_seq_params=kwargs.get("packed_seq_params"),
            runtime_gather_output=runtime_gather_output, context=kwargs.get("output_processor_context"),
            compute_language_model_loss=model.compute_language_model_loss, scale_logits=model._scale_logits,
            config=model.config)
    logits, _ = model.output_layer(hidden_states, weight=output_weight, runtime_gather_output=runtime_gather_output)
    if scales_logits:
        logits = model._scale_logits(logits)
    if megatron["has_config_logger_enabled"](model.config):
        megatron["log_config_to_disk"](model.config, {
            "input_ids": input_ids, "position_ids": position_ids, "attention_mask": kwargs.get("attention_mask"),
            "decoder_input": kwargs.get("decoder_input"), "logits": logits}, prefix="input_and_logits")
    if labels is None:
        return logits.transpose(0, 1).contiguous()  # [s, b, V] -> [b, s, V]
    return model.compute_language_model_loss(labels, logits)


def _detached(embedding):
    """The embedding module's output without a graph: the table belongs to the trunk."""
    def detached_embedding(input_ids, position_ids):
        with torch.no_grad():
            return embedding(input_ids=input_ids, position_ids=position_ids)
    return detached_embedding


def _make_process_mtp_loss(megatron, packed_roll):
    """The MTP loss, one implementation for every release (0.17+'s `process_mtp_loss` shape).
    Unlike upstream its token count is summed over the CP group (summed over CP ranks the
    shards' losses equal the CP=1 loss; upstream averages per-shard means) and clamped to
    >= 1 (no 0/0 on a shard without loss tokens); `calculate_per_token_loss` normalises per
    rolled token and rescales by the unrolled count, as 0.17+ do. Targets: the sampled
    token, or the policy's distribution (item 9 above)."""
    roll_tensor = packed_roll if packed_roll is not None else megatron["roll_tensor"]
    autoscaler = megatron["MTPLossAutoScaler"]
    logging_helper = megatron["MTPLossLoggingHelper"]
    parallel_state = megatron["parallel_state"]
    logs_to_tracker = hasattr(logging_helper, "save_loss_to_tracker")

    def process_mtp_loss(hidden_states, labels, loss_mask, output_layer, output_weight, runtime_gather_output,
                         is_training, compute_language_model_loss, config, cp_group, packed_seq_params,
                         scale_logits, num_depths):
        """hidden_states [(1 + n) s, b, h] (n = num_depths) -> ([s, b, h] carrying the MTP loss
        to backward, [n] fp32 detached per-depth losses of this rank: summed over CP ranks, the
        means; [n] the same of the draft acceptance with policy targets (item 9 above), else None)."""
        hidden_states_list = torch.chunk(hidden_states, 1 + num_depths, dim=0)
        hidden_states = hidden_states_list[0]
        roll_kwargs = {"shifts": -1, "dims": -1, "cp_group": cp_group}
        if packed_roll is not None:
            roll_kwargs["packed_seq_params"] = packed_seq_params
        depth_targets, counts = _depth_targets(roll_tensor, labels, loss_mask, packed_seq_params, num_depths,
                                               roll_kwargs)
        # All depths' token counts (and the unrolled one) in one all-reduce over the CP group.
        original_num_tokens, *depth_num_tokens = _sum_over(torch.stack(counts), cp_group)
        scale = config.mtp_loss_scaling_factor / num_depths
        losses = torch.zeros(num_depths, dtype=torch.float32, device=hidden_states.device)

        def logits_of(hidden):
            logits, _ = output_layer(hidden, weight=output_weight, runtime_gather_output=runtime_gather_output)
            return logits if scale_logits is None else scale_logits(logits)

        # Stated by the forward's caller around its call (mtp_policy_target.policy_target):
        # megatron's forward carries no argument of the caller's to here.
        temperature = policy_target_temperature()
        depth_loss, overlaps = (compute_language_model_loss, None) if temperature is None else soft_depth_loss(
            temperature, policy_target_loss(), logits_of, hidden_states, depth_targets, roll_tensor, roll_kwargs,
            parallel_state.get_tensor_model_parallel_group())
        acceptance = None if overlaps is None else torch.zeros_like(losses)
        for depth in range(num_depths):
            mtp_logits = logits_of(hidden_states_list[depth + 1])
            num_tokens = depth_num_tokens[depth].clamp(min=1)
            rows, depth_labels, weights, _ = depth_targets[depth]
            if rows is not None:
                mtp_logits = mtp_logits.index_select(0, rows)
            mtp_loss = weights * depth_loss(depth_labels, mtp_logits)
            losses[depth] = torch.sum(mtp_loss).detach() / num_tokens
            if overlaps is not None:
                acceptance[depth] = torch.sum(weights * overlaps.pop()) / num_tokens
            # 0.19 replaced this logger with one that also wants acceptance counts. Its tracker
            # holds one value per MTP layer; depths past them (item 10) are in `losses` alone.
            if is_training and logs_to_tracker and depth < config.mtp_num_layers:
                logging_helper.save_loss_to_tracker(
                    losses[depth], depth, config.mtp_num_layers,
                    avg_group=parallel_state.get_data_parallel_group(with_context_parallel=True))
            if config.calculate_per_token_loss:
                mtp_loss = scale * mtp_loss * (original_num_tokens / num_tokens)
            else:
                mtp_loss = scale * mtp_loss / num_tokens
            hidden_states = autoscaler.apply(hidden_states, mtp_loss)
        return hidden_states, losses, acceptance

    return process_mtp_loss


def _depth_targets(roll_tensor, labels, loss_mask, packed_seq_params, num_depths, roll_kwargs):
    """What each MTP depth predicts: ([(rows, labels, weights, policy_rows) per depth],
    [unrolled token count, then each depth's]) on this rank; a depth's loss is weights *
    CE(labels, its logits at `rows`), its policy target the main logits at `policy_rows`.
    labels, loss_mask (None: all ones): [b, s]. Without explicit targets depth k's labels
    and weights are the labels and mask rolled k times (rows, policy_rows None: rolled too);
    with them (item 8 above) rows [E], labels [1, E], weights [1, E], policy_rows [E]."""
    if loss_mask is None:
        loss_mask = torch.ones_like(labels)
    targets = getattr(packed_seq_params, MTP_TARGETS_ATTRIBUTE, None)
    if targets is None:
        return _rolled_per_depth(roll_tensor, labels, loss_mask, num_depths, roll_kwargs)
    if len(targets) != num_depths:
        raise ValueError(f"packed_seq_params.{MTP_TARGETS_ATTRIBUTE} holds {len(targets)} depths of targets; the "
                         f"model trains {num_depths} MTP depths")
    counts = [loss_mask.sum()] + [weights.sum().to(loss_mask.dtype) for _, _, weights, _ in targets]
    return [(rows, target_labels[None], weights[None], policy_rows)
            for rows, target_labels, weights, policy_rows in targets], counts


def _rolled_per_depth(roll_tensor, labels, loss_mask, num_depths, roll_kwargs):
    """([(None, labels, mask, None) per depth k, each rolled k times], [unrolled token count,
    then each depth's]) on this rank."""
    depth_targets, counts = [], [loss_mask.sum()]
    for _ in range(num_depths):
        labels, _ = roll_tensor(labels, **roll_kwargs)
        loss_mask, num_tokens = roll_tensor(loss_mask, **roll_kwargs)
        depth_targets.append((None, labels, loss_mask, None))
        counts.append(num_tokens)
    return depth_targets, counts


def _sum_over(count, group):
    """Token counts (any shape) summed over `group`, in a copy."""
    return all_reduced(count.clone(), group)


def _make_checkpointed_forward(original, megatron, probes):
    """`MultiTokenPredictionLayer._checkpointed_forward` that checkpoints tensors only.

    `tensor_parallel.checkpoint` saves its arguments with `save_for_backward` (tensors and
    None only): 0.14 - 0.17 pass every argument (packed-sequence parameters fail), 0.18 not
    the `padding_mask` its own forward passes. fp8/fp4 recompute goes to the release's own.
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


# The packed MTP roll, vectorised.

def _make_roll_tensor(original):
    """megatron-core's `roll_tensor` (0.16+) with the packed path replaced by `roll_packed`.

    megatron-core 0.16 - 0.19's packed roll loops over the sequences in Python and, under CP,
    exchanges each sequence's chunk boundaries with an isend/irecv pair: four rolls per MTP
    depth, each 128 waits per rank for 64 sequences at CP 2. `roll_packed` gives the same
    values with one all-gather. Everything else goes to `original` as it came: padded
    batches, None (0.19 returns (None, None)), another shift or dimension (megatron
    asserts), and a tensor that requires grad (the all-gather would cut its gradient; no
    megatron caller passes one).
    """
    def roll_tensor(tensor, shifts=-1, dims=-1, cp_group=None, packed_seq_params=None):
        """tensor [..., s] -> (rolled [..., s] in tensor's dtype, rolled.sum())."""
        if packed_seq_params is None or tensor is None or shifts != -1 or dims not in (-1, tensor.dim() - 1):
            return original(tensor, shifts=shifts, dims=dims, cp_group=cp_group, packed_seq_params=packed_seq_params)
        if tensor.requires_grad:
            warnings.warn(f"mtp_patch: roll_tensor got a {tensor.dtype} tensor that requires grad; rolling it "
                          "with megatron-core's per-sequence packed roll (the vectorised one carries no gradient)")
            return original(tensor, shifts=shifts, dims=dims, cp_group=cp_group, packed_seq_params=packed_seq_params)
        rolled = roll_packed(tensor, packed_seq_params, cp_group)
        return rolled, rolled.sum()

    roll_tensor.__wrapped__ = original
    return roll_tensor


def roll_packed(tensor, packed_seq_params, cp_group=None):
    """Megatron's packed MTP roll, vectorised: every slot takes the value at the next position
    of its own padded sequence, the last position of each sequence takes 0.

    tensor: [..., T_local] (int64 ids, positions or labels; fp32 loss masks; any dtype the
      group can all-gather), not requiring grad: this CP rank's slots, the sequences
      concatenated, each sequence's share its chunks r and 2*cp-1-r at CP > 1 (zigzag THD).
    packed_seq_params: megatron-core's PackedSeqParams; `cu_seqlens_q` [B + 1] int holds the
      padded boundaries of the whole batch (global: divided by cp, the local ones), each a
      multiple of 2*cp at CP > 1. Slots past the last boundary keep their value.
    cp_group: the context-parallel process group; None means CP 1.
    Returns [..., T_local] in tensor's dtype, equal to megatron-core's `_roll_tensor_packed_seq`,
    after one all-gather under CP. The index map is kept on `packed_seq_params` for the
    forward's other rolls.
    """
    if tensor.requires_grad:
        raise ValueError(f"roll_packed got a {tensor.dtype} tensor of shape {tuple(tensor.shape)} that requires "
                         "grad: its all-gather carries no gradient (megatron rolls ids, positions, labels, masks)")
    cp_size = 1 if cp_group is None else cp_group.size()
    cp_rank = 0 if cp_size == 1 else torch.distributed.get_rank(group=cp_group)
    local_tokens = tensor.shape[-1]
    source = _roll_source(packed_seq_params, cp_size, cp_rank, local_tokens, tensor.device)
    rows = tensor.reshape(-1, local_tokens)
    if cp_size > 1:
        gathered = rows.new_empty((cp_size * rows.shape[0], local_tokens))
        torch.distributed.all_gather_into_tensor(gathered, rows.contiguous(), group=cp_group)
        # [cp, rows, T_local] -> [rows, cp * T_local]: each row's slots of every rank, in rank order.
        rows = gathered.view(cp_size, -1, local_tokens).transpose(0, 1).reshape(rows.shape[0], -1)
    with_fill = torch.cat([rows, rows.new_full((rows.shape[0], 1), ROLL_FILL_VALUE)], dim=1)
    return with_fill.index_select(1, source).view(tensor.shape)


def _roll_source(packed_seq_params, cp_size, cp_rank, local_tokens, device):
    """`_roll_source_index` for this batch and layout, computed on first use and kept on
    `packed_seq_params` (which a forward hands to every roll)."""
    cu_seqlens = packed_seq_params.cu_seqlens_q
    layout = (cp_size, cp_rank, local_tokens, device)
    cached = getattr(packed_seq_params, ROLL_SOURCE_ATTRIBUTE, None)
    if cached is not None and cached[0] is cu_seqlens and cached[1] == layout:
        return cached[2]
    source = _roll_source_index(cu_seqlens, cp_size, cp_rank, local_tokens, device)
    setattr(packed_seq_params, ROLL_SOURCE_ATTRIBUTE, (cu_seqlens, layout, source))
    return source


def _roll_source_index(cu_seqlens, cp_size, cp_rank, local_tokens, device):
    """[T_local] int64: for each local slot, the column its rolled value comes from in
    [every rank's T_local slots, in rank order; one fill value] ([cp * T_local + 1]).

    A slot at padded position p of its sequence reads position p + 1 wherever it is held:
    in the zigzag layout position q lies in chunk q // chunk, on rank c for chunk c < cp
    (its front half) and on rank 2*cp-1-c otherwise (its back half). The last position
    reads the fill value; a slot past the last boundary reads itself.
    """
    cu_seqlens = _checked_boundaries(cu_seqlens, cp_size, local_tokens).to(device)
    bounds = cu_seqlens // cp_size  # megatron's: the global boundaries divided by cp
    num_sequences = len(bounds) - 1
    slot = torch.arange(local_tokens, device=device)
    sequence = torch.searchsorted(bounds[1:], slot, right=True)  # empty sequences hold no slot
    inside = sequence < num_sequences
    sequence = sequence.clamp(max=max(num_sequences - 1, 0))
    start = bounds[sequence]
    local_length = bounds[sequence + 1] - start
    offset = slot - start
    if cp_size == 1:
        next_rank, next_offset = 0, offset + 1
        is_last = next_offset == local_length
    else:
        # cp_thd's zigzag layout, copied (see CHUNKS_PER_RANK). clamp: a slot outside every
        # sequence may see an empty one (its result is discarded).
        chunk = (local_length // CHUNKS_PER_RANK).clamp(min=1)
        last_chunk = CHUNKS_PER_RANK * cp_size - 1
        in_front = offset < chunk
        position = torch.where(in_front, cp_rank * chunk + offset, (last_chunk - cp_rank) * chunk + offset - chunk)
        next_position = position + 1
        is_last = next_position == (last_chunk + 1) * chunk
        next_chunk, within_chunk = next_position // chunk, next_position % chunk
        next_in_front = next_chunk < cp_size
        next_rank = torch.where(next_in_front, next_chunk, last_chunk - next_chunk)
        next_offset = torch.where(next_in_front, within_chunk, chunk + within_chunk)
    source = torch.where(is_last, cp_size * local_tokens, next_rank * local_tokens + start + next_offset)
    return torch.where(inside, source, cp_rank * local_tokens + slot)


def _checked_boundaries(cu_seqlens, cp_size, local_tokens):
    """cu_seqlens as int64, after checking it fits the layout (one device-to-host sync)."""
    if not torch.is_tensor(cu_seqlens) or cu_seqlens.dim() != 1 or len(cu_seqlens) == 0 or (
            cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype.is_complex or cu_seqlens.dtype == torch.bool):
        described = (f"{cu_seqlens.dtype} of shape {tuple(cu_seqlens.shape)}" if torch.is_tensor(cu_seqlens)
                     else type(cu_seqlens).__name__)
        raise ValueError(f"packed_seq_params.cu_seqlens_q must be a 1-D integer tensor [B + 1], got {described}")
    cu_seqlens = cu_seqlens.long()
    multiple = CHUNKS_PER_RANK * cp_size if cp_size > 1 else 1
    misaligned, decreasing, total = torch.stack([
        (cu_seqlens % multiple != 0).any(), (cu_seqlens.diff() < 0).any(), cu_seqlens[-1]]).tolist()
    if misaligned:
        index = int(torch.nonzero(cu_seqlens % multiple != 0)[0])
        raise ValueError(f"packed_seq_params.cu_seqlens_q[{index}] = {int(cu_seqlens[index])} is not a multiple of "
                         f"2*cp = {multiple}: under context parallelism each sequence is padded to a multiple of "
                         "2*cp and cut into 2*cp chunks")
    if decreasing:
        index = int(torch.nonzero(cu_seqlens.diff() < 0)[0])
        raise ValueError(f"packed_seq_params.cu_seqlens_q decreases at {index + 1}: "
                         f"{int(cu_seqlens[index])} -> {int(cu_seqlens[index + 1])}")
    if total > cp_size * local_tokens:
        raise ValueError(f"packed_seq_params.cu_seqlens_q ends at {total}, past the {cp_size * local_tokens} slots "
                         f"of the batch (cp {cp_size} x {local_tokens} local)")
    return cu_seqlens
