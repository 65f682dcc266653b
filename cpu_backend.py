"""Run megatron-core where CUDA is absent: process group, CUDA-call redirects, RNG tracker.

megatron-core assumes a GPU in a handful of places that have nothing to do with the math
(where to put a buffer, how to save and restore the CUDA RNG). On a CPU-only machine
`install_cpu_redirects()` points exactly those places at the CPU, and installs an RNG
tracker that keeps one CPU generator per tracked state, so dropout inside
tensor-parallel regions is reproducible and never disturbs the default generator.
megatron-core's optimizer hard-codes CUDA in more places; `cuda_on_cpu()` covers those
for the duration of a block. Where CUDA is available every function here leaves
megatron-core untouched.

    from cpu_backend import init_distributed, init_model_parallel, cuda_on_cpu
    rank, world_size, device = init_distributed()          # under torchrun, or alone
    init_model_parallel(tensor_parallel=2, context_parallel=1, seed=1234)
    with cuda_on_cpu():
        optimizer = get_megatron_optimizer(optimizer_config, [ddp_model])

Imports only torch, the standard library and megatron-core.
"""

import contextlib
import datetime
import os
import socket

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from megatron.core import parallel_state
from megatron.core import utils as megatron_utils
from megatron.core.fusions import fused_softmax
from megatron.core.models.common.embeddings import rope_utils, rotary_pos_embedding, yarn_rotary_pos_embedding
from megatron.core.optimizer import clip_grads, optimizer as megatron_optimizer
from megatron.core.tensor_parallel import mappings, random as megatron_random
from megatron.core.transformer.moe import token_dispatcher

DEFAULT_TIMEOUT_MINUTES = 30
# How long ranks wait for each other to form a process group before they give up, saying so.
FORM_TIMEOUT_SECONDS = 300


