"""The train phase of GRPO on Megatron-Core: one rollout batch -> optimizer steps.

    config = TrainConfig(lr=1e-3, loss=grpo_loss.LossConfig(clip_high=0.28))
    policy = build_policy(model_dir, config)               # GPTModel shard + DDP + Adam
    sums = train(policy, samples, config)                  # ppo_epochs x mini_batches steps
    metrics = reduce_metrics(sums, device)                 # the step's values, same on every rank

A sample is one completion: {prompt_ids, response_ids (lists of ints), advantages [R]
fp32, rollout_logprobs (R floats, the rollout engine's), group (the index of its prompt's
group: one group's samples are consecutive)}. Each micro-batch is packed THD
(forward.forward_logprobs: cp_thd zigzag under context parallel), its loss is
grpo_loss's, normalised over the global token or sequence count so that megatron-core's
DDP sum of gradients over data x context parallel ranks is the mean. The MTP loss
(--mtp-train) rides on the same backward pass. A non-finite loss or gradient norm stops
every rank before the optimizer touches the weights, so the last checkpoint stays good.

Every setting arrives in one `TrainConfig`, the loss's in its `grpo_loss.LossConfig`.
Imports torch, megatron-core and the project's forward, grpo_loss, cpu_backend,
megatron_model, hf_weights, pipeline (--pp: the micro-batches through the stages) and
seqlen_balancing (--max-tokens-per-micro-batch: micro-batches by tokens).
"""

import contextlib
import dataclasses
import itertools
import math

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.optimizer import DistributedOptimizer, OptimizerConfig, get_megatron_optimizer
from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler

import grpo_loss
import hf_weights
import pipeline
import seqlen_balancing
from cpu_backend import cuda_on_cpu
from forward import forward_logprobs, forward_stage
from megatron_model import build_gpt_model
from mtp_patch import set_mtp_depths

ADAM_EPS = 1e-8
# Gradient all-reduce buckets: at least four per model, so the first ones travel while
# backward computes the rest (the sums stay bit-identical), and at most megatron-core's own
# default size.
MIN_GRAD_BUCKETS = 4
MAX_GRAD_BUCKET_ELEMENTS = 40_000_000
# optimizer_state's key for the distributed optimizer's per-rank shards.
DISTRIBUTED_SHARDS = "distributed_shards"


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """What the train phase reads: the model's layout and numerics, the optimizer, how a
    rollout batch splits into optimizer steps and micro-batches, the MTP head, the loss."""
    lr: float = 1e-6                  # Adam's step size; RL on a pretrained model moves it little
    grad_clip: float = 1.0            # global norm: one outlier batch cannot wreck the policy
    tp: int = 1                       # Megatron tensor, context and expert parallel sizes
    cp: int = 1
    ep: int = 1
    pp: int = 1                       # pipeline stages (pipeline.py): the layers split, the MTP layers last
    bf16: bool = False                # bf16 weights, fp32 master weights: the GPU's; fp32 is exact on CPU
    temperature: float = 1.0          # the rollout's: log-probs of the distribution it sampled
    micro_batches: int = 1            # gradient accumulation per optimizer step
    mini_batches: int = 1             # optimizer steps per pass over the batch; 1 keeps the ratio at 1
    ppo_epochs: int = 1               # passes over the batch
    shared_prefix: bool = False       # each group's prompt once, its completions attending to it
    routing_replay: bool = False      # MoE: Megatron's routers take the rollout's experts
    mtp_train: bool = True            # the MTP head's loss rides on the policy's backward pass
    mtp_rollout: bool = True          # vLLM drafts with the head: the trunk's final norm stays frozen
    mtp_loss_scale: float = 1.0       # x megatron's MTP loss weight
    # What the MTP head learns (forward.MTP_TARGET_MODES): "sampled", the next token drawn, or
    # "policy", the policy's own detached next-token distribution (SkyRL's soft targets).
    # "policy": on the walk task its drafts were accepted more (docs/RESULTS.md), for one
    # more output-layer pass per forward.
    mtp_target: str = "policy"
    # With "policy" targets, the loss against the policy's distribution
    # (mtp_policy_target.POLICY_TARGET_LOSSES): "ce", the soft cross entropy, or "tv", the
    # total variation, one minus a sampled draft's acceptance (with a small CE anchor). "ce":
    # on the tail task a head trained with "tv" from its supervised start on was accepted far
    # less at depths 2 and 3, where vLLM reuses the one MTP layer (docs/RESULTS.md).
    mtp_loss: str = "ce"
    # MTP depths the head trains (None: one per MTP layer). Past its layers they run again in
    # turn on their own outputs (mtp_patch.set_mtp_depths), as vLLM drafts k > layers.
    mtp_train_depths: int = None
    # ZeRO-1: each data-parallel rank keeps 1/DP of the fp32 main weights and Adam states
    # (megatron-core's DistributedOptimizer; the experts' over their own data-parallel group).
    distributed_optimizer: bool = False
    # 0: --micro-batches counts the micro-batches; N: each rank's micro-batches hold at most
    # N tokens (a longer sequence alone), the batch split over data-parallel ranks by tokens.
    max_tokens_per_micro_batch: int = 0
    loss: grpo_loss.LossConfig = grpo_loss.LossConfig()


