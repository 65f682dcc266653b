"""Pipeline parallelism for RL: megatron-core's 1F1B schedule over packed THD micro-batches.

With `pipeline_parallel` stages each rank holds a slice of the layers (megatron_model.py
builds it: the embedding on the first stage, the output layer and the MTP layers on the
last). One optimizer step's micro-batches flow through megatron-core's non-interleaved
1F1B schedule (`get_forward_backward_func`): stage s runs the forward of micro-batch m
while stage s + 1 runs m - 1, each backward as early as its forward allows.

    losses = forward_backward(ddp_model, micro_batches, stage_forward, last_stage_loss)
    sum_embedding_grads(model)                  # after DDP's reduction, before the optimizer

The callers supply what each stage computes from a micro-batch (any object: the schedule
hands each stage the same ones in the same order): `stage_forward(micro)` on a stage
before the last returns its hidden states [s, b, h], `last_stage_loss(micro)` on the last
stage its loss (a scalar: already its share of the step's loss, as without stages: the
schedule's own division by the number of micro-batches is undone). Log-probs, the GRPO
loss and the MTP loss are all computed on the last stage.

How the packed micro-batches cross stages: each micro-batch packs to another length, so
the models' config sets `variable_seq_lengths` and the schedule sends each tensor's shape
before the tensor (one small message per hop). The MTP loss's backward scale is the
caller's (megatron's schedule would set 1 / micro-batches after every forward), one for
the step or one per micro-batch (token-budget micro-batches weigh each by its tokens). On a CPU
the schedule runs inside `cpu_backend.cuda_on_cpu()` (it allocates with device="cuda"
and synchronises the device).

Imports torch, megatron-core and cpu_backend.
"""

import contextlib

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler

from cpu_backend import cuda_on_cpu


def stages():
    """The number of pipeline stages megatron-core's groups were built with (1 before they exist)."""
    if not parallel_state.model_parallel_is_initialized():
        return 1
    return parallel_state.get_pipeline_model_parallel_world_size()


def is_last_stage():
    """Whether this rank holds the last stage (the output layer, the MTP layers and the loss)."""
    return stages() == 1 or parallel_state.is_pipeline_last_stage()


@contextlib.contextmanager
def _mtp_loss_scale_kept():
    """Inside: the MTP loss's backward scale stays what the caller set (the schedule sets
    its own after every forward, for a loss divided by the number of micro-batches); yields
    megatron's setter, for the caller's own settings."""
    setter = MTPLossAutoScaler.__dict__["set_loss_scale"]
    MTPLossAutoScaler.set_loss_scale = staticmethod(lambda scale: None)
    try:
        yield setter.__func__
    finally:
        MTPLossAutoScaler.set_loss_scale = setter


def forward_backward(ddp_model, micro_batches, stage_forward, last_stage_loss, forward_only=False,
                     mtp_loss_scales=None):
    """Run every micro-batch through the stages, forward and (unless `forward_only`) backward.

    ddp_model: megatron-core's DDP around this stage's GPTModel (its `no_sync` holds the
    gradient all-reduce until the last backward); micro_batches: a list, the same on every
    stage of a pipeline; mtp_loss_scales: None (the MTP loss keeps the scale the caller
    set) or each micro-batch's MTP loss scale (a scalar tensor). Returns the last stage's
    losses ([float] per micro-batch, in order; [] on other stages). Gradients accumulate
    into `main_grad` as without stages.
    """
    model = ddp_model.module if hasattr(ddp_model, "module") else ddp_model
    config = model.config
    count = len(micro_batches)
    last = is_last_stage()
    losses = []

    def forward_step(data_iterator, _model):
        index, micro = next(data_iterator)
        if not last:
            return stage_forward(micro), None
        if mtp_loss_scales is not None:
            # 1F1B runs the last stage's backward of a micro-batch right after its forward
            # (no warm-up there), so the scale set here is the one that backward reads.
            set_mtp_loss_scale(mtp_loss_scales[index])
        loss = last_stage_loss(micro)
        losses.append(float(loss.detach()))
        # The schedule divides the loss by its token count (1 here) and by the number of
        # micro-batches: multiplied back, the backward sees the caller's loss.
        return loss, lambda output: (output * count, torch.ones((), dtype=torch.int), {})

    config.no_sync_func = None if forward_only else ddp_model.no_sync
    schedule = get_forward_backward_func()
    with cuda_on_cpu(), _mtp_loss_scale_kept() as set_mtp_loss_scale:
        # seq_length and micro_batch_size only size fixed shapes; variable_seq_lengths sends each.
        schedule(forward_step_func=forward_step, data_iterator=iter(enumerate(micro_batches)), model=[ddp_model],
                 num_microbatches=count, seq_length=1, micro_batch_size=1, forward_only=forward_only)
    return losses


def sum_embedding_grads(model, attribute="main_grad"):
    """Sum the word embeddings' gradient (`param.<attribute>`) over megatron's embedding group:
    the first stage's table and the last stage's copy (its MTP layers' input) are one
    tensor trained once, as megatron-core's `finalize_model_grads` does. A no-op without
    stages or on a stage that holds neither."""
    # Both ends decide alike, from the config: the last stage holds a copy only for MTP
    # layers or an output layer tied to the embeddings.
    tied = model.share_embeddings_and_output_weights or model.config.mtp_num_layers
    if stages() == 1 or not tied or not parallel_state.is_rank_in_embedding_group():
        return
    weight = model.shared_embedding_or_output_weight()
    dist.all_reduce(getattr(weight, attribute), group=parallel_state.get_embedding_group())


def from_last_stage(values):
    """`values` (a list of floats) as the last stage has them, on every stage of this pipeline."""
    if stages() == 1:
        return values
    device = "cuda" if torch.cuda.is_available() else "cpu"
    # float64: the sums and extremes travel exactly.
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.broadcast(tensor, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                   group=parallel_state.get_pipeline_model_parallel_group())
    return tensor.tolist()