def free_port():
    """A TCP port on localhost nobody listens on right now (for single-process runs and tests)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def init_distributed(timeout_minutes=DEFAULT_TIMEOUT_MINUTES, form_timeout_seconds=FORM_TIMEOUT_SECONDS):
    """Initialise torch.distributed from torchrun's environment; returns (rank, world_size, device).

    gloo on CPU, nccl on GPU (one device per LOCAL_RANK). Run without torchrun it becomes a
    world of one on a free local port. Installs the CPU redirects when CUDA is absent.
    Calling it again after initialisation returns the same answer and does nothing else.

    Under torchrun the group forms through the agent's store, which outlives a restart:
    each attempt (TORCHELASTIC_RESTART_COUNT) gets its own key prefix, or the restarted
    workers would read the dead workers' addresses and wait on them. A group that does not
    form within `form_timeout_seconds` raises RuntimeError saying so; collectives after
    that may take `timeout_minutes`.
    """
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
        install_cpu_redirects()
        if "LOCAL_WORLD_SIZE" in os.environ and "OMP_NUM_THREADS" not in os.environ:
            # torchrun sets OMP_NUM_THREADS=1 only with --nproc_per_node > 1. A process it
            # starts alone kept torch's default (every core) for the whole run, since vLLM's
            # CPU worker then blocks torch.set_num_threads (its own call for one thread
            # included): its sums split over other threads than a node of two's and, on a
            # loaded machine, came out different in the 7th digit. One thread, as torchrun
            # gives every process of a larger node; OMP_NUM_THREADS overrides it.
            torch.set_num_threads(1)
    if not dist.is_initialized():
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        os.environ.setdefault("LOCAL_RANK", "0")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        address = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        form_timeout = datetime.timedelta(seconds=form_timeout_seconds)
        try:
            store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                                  is_master=rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True",
                                  timeout=form_timeout)
            dist.init_process_group(backend=backend, store=dist.PrefixStore(f"/attempt_{attempt}", store),
                                    rank=rank, world_size=world_size,
                                    timeout=datetime.timedelta(minutes=timeout_minutes))
        except (RuntimeError, dist.DistStoreError) as error:
            raise RuntimeError(f"rank {rank}: the process group of {world_size} ranks at {address} (attempt "
                               f"{attempt}) did not form within {form_timeout_seconds} s: {error}") from error
    return dist.get_rank(), dist.get_world_size(), device


def init_model_parallel(tensor_parallel=1, context_parallel=1, seed=1234, expert_parallel=1, pipeline_parallel=1):
    """megatron-core's parallel groups and RNG seeds, after `init_distributed`.

    Data parallel is what remains of the world; `expert_parallel` ranks of it (times the
    context-parallel ones) split an MoE layer's experts; `pipeline_parallel` stages split
    the layers (megatron's embedding group, over gloo on CPU, joins the first and last
    stage). Re-initialises if groups already exist (tests run several layouts in one process).
    """
    world_size = dist.get_world_size()
    if world_size % (tensor_parallel * context_parallel):
        raise ValueError(f"tensor_parallel={tensor_parallel} x context_parallel={context_parallel} "
                         f"does not divide the world size {world_size}")
    if world_size % (tensor_parallel * expert_parallel):
        raise ValueError(f"tensor_parallel={tensor_parallel} x expert_parallel={expert_parallel} "
                         f"does not divide the world size {world_size}")
    for name, size in (("context_parallel", context_parallel), ("expert_parallel", expert_parallel)):
        if world_size % (tensor_parallel * size * pipeline_parallel):
            raise ValueError(f"tensor_parallel={tensor_parallel} x {name}={size} x pipeline_parallel="
                             f"{pipeline_parallel} does not divide the world size {world_size}")
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tensor_parallel,
                                             context_parallel_size=context_parallel,
                                             expert_model_parallel_size=expert_parallel,
                                             pipeline_model_parallel_size=pipeline_parallel)
    if not torch.cuda.is_available():
        # On GPU, model_parallel_cuda_manual_seed seeds the default CUDA generator with the
        # data-parallel seed (the same on every rank); the default CPU generator is its
        # counterpart here. megatron's CPU weight init draws the full master weight from it
        # on every TP rank and keeps a slice, so it must agree across ranks.
        torch.manual_seed(seed)
    megatron_random.model_parallel_cuda_manual_seed(seed)


class CpuRNGStatesTracker:
    """megatron's `CudaRNGStatesTracker` interface over CPU generators.

    Each tracked name ("model-parallel-rng", "data-parallel-rng", "expert-parallel-rng")
    owns a `torch.Generator`. On CPU, dropout draws from the default generator and takes no
    generator argument, so `fork(name)` swaps the named generator's state into the default
    generator for the duration of the block and swaps both back afterwards: the default
    generator continues exactly where it was, the named one where it stopped.
    `get_states`/`set_states` exchange state tensors (snapshots), as activation recompute
    (`CheckpointFunction`) expects: it restores them to replay dropout bit for bit.
    """

    def __init__(self, *args, **kwargs):
        # megatron passes use_cudagraphable_rng / is_inference_rng_tracker; neither
        # applies on CPU.
        self.reset()

    def is_initialized(self):
        return self._is_initialized

    def reset(self):
        self._is_initialized = False
        self.generators = {}
        self.seeds = set()

    def get_states(self):
        return {name: generator.get_state() for name, generator in self.generators.items()}

    def set_states(self, states):
        self._is_initialized = True
        self.generators = {}
        for name, state in states.items():
            self.generators[name] = torch.Generator()
            self.generators[name].set_state(state)

    def add(self, name, seed):
        self._is_initialized = True
        if seed in self.seeds:
            raise ValueError(f"seed {seed} is already tracked (names: {sorted(self.generators)})")
        if name in self.generators:
            raise ValueError(f"rng state {name!r} is already tracked")
        self.seeds.add(seed)
        self.generators[name] = torch.Generator().manual_seed(seed)

    @contextlib.contextmanager
    def fork(self, name=megatron_random._MODEL_PARALLEL_RNG_TRACKER_NAME):
        if name not in self.generators:
            raise ValueError(f"rng state {name!r} is not tracked; tracked: {sorted(self.generators)}")
        default_state = torch.get_rng_state()
        torch.set_rng_state(self.generators[name].get_state())
        try:
            yield
        finally:
            self.generators[name].set_state(torch.get_rng_state())
            torch.set_rng_state(default_state)


def _no_cuda_rng_state(*args, **kwargs):
    # There is no CUDA generator; the CPU generator's state is saved separately by the
    # same callers (torch.get_rng_state), so an empty state is complete.
    return torch.empty(0, dtype=torch.uint8)


def _ignore_cuda_rng_state(new_state, *args, **kwargs):
    return None


def _cpu_current_device():
    return "cpu"


def _cpu_default_causal_mask(sq):
    return torch.triu(torch.ones(sq, sq, device="cpu"), diagonal=1).bool()


def _cpu_pos_emb_on_this_cp_rank(pos_emb, seq_dim, cp_group):
    # megatron's, without the pinned host copy of its two chunk ids it sends to the GPU:
    # this rank's zigzag chunks (r and 2 cp - 1 - r) of the rotary table along seq_dim.
    if cp_group is None:
        raise ValueError("cp_group must be provided to get positional embedding per CP rank")
    cp_size, cp_rank = cp_group.size(), cp_group.rank()
    cp_idx = torch.tensor([cp_rank, 2 * cp_size - cp_rank - 1], device=pos_emb.device)
    pos_emb = pos_emb.view(*pos_emb.shape[:seq_dim], 2 * cp_size, -1, *pos_emb.shape[seq_dim + 1:])
    pos_emb = pos_emb.index_select(seq_dim, cp_idx)
    return pos_emb.view(*pos_emb.shape[:seq_dim], -1, *pos_emb.shape[seq_dim + 2:])


def _multi_tensor_scale(chunk_size, noop_flag, tensor_lists, scale):
    for source, destination in zip(*tensor_lists):
        if source is destination:
            destination.mul_(scale)
        elif scale == 1.0:
            destination.copy_(source)
        else:
            destination.copy_(source * scale)


class HostStream:
    """The parts of `torch.cuda.Stream` megatron-core's MoE layers call, where work runs in
    order on the host: there is nothing to wait for, and a recorded event is complete."""

    def __init__(self, *args, **kwargs):
        # megatron passes a device or a priority; neither applies on the host.
        pass

    def wait_stream(self, stream):
        return None

    def record_event(self, event=None):
        return event or HostEvent()


class HostEvent:
    """The part of `torch.cuda.Event` the all-to-all dispatcher calls: complete when recorded."""

    def synchronize(self):
        return None


# The one stream the host runs on, as torch.cuda.current_stream() names the device's.
_HOST_STREAM = HostStream()


def _current_host_stream(device=None):
    return _HOST_STREAM


def _on_host_stream(stream):
    return contextlib.nullcontext()


def _host_copy(tensor, as_numpy=False, record_stream=False):
    # megatron's maybe_move_tensor_to_cpu, which copies only CUDA tensors: on the host the
    # all-to-all dispatcher's split sizes stayed tensors, which all_to_all_single's binding
    # refuses (it takes a sequence of ints; a CUDA tensor's host copy is a numpy array).
    if as_numpy and torch.is_tensor(tensor):
        return tensor.numpy()
    return tensor


def _gather_uneven_along_first_dim(input_, group, output_split_sizes=None, use_global_buffer=False):
    # gloo's all_gather takes equal parts only. The all-to-all dispatcher's gather over the
    # tensor-parallel ranks (each holds the tokens its sequence slice routed to this rank's
    # experts) has uneven ones: padded to the largest, gathered, trimmed.
    if output_split_sizes is None or group.size() == 1:
        return _GATHER_ALONG_FIRST_DIM(input_, group, output_split_sizes, use_global_buffer)
    padded = input_.new_zeros((max(output_split_sizes), *input_.shape[1:]))
    padded[:input_.shape[0]] = input_
    parts = [torch.empty_like(padded) for _ in output_split_sizes]
    dist.all_gather(parts, padded, group=group)
    return torch.cat([part[:size] for part, size in zip(parts, output_split_sizes)])


def _reduce_scatter_uneven_along_first_dim(input_, group, input_split_sizes=None, use_global_buffer=False):
    # The gather's counterpart (its backward, and the dispatcher's combine): gloo has no
    # reduce-scatter of uneven parts, so the whole is summed and this rank keeps its part.
    if input_split_sizes is None or group.size() == 1:
        return _REDUCE_SCATTER_ALONG_FIRST_DIM(input_, group, input_split_sizes, use_global_buffer)
    summed = input_.contiguous().clone()
    dist.all_reduce(summed, group=group)
    return summed.split(list(input_split_sizes))[group.rank()].clone()


_GATHER_ALONG_FIRST_DIM = mappings._gather_along_first_dim
_REDUCE_SCATTER_ALONG_FIRST_DIM = mappings._reduce_scatter_along_first_dim


def _grad_norm_in_float64(grads_for_norm, norm_type=2, grad_stats_parallel_group=None):
    # Summed in float64, the norm no longer depends on how the gradients are split: the
    # distributed optimizer sums its shards' squares over ranks, the plain one whole
    # tensors', and in float32 the two differ in the last bits and so clip differently.
    if float(norm_type) != 2.0:
        return _GRAD_NORM_IN_FLOAT32(grads_for_norm, norm_type, grad_stats_parallel_group)
    if isinstance(grads_for_norm, torch.Tensor):
        grads_for_norm = [grads_for_norm]
    squares = torch.zeros(1, dtype=torch.float64)
    for grad in grads_for_norm:
        squares += torch.linalg.vector_norm(grad, dtype=torch.float64) ** 2
    dist.all_reduce(squares, group=grad_stats_parallel_group)
    return squares.item() ** 0.5


_GRAD_NORM_IN_FLOAT32 = clip_grads.get_grad_norm_fp32


def install_cpu_redirects():
    """Point megatron-core's CUDA-only calls at the CPU; a no-op when CUDA is available.

    Idempotent; returns True when the redirects are (now) in place. Each redirect, and the
    megatron-core code it serves (0.14 - 0.19):
    - `torch.cuda.current_device` -> "cpu": buffers allocated with
      `device=torch.cuda.current_device()` (RoPE `inv_freq`, the MTP `roll_tensor` CP
      exchange, the MTP loss tracker, vocab-parallel layers' weight allocation).
    - `torch.cuda.get_rng_state`, `random._get_cuda_rng_state` -> an empty state and
      `random._set_cuda_rng_state` -> no-op: activation recompute (`CheckpointFunction`,
      `_get_all_rng_states`) saves and restores "the CUDA RNG" next to the CPU one.
    - `random.CudaRNGStatesTracker` -> `CpuRNGStatesTracker`, and the tracker instance:
      `get_cuda_rng_tracker().fork()` around tensor-parallel weight init and dropout, and
      `model_parallel_cuda_manual_seed` which `add`s the tracked seeds.
    - `fused_softmax.get_default_causal_mask` -> the same mask built on the CPU: megatron's
      local `DotProductAttention` with `attention_mask=None` builds it with device="cuda".
    - `get_pos_emb_on_this_cp_rank` (where rope_utils and the rotary embeddings import it)
      -> the same slice without a pinned CUDA copy: at CP > 1 YaRN's rotary embedding
      (DeepSeek's MLA) calls it while it is built.
    - the optimizer's `multi_tensor_scale` fallback (no apex, no Transformer Engine) ->
      one in place: megatron's writes `dst.copy_(src * scale)`, a temporary and two extra
      passes over every gradient when clipping scales them in place (a quarter of the
      optimizer step on CPU).
    - the optimizers' gradient norm -> the same L2 norm summed in float64, so that
      clipping scales the gradients alike whether the distributed optimizer holds them in
      shards or not.
    - `torch.cuda.Stream`, `torch.cuda.current_stream`, `torch.cuda.stream` -> a
      `HostStream` and a context that does nothing: the all-to-all MoE dispatcher copies
      its split sizes to the host on a side stream and synchronises with it (MoE shared
      experts may overlap on one too); on the host the copy is already done.
    - the all-to-all dispatcher's `maybe_move_tensor_to_cpu` -> one that hands the split
      sizes over as numpy arrays, as megatron's own does for a CUDA tensor:
      `all_to_all_single` takes a sequence of ints and refuses a tensor.
    - `mappings._gather_along_first_dim` and `_reduce_scatter_along_first_dim` given split
      sizes -> the same over gloo's equal-part collectives: under TP x EP the all-to-all
      dispatcher gathers and reduce-scatters uneven parts over the tensor-parallel ranks.
    `torch.cuda.manual_seed`, also called by `model_parallel_cuda_manual_seed`, is left
    alone (on a build without CUDA it is queued lazily and never runs);
    `init_model_parallel` seeds the default CPU generator in its place.
    """
    if torch.cuda.is_available():
        return False
    if isinstance(megatron_random._CUDA_RNG_STATE_TRACKER, CpuRNGStatesTracker):
        return True
    torch.cuda.current_device = _cpu_current_device
    torch.cuda.get_rng_state = _no_cuda_rng_state
    megatron_random._get_cuda_rng_state = _no_cuda_rng_state
    megatron_random._set_cuda_rng_state = _ignore_cuda_rng_state
    megatron_random.CudaRNGStatesTracker = CpuRNGStatesTracker
    fused_softmax.get_default_causal_mask = _cpu_default_causal_mask
    for module in (rope_utils, rotary_pos_embedding, yarn_rotary_pos_embedding):
        if hasattr(module, "get_pos_emb_on_this_cp_rank"):
            module.get_pos_emb_on_this_cp_rank = _cpu_pos_emb_on_this_cp_rank
    for module in (clip_grads, megatron_optimizer):
        if module.multi_tensor_scale_impl is megatron_utils.local_multi_tensor_scale:
            module.multi_tensor_scale_impl = _multi_tensor_scale
        module.get_grad_norm_fp32 = _grad_norm_in_float64
    torch.cuda.Stream, torch.cuda.current_stream, torch.cuda.stream = HostStream, _current_host_stream, _on_host_stream
    if hasattr(token_dispatcher, "maybe_move_tensor_to_cpu"):
        token_dispatcher.maybe_move_tensor_to_cpu = _host_copy
    mappings._gather_along_first_dim = _gather_uneven_along_first_dim
    mappings._reduce_scatter_along_first_dim = _reduce_scatter_uneven_along_first_dim
    megatron_random._CUDA_RNG_STATE_TRACKER = CpuRNGStatesTracker()
    megatron_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    return True


class _CudaOnCpu(TorchFunctionMode):
    def __enter__(self):
        # The pipeline schedules' shape exchange synchronises the device after its sends.
        self._synchronize, torch.cuda.synchronize = torch.cuda.synchronize, _no_synchronize
        return super().__enter__()

    def __exit__(self, *exc_info):
        torch.cuda.synchronize = self._synchronize
        return super().__exit__(*exc_info)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda and args[0].device.type == "cpu":
            return args[0]
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "cuda":
            kwargs["device"] = "cpu"
        if func is torch.Tensor.type and len(args) == 1 and not kwargs and args[0].device.type == "cpu":
            return func(*args).replace("torch.", "torch.cuda.", 1)
        return func(*args, **kwargs)


def _no_synchronize(device=None):
    return None


def cuda_on_cpu():
    """A context in which megatron-core's optimizer and pipeline schedules run on the CPU; a
    no-op where CUDA is available.

    megatron-core's optimizer (0.16: `FP32Optimizer`, `Float16OptimizerWithFloat16Params`,
    `clip_grads`, the local multi-tensor norm, the distributed optimizer) allocates
    scalars and buffers with `device="cuda"` and asserts `grad.type() ==
    "torch.cuda.FloatTensor"`. Inside the block, tensor factories given a CUDA device
    allocate on the CPU, and CPU tensors name their type as the CUDA one. For pipeline
    parallelism also: `tensor.cuda()` of a CPU tensor is the tensor itself (a later stage's
    copy of the word embeddings is all-reduced from `weight.data.cuda()` when built), and
    `torch.cuda.synchronize()` does nothing (the 1F1B schedule's shape exchange calls it).
    Scoped, not installed: wrap `get_megatron_optimizer`, `optimizer.step()`,
    `optimizer.load_state_dict()`, a pipeline-parallel model's construction and the
    schedule, and nothing else sees the disguise.
    """
    return contextlib.nullcontext() if torch.cuda.is_available() else _CudaOnCpu()