# ---------------------------------------------------------------------------------------
# The policy: Megatron model, DDP, optimizer
# ---------------------------------------------------------------------------------------

@dataclasses.dataclass
class Policy:
    """The trainer's side: the GPTModel shard, megatron-core's DDP wrapper around it and its
    optimizer, and the frozen reference model for the KL term (None without --kl-coef)."""
    model: torch.nn.Module
    ddp_model: torch.nn.Module
    optimizer: object
    reference: torch.nn.Module = None


def build_optimizer(model, lr, grad_clip, overlap_grad_reduce=True, distributed=False):
    """megatron-core's DDP wrapper (bucketed gradient all-reduce over data x context
    parallel ranks into fp32 `main_grad` buffers) and its Adam (fp32 master weights for a
    bf16 model, global gradient-norm clipping); returns (ddp_model, optimizer).
    `distributed`: megatron's DistributedOptimizer (ZeRO-1): gradients reduce-scattered,
    each data-parallel rank updating its 1/DP of the weights, the weights all-gathered.

    Freeze parameters before calling: DDP allocates buffers for the trainable ones only.
    Wrap a model once: megatron's DDP leaves its backward hooks on the parameters.
    With `overlap_grad_reduce` each bucket's all-reduce starts in backward, and
    `finish_grad_sync` waits for them (call backward once per step, or under `no_sync`).
    """
    trainable = sum(param.numel() for param in model.parameters() if param.requires_grad)
    bucket_size = min(MAX_GRAD_BUCKET_ELEMENTS, math.ceil(trainable / MIN_GRAD_BUCKETS))
    ddp_model = DistributedDataParallel(config=model.config, module=model, ddp_config=DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=distributed, overlap_grad_reduce=overlap_grad_reduce,
        bucket_size=bucket_size))
    config = OptimizerConfig(optimizer="adam", lr=lr, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.99,
                             adam_eps=ADAM_EPS, clip_grad=grad_clip, bf16=model.config.bf16,
                             params_dtype=model.config.params_dtype, use_distributed_optimizer=distributed)
    with cuda_on_cpu():
        optimizer = get_megatron_optimizer(config, [ddp_model])
    # Expert parallelism gives the experts an optimizer of their own: megatron chains them.
    for part in optimizer_parts(optimizer):
        inner = getattr(part, "optimizer", None)
        if isinstance(inner, torch.optim.Adam) and not torch.cuda.is_available():
            # Without apex or Transformer Engine megatron-core builds torch's Adam with its
            # per-tensor loop; torch's fused CPU kernel makes the same update in one call.
            for group in inner.param_groups:
                group.update(fused=True, foreach=False)
    return ddp_model, optimizer


def optimizer_parts(optimizer):
    """The optimizers megatron chains (expert parallelism gives the experts their own), or [optimizer]."""
    return getattr(optimizer, "chained_optimizers", [optimizer])


def is_distributed(optimizer):
    """Whether `optimizer` (build_optimizer's) is megatron's DistributedOptimizer (ZeRO-1)."""
    return any(isinstance(part, DistributedOptimizer) for part in optimizer_parts(optimizer))


def optimizer_state(optimizer):
    """What a checkpoint keeps of `optimizer` on this rank. The plain optimizer: its
    state_dict (every weight's Adam state and fp32 main weight). The distributed one: this
    rank's shard, as {"distributed_shards": [per chained optimizer: {"adam": its torch Adam's
    state_dict (step, exp_avg, exp_avg_sq of the shard), "main_params": [fp32 shard
    tensors]}]}. megatron's own path (`state_dict` + `save_parameter_state`) gathers every
    shard on data-parallel rank 0 and allocates on CUDA; each rank here saves its own file."""
    if not is_distributed(optimizer):
        return optimizer.state_dict()
    return {DISTRIBUTED_SHARDS: [{"adam": part.optimizer.state_dict(),
                                  "main_params": [param.detach().clone() for param in _main_params(part)]}
                                 for part in optimizer_parts(optimizer)]}


def _main_params(part):
    """The fp32 main weights one chained optimizer updates, in its torch Adam's order."""
    return [param for group in part.optimizer.param_groups for param in group["params"]]


def load_optimizer_state(optimizer, state):
    """Restore `optimizer_state`'s `state` into `optimizer` (built as the saved one was: the
    same layout and flags); a state of the other kind, or a shard of other sizes, is a
    ValueError naming what differs, before anything is loaded."""
    saved_distributed = isinstance(state, dict) and DISTRIBUTED_SHARDS in state
    if saved_distributed != is_distributed(optimizer):
        raise ValueError(f"the checkpoint holds a {'distributed' if saved_distributed else 'plain'} optimizer's "
                         f"state and this run builds a {'distributed' if is_distributed(optimizer) else 'plain'} "
                         "one; resume with the --distributed-optimizer setting it was saved with")
    if not saved_distributed:
        with cuda_on_cpu():
            optimizer.load_state_dict(state)
        return
    parts, shards = optimizer_parts(optimizer), state[DISTRIBUTED_SHARDS]
    sizes = [[param.numel() for param in _main_params(part)] for part in parts]
    saved_sizes = [[tensor.numel() for tensor in shard["main_params"]] for shard in shards]
    if sizes != saved_sizes:
        raise ValueError(f"the checkpoint's optimizer shard holds {saved_sizes} elements per tensor, this rank's "
                         f"{sizes}; resume with the layout it was saved with")
    for part, shard in zip(parts, shards):
        part.optimizer.load_state_dict(shard["adam"])
        for param, saved in zip(_main_params(part), shard["main_params"]):
            param.data.copy_(saved)


def build_policy(model_dir, config):
    """The policy from `model_dir`'s weights (and the reference model when the loss's
    kl_coef > 0), on this process's device (build_gpt_model's); `config` a TrainConfig."""
    def load(mtp):
        model = build_gpt_model(model_dir, mtp=mtp, tensor_parallel=config.tp, context_parallel=config.cp,
                                expert_parallel=config.ep, pipeline_parallel=config.pp,
                                params_dtype=torch.bfloat16 if config.bf16 else torch.float32)
        hf_weights.load_hf_into_megatron(model, model_dir)
        return model

    model = load(mtp=config.mtp_train)
    if config.mtp_train and config.mtp_train_depths:
        set_mtp_depths(model, config.mtp_train_depths)
    reference = load(mtp=False).eval() if config.loss.kl_coef > 0 else None
    if config.mtp_train and config.mtp_rollout and model.decoder.final_layernorm is not None:
        # Megatron's MTP layer reads the trunk's hidden state after the final norm, vLLM's
        # MiMo drafter before it; RMSNorm is scale invariant, so both see the same input
        # only while the final norm's weight is uniform. Keep it as it is.
        model.decoder.final_layernorm.weight.requires_grad_(False)
    # With stages the last one's copy of the word embeddings gets no gradient of its own (the
    # MTP loss is decoupled from the trunk), and megatron's overlapped all-reduce waits for
    # every parameter of a bucket: the gradients are all-reduced after the backward instead.
    overlap = config.pp == 1
    return Policy(model, *build_optimizer(model, config.lr, config.grad_clip, overlap_grad_reduce=overlap,
                                          distributed=config.distributed_optimizer), reference)


# ---------------------------------------------------------------------------------------
# The train phase: old log-probs, micro-batch losses, optimizer steps, metric sums
# ---------------------------------------------------------------------------------------

def pack_micro_batch(samples, device):
    """Samples -> packed tensors on `device`: input_ids [T] int64, seqlens [B] int64, and
    loss_mask, advantages, rollout_logprobs, old_logprobs [T] fp32, each at the position
    that predicts its response token (position i predicts token i + 1); old_logprobs is
    None until `record_old_logprobs` has set them. A sample's "advantages" and
    "old_logprobs" are [response] tensors, its "rollout_logprobs" a list of floats; one
    with "in_loss" False (a truncated completion under --overlong-filter) has loss_mask 0."""
    sequences = [s["prompt_ids"] + s["response_ids"] for s in samples]
    seqlens = torch.tensor([len(ids) for ids in sequences])
    input_ids = torch.tensor([token for ids in sequences for token in ids])
    # The slots that predict response tokens, from each sequence's last prompt token on:
    # every per-token field is one scatter into them (not a slice per sample).
    slots, offset = [], 0
    for sample, ids in zip(samples, sequences):
        first = offset + len(sample["prompt_ids"]) - 1
        slots.extend(range(first, first + len(sample["response_ids"])))
        offset += len(ids)
    slots = torch.tensor(slots, dtype=torch.long)

    def at_slots(values):
        packed = torch.zeros(len(input_ids))
        packed[slots] = values.to(packed.dtype)
        return packed

    loss_mask = at_slots(torch.tensor([float(s.get("in_loss", True)) for s in samples for _ in s["response_ids"]]))
    advantages = at_slots(torch.cat([s["advantages"] for s in samples]))
    rollout_logprobs = at_slots(torch.tensor([logprob for s in samples for logprob in s["rollout_logprobs"]]))
    old_logprobs = at_slots(torch.cat([s["old_logprobs"] for s in samples])) if "old_logprobs" in samples[0] else None
    # Built on the host, moved once.
    packed = [tensor.to(device) for tensor in (input_ids, seqlens, loss_mask, advantages, rollout_logprobs)]
    return packed + [None if old_logprobs is None else old_logprobs.to(device)]


def packed_routing(samples, device):
    """[T, moe_layers, top_k] int64: the experts the rollout engine routed each token of the
    samples to, concatenated like `pack_micro_batch`'s input_ids; None for a dense model."""
    if "routed_experts" not in samples[0]:
        return None
    return torch.cat([sample["routed_experts"] for sample in samples]).long().to(device)


def prefix_group_size(samples):
    """How many consecutive samples forward_logprobs may pack as one shared-prefix group: the
    gcd of the lengths of the runs of samples of one group (a micro-batch may start or end
    inside a group), so that every run of that many lies within one prompt's group."""
    runs = [len(list(run)) for _, run in itertools.groupby(sample["group"] for sample in samples)]
    return math.gcd(*runs)


def forward_options(samples, config, device, routing=True):
    """forward_logprobs' keywords for these samples: the shared-prefix groups (with
    `config.shared_prefix`) and, with `routing`, the rollout's routing, replayed
    (`config.routing_replay`) or compared with Megatron's own."""
    options = {"prefix_group_size": prefix_group_size(samples)} if config.shared_prefix else {}
    routed = packed_routing(samples, device) if routing else None
    if routed is not None:
        options.update(routed_experts=routed, replay_routing=config.routing_replay)
    return options


def loss_tokens(samples):
    """The response tokens of `samples` that count in the loss (not those of a completion
    --overlong-filter keeps out)."""
    return sum(len(s["response_ids"]) for s in samples if s.get("in_loss", True))


def rank_share(samples, config):
    """This data-parallel rank's share of the step's samples: its own consecutive slice, or
    with config.max_tokens_per_micro_batch all of them (every mini-batch is then split over
    the ranks by tokens, `seqlen_balancing.token_budget_micro_batches`)."""
    if config.max_tokens_per_micro_batch:
        return samples
    per_rank = len(samples) // parallel_state.get_data_parallel_world_size()
    start = parallel_state.get_data_parallel_rank() * per_rank
    return samples[start:start + per_rank]


def rank_micro_batches(samples, config):
    """This rank's micro-batches of one mini-batch: `samples` (this rank's) in
    config.micro_batches equal counts, or with config.max_tokens_per_micro_batch
    (`samples`: every rank's) by tokens (`seqlen_balancing.token_budget_micro_batches`)."""
    if config.max_tokens_per_micro_batch:
        return seqlen_balancing.token_budget_micro_batches(
            samples, config.max_tokens_per_micro_batch, config.shared_prefix,
            parallel_state.get_data_parallel_world_size())[
            parallel_state.get_data_parallel_rank()]
    per_micro = len(samples) // config.micro_batches
    return [samples[start:start + per_micro] for start in range(0, len(samples), per_micro)]


@torch.no_grad()
def record_old_logprobs(policy, samples, config):
    """Set each sample's "old_logprobs" ([response length] fp32, on the host): its response
    log-probs under the current weights, the policy that sampled it, at Megatron's numerics.
    One no-grad forward per micro-batch, before the first update (with
    max_tokens_per_micro_batch `samples` are every rank's, each rank recording its own)."""
    per_mini = len(samples) // config.mini_batches
    device = next(policy.model.parameters()).device
    micro_batches = [micro for start in range(0, len(samples), per_mini)
                     for micro in rank_micro_batches(samples[start:start + per_mini], config)]
    if pipeline.stages() > 1:
        return _record_old_logprobs_pipelined(policy, micro_batches, config, device)
    for micro in micro_batches:
        _record_micro_batch(policy, micro, config, device, forward_options(micro, config, device))


def _record_micro_batch(policy, micro, config, device, options):
    """Set "old_logprobs" of each sample of one micro-batch, `options` going to forward_logprobs."""
    input_ids, seqlens, loss_mask, *_ = pack_micro_batch(micro, device)
    logprobs = forward_logprobs(policy.model, input_ids, seqlens, loss_mask=loss_mask,
                                temperature=config.temperature, gather=True, **options).logprobs.float().cpu()
    for sample, row in zip(micro, torch.split(logprobs, seqlens.tolist())):
        sample["old_logprobs"] = row[len(sample["prompt_ids"]) - 1:-1]


def _record_old_logprobs_pipelined(policy, micro_batches, config, device):
    """`record_old_logprobs` through the pipeline stages (forward only): the last stage,
    which alone computes the loss, sets each sample's "old_logprobs"."""
    def stage_forward(micro):
        input_ids, seqlens, *_ = pack_micro_batch(micro, device)
        return forward_stage(policy.model, input_ids, seqlens)

    def last_stage(micro):
        _record_micro_batch(policy, micro, config, device, {})
        return torch.zeros((), device=device)

    pipeline.forward_backward(policy.ddp_model, micro_batches, stage_forward, last_stage, forward_only=True)


def micro_batch_loss(policy, samples, num_sequences, num_tokens, config, sums, mtp_share=None):
    """Forward one micro-batch; returns its loss (a scalar: its share of the global mean)
    and adds its metric sums (over this rank's tokens) into `sums` by name. `mtp_share`:
    its MTP loss's weight in the global mean (None: 1 / (micro-batches x DP))."""
    device = next(policy.model.parameters()).device
    input_ids, seqlens, loss_mask, advantages, rollout_logprobs, old_logprobs = pack_micro_batch(samples, device)
    weights = grpo_loss.token_weights(loss_mask, seqlens, config.loss.loss_agg, num_sequences, num_tokens)
    out = forward_logprobs(policy.model, input_ids, seqlens, loss_mask=loss_mask, temperature=config.temperature,
                           with_entropy=True, mtp_train=config.mtp_train, mtp_target=config.mtp_target,
                           mtp_policy_loss=config.mtp_loss,
                           **forward_options(samples, config, device))
    batch, local_mask = out.batch, out.loss_mask
    # One optimizer step per rollout batch: this forward is the policy that sampled it.
    old_logprobs = out.logprobs.detach() if old_logprobs is None else batch.pack(old_logprobs)
    local_rollout, local_weights = batch.pack(rollout_logprobs), batch.pack(weights)
    sequence_index = batch.pack(torch.repeat_interleave(torch.arange(len(seqlens), device=device), seqlens.to(device)))
    per_sequence = dict(loss_mask=local_mask, sequence_index=sequence_index, num_sequences=len(seqlens),
                        sum_over_ranks=sum_over_context_parallel)
    kept = grpo_loss.rollout_mask(old_logprobs, local_rollout, level=config.loss.rollout_mask,
                                  low=config.loss.rollout_mask_low, high=config.loss.rollout_mask_high, **per_sequence)
    per_token, acted = grpo_loss.policy_loss(out.logprobs, old_logprobs, local_rollout, batch.pack(advantages),
                                             clip_low=config.loss.clip_low, clip_high=config.loss.clip_high,
                                             dual_clip=config.loss.dual_clip, tis_cap=config.loss.tis_cap,
                                             loss=config.loss.loss, **per_sequence)
    loss = (per_token * kept * local_weights).sum()
    if config.loss.entropy_coef > 0:
        loss = loss - config.loss.entropy_coef * (out.entropy * local_weights).sum()
    if policy.reference is not None:
        with torch.no_grad():
            reference_logprobs = forward_logprobs(policy.reference, input_ids, seqlens, loss_mask=loss_mask,
                                                  temperature=config.temperature,
                                                  **forward_options(samples, config, device, routing=False)).logprobs
        k3 = grpo_loss.k3_kl(out.logprobs, reference_logprobs) * local_mask
        loss = loss + config.loss.kl_coef * (k3 * local_weights).sum()
        sums["kl_to_reference"] += float((k3 * local_mask).sum())
    sums["total_loss"] += float(loss.detach())
    # Per rank as a share of its data-parallel rank's mean (reduce_metrics averages them).
    for name in ("mtp_loss", "mtp_acceptance"):
        value = getattr(out, name)
        if value is not None:
            sums[name] += (float(value) / config.micro_batches if mtp_share is None else
                           float(value) * mtp_share * parallel_state.get_data_parallel_world_size())
    sums["mtp_acceptance_parts"] += out.mtp_acceptance is not None
    sums["rollout_masked_fraction"] += float(((1 - kept) * local_mask).sum())
    add_token_metrics(sums, out, old_logprobs, local_rollout, acted, local_mask)
    return loss


def sum_over_context_parallel(partial_sums):
    """Per-sequence sums of this context-parallel rank's tokens -> the whole sequences' (the
    tokens of one sequence are split over the group)."""
    group = parallel_state.get_context_parallel_group()
    if group.size() > 1:
        dist.all_reduce(partial_sums, group=group)
    return partial_sums


def add_token_metrics(sums, out, old_logprobs, rollout_logprobs, acted, mask):
    """Add one micro-batch's per-token metric sums (clips, ratio, approx KL, entropy,
    vLLM-vs-Megatron mismatch) over its loss tokens into `sums`."""
    mismatch = (old_logprobs - rollout_logprobs).abs() * mask
    log_ratio = out.logprobs.detach() - old_logprobs
    ratio = torch.exp(log_ratio)
    sums["clip_fraction"] += float(((acted["clip_low"] + acted["clip_high"]) * mask).sum())
    for name in acted:
        sums[f"{name}_fraction"] += float((acted[name] * mask).sum())
    sums["ratio_mean"] += float((ratio * mask).sum())
    # k3 estimate of KL(old || current): CleanRL's approx_kl.
    sums["approx_kl"] += float(((ratio - 1 - log_ratio) * mask).sum())
    if mask.any():
        sums["ratio_min"] = min(sums["ratio_min"], float(ratio[mask > 0].min()))
        sums["ratio_max"] = max(sums["ratio_max"], float(ratio[mask > 0].max()))
    sums["entropy"] += float((out.entropy.detach() * mask).sum())
    sums["logprob_mismatch_mean"] += float(mismatch.sum())
    sums["logprob_mismatch_max"] = max(sums["logprob_mismatch_max"], float(mismatch.max()))
    sums["tokens"] += float(mask.sum())
    if out.routing_agreement is not None:
        # Over the loss tokens whose routing the rollout recorded.
        known = mask * (out.routing_agreement >= 0)
        sums["routing_agreement"] += float((out.routing_agreement.clamp(min=0) * known).sum())
        sums["routed_tokens"] += float(known.sum())


def step_normalisation(samples, config, device):
    """(this rank's micro-batches, the mini-batch's sequence count, its loss-token count [1]
    fp32, each micro-batch's share of the MTP loss or None) of one optimizer step. The
    policy loss is normalised by the global counts (token_weights), whatever the split.
    megatron's MTP loss is a mean per micro-batch: counted micro-batches weigh each the
    same (1 / (micro-batches x DP), set here); micro-batches by tokens weigh each by its
    share of the loss tokens, so that every token weighs the same (exact where every
    prompt is longer than the MTP depth: then each depth counts the response tokens)."""
    dp_size = parallel_state.get_data_parallel_world_size()
    micro_batches = rank_micro_batches(samples, config)
    if config.max_tokens_per_micro_batch:
        # Every rank holds the whole mini-batch: its counts need no collective.
        total = max(loss_tokens(samples), 1)
        shares = [loss_tokens(micro) / total for micro in micro_batches]
        return micro_batches, len(samples), torch.tensor([float(total)], device=device), shares
    num_tokens = torch.tensor([float(loss_tokens(samples))], device=device)
    dist.all_reduce(num_tokens, group=parallel_state.get_data_parallel_group())
    # Every completion filtered out (--overlong-filter): a loss of 0, not 0 / 0.
    num_tokens.clamp_(min=1)
    # The MTP loss is a mean per micro-batch and rank; gradients are summed over both.
    MTPLossAutoScaler.set_loss_scale(torch.tensor(config.mtp_loss_scale / (config.micro_batches * dp_size), device=device))
    return micro_batches, len(samples) * dp_size, num_tokens, [None] * len(micro_batches)


def train_step(policy, samples, config):
    """One optimizer step on this data-parallel rank's share of a mini-batch (with
    max_tokens_per_micro_batch `samples` are every rank's, split by tokens); returns the
    metric sums of this rank by name (see `combine_steps`, `reduce_metrics`) and the
    global grad_norm."""
    device = next(policy.model.parameters()).device
    micro_batches, num_sequences, num_tokens, mtp_shares = step_normalisation(samples, config, device)
    policy.ddp_model.zero_grad_buffer()
    policy.optimizer.zero_grad()
    sums = dict(dict.fromkeys(SUMMED_METRICS, 0.0), **METRIC_START)
    if pipeline.stages() > 1:
        sums = _pipelined_micro_batches(policy, micro_batches, num_sequences, num_tokens, config, sums, mtp_shares)
    else:
        for index, (micro, mtp_share) in enumerate(zip(micro_batches, mtp_shares)):
            if mtp_share is not None:
                MTPLossAutoScaler.set_loss_scale(mtp_loss_scale(config, mtp_share, device))
            loss = micro_batch_loss(policy, micro, num_sequences, num_tokens, config, sums, mtp_share)
            # Every rank stops together, before the optimizer touches the weights: the last
            # checkpoint on disk stays the last good one.
            finite = torch.isfinite(loss.detach()).float().view(1)
            dist.all_reduce(finite, op=dist.ReduceOp.MIN)
            if not finite.item():
                raise FloatingPointError(f"non-finite loss at micro-batch {index} (this rank: "
                                         f"{loss.item()}); stopping with the last checkpoint in --out intact")
            # The all-reduce starts during the last micro-batch's backward, once its gradients are summed.
            last = index == len(micro_batches) - 1
            with contextlib.nullcontext() if last else policy.ddp_model.no_sync():
                loss.backward()
    policy.ddp_model.finish_grad_sync()
    sum_tensor_parallel_partial_grads(policy.model, "main_grad")
    pipeline.sum_embedding_grads(policy.model)
    # DDP averages over data x context parallel ranks; the loss is normalised globally
    # (token_weights), so the gradient wanted is the sum.
    policy.ddp_model.scale_gradients(parallel_state.get_data_parallel_world_size(with_context_parallel=True))
    with cuda_on_cpu():
        _, grad_norm, _ = policy.optimizer.step()
    if not math.isfinite(grad_norm):
        # megatron's fp32 / bf16 step does not skip non-finite gradients: stop before
        # anything is saved, so the last checkpoint on disk stays the last good one.
        raise FloatingPointError(f"non-finite gradient norm {grad_norm}; stopping with the last checkpoint in "
                                 "--out intact")
    return dict(sums, grad_norm=grad_norm)


def mtp_loss_scale(config, mtp_share, device):
    """The MTP loss's backward scale for a micro-batch holding `mtp_share` of the step's MTP
    tokens (a scalar tensor on `device`)."""
    return torch.tensor(config.mtp_loss_scale * mtp_share, device=device)


def _pipelined_micro_batches(policy, micro_batches, num_sequences, num_tokens, config, sums, mtp_shares):
    """`train_step`'s micro-batches through the pipeline stages (pipeline.py's 1F1B): every
    stage packs each micro-batch alike, the last computes `micro_batch_loss`, its MTP loss
    weighed by the micro-batch's share (`step_normalisation`'s; None: counted). Returns the
    metric sums, the last stage's on every stage. Raises FloatingPointError on every rank,
    after the backward and before the optimizer, when a micro-batch's loss is not finite.
    Without routing: the routers of one stage see only its layers' share of the rollout's."""
    micro_batches = [[{key: value for key, value in sample.items() if key != "routed_experts"} for sample in micro]
                     for micro in micro_batches]
    device = next(policy.model.parameters()).device

    def stage_forward(micro_and_share):
        input_ids, seqlens, *_ = pack_micro_batch(micro_and_share[0], device)
        return forward_stage(policy.model, input_ids, seqlens, mtp_train=config.mtp_train)

    def last_stage_loss(micro_and_share):
        micro, share = micro_and_share
        return micro_batch_loss(policy, micro, num_sequences, num_tokens, config, sums, share)

    scales = None if mtp_shares[0] is None else [mtp_loss_scale(config, share, device) for share in mtp_shares]
    losses = pipeline.forward_backward(policy.ddp_model, list(zip(micro_batches, mtp_shares)), stage_forward,
                                       last_stage_loss, mtp_loss_scales=scales)
    names = list(sums)
    finite = [float(math.isfinite(loss)) for loss in losses] or [1.0] * len(micro_batches)
    shared = pipeline.from_last_stage([sums[name] for name in names] + finite)
    all_finite = torch.tensor([min(shared[len(names):])], device=device)
    dist.all_reduce(all_finite, op=dist.ReduceOp.MIN)
    if not all_finite.item():
        where = (f"micro-batch {shared[len(names):].index(0.0)}" if 0.0 in shared[len(names):]
                 else "another data-parallel rank")
        raise FloatingPointError(f"non-finite loss at {where}; stopping with the last checkpoint in --out intact")
    return dict(zip(names, shared[:len(names)]))


def sum_tensor_parallel_partial_grads(model, attribute="grad"):
    """Sum over the tensor-parallel group the gradients (`param.<attribute>`: "grad", or
    "main_grad" after megatron DDP's reduction) of the parameters every TP rank holds whole
    but sees only part of the work of: under sequence parallelism those marked
    `sequence_parallel` (norms, MoE routers, MLA's down projections: each rank its slice
    of the sequence), and query/key norms (each rank its own heads). The rule of
    megatron-core's `finalize_model_grads`, which megatron's training loop runs after DDP;
    one all-reduce. A no-op at TP 1."""
    group = parallel_state.get_tensor_model_parallel_group()
    if group.size() == 1:
        return
    config = model.config
    grads = [getattr(param, attribute) for name, param in model.named_parameters()
             if param.requires_grad and getattr(param, attribute, None) is not None
             and ((config.sequence_parallel and getattr(param, "sequence_parallel", False))
                  or (config.qk_layernorm and ("q_layernorm" in name or "k_layernorm" in name)))]
    if grads:
        flat = torch._utils._flatten_dense_tensors(grads)
        dist.all_reduce(flat, group=group)
        for grad, summed in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
            grad.copy_(summed)


def train(policy, samples, config):
    """The train phase on the step's `samples` (every data-parallel rank's, in rank order):
    --ppo-epochs passes over this rank's share (`rank_share`), each in --mini-batches
    optimizer steps; returns the metric sums of all of them (see `combine_steps`)."""
    samples = rank_share(samples, config)
    if config.ppo_epochs * config.mini_batches > 1:
        # Every step after the first sees moved weights: its ratio must be against the
        # policy that sampled the batch.
        record_old_logprobs(policy, samples, config)
    per_mini = len(samples) // config.mini_batches
    return combine_steps([train_step(policy, samples[start:start + per_mini], config)
                          for _ in range(config.ppo_epochs) for start in range(0, len(samples), per_mini)])


# How each train metric is combined over optimizer steps (`combine_steps`) and over data x
# context parallel ranks (`reduce_metrics`, each rank holds a share of the tokens).
TOKEN_MEAN_METRICS = ("clip_fraction", "entropy", "logprob_mismatch_mean", "kl_to_reference", "clip_low_fraction",
                      "clip_high_fraction", "dual_clip_fraction", "ratio_mean", "approx_kl", "rollout_masked_fraction")
STEP_MEAN_METRICS = ("mtp_loss", "mtp_acceptance", "total_loss")
# The share of loss tokens Megatron routes to the rollout's experts (MoE without replay).
ROUTING_SUMS = ("routing_agreement", "routed_tokens")
# Counts: the loss tokens, and the micro-batches whose forward estimated the draft acceptance.
COUNTS = ("tokens", "mtp_acceptance_parts")
SUMMED_METRICS = TOKEN_MEAN_METRICS + COUNTS + STEP_MEAN_METRICS + ROUTING_SUMS
MAXED_METRICS = ("logprob_mismatch_max", "ratio_max")
MINNED_METRICS = ("ratio_min",)
# Where a max or min starts before the first token.
METRIC_START = {"logprob_mismatch_max": 0.0, "ratio_max": -math.inf, "ratio_min": math.inf}


def combine_steps(steps):
    """Metric sums of several optimizer steps -> one set: token sums add up, the MTP and
    total losses and grad_norm average over steps, maxima and minima stay extremes."""
    combined = {name: sum(step[name] for step in steps) for name in TOKEN_MEAN_METRICS + COUNTS + ROUTING_SUMS}
    combined.update({name: sum(step[name] for step in steps) / len(steps)
                     for name in STEP_MEAN_METRICS + ("grad_norm",)})
    combined.update({name: max(step[name] for step in steps) for name in MAXED_METRICS})
    combined.update({name: min(step[name] for step in steps) for name in MINNED_METRICS})
    return combined


def reduce_metrics(sums, device):
    """Per-rank sums by name -> the step's values: token means, the MTP loss and the draft
    acceptance the trainer estimates (mtp_patch's, the first MTP layer's) averaged over
    data-parallel ranks (each rank's is its share of its data-parallel rank's mean), the
    total loss summed (it is normalised globally), extremes; grad_norm is already global."""
    group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    summed = torch.tensor([sums[name] for name in SUMMED_METRICS], device=device)
    dist.all_reduce(summed, group=group)
    totals = dict(zip(SUMMED_METRICS, summed))
    metrics = {name: (totals[name] / totals["tokens"].clamp(min=1)).item() for name in TOKEN_MEAN_METRICS}
    metrics["mtp_loss"] = totals["mtp_loss"].item() / parallel_state.get_data_parallel_world_size()
    # None without the estimate (sampled-token MTP targets, no MTP training).
    metrics["mtp_acceptance"] = (totals["mtp_acceptance"].item() / parallel_state.get_data_parallel_world_size()
                                 if totals["mtp_acceptance_parts"] > 0 else None)
    metrics["total_loss"] = totals["total_loss"].item()
    metrics["routing_agreement"] = ((totals["routing_agreement"] / totals["routed_tokens"]).item()
                                    if totals["routed_tokens"] > 0 else None)
    for names, op in ((MAXED_METRICS, dist.ReduceOp.MAX), (MINNED_METRICS, dist.ReduceOp.MIN)):
        extremes = torch.tensor([sums[name] for name in names], device=device, dtype=torch.float64)
        dist.all_reduce(extremes, op=op, group=group)
        metrics.update(zip(names, extremes.tolist()))
    metrics["grad_norm"] = sums["grad_norm"]
    return metrics
