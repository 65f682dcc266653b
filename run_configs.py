"""Each module's own frozen config from the resolved settings (flags.check_args and
flags.rollout_context's Namespace): a module takes its config, never the whole flag set.

    settings = flags.check_args(args, world_size)
    trainer.build_policy(model_dir, train_config(settings))
    rollout.build_engines(model_dir, rollout_config(settings), rank)
    data = settings_config(settings, tasks.DataConfig)     # a config whose fields are settings

Imports the standard library and the modules whose configs it builds.
"""

import dataclasses
import os

import grpo_loss
import memory_plan
import rollout
import trainer


def settings_config(settings, config_class, **given):
    """A module's config dataclass `config_class` (tasks.DataConfig, grpo_loss.RewardConfig,
    train_grpo.RunConfig, ...) from the resolved settings: each field the setting of its
    name, but those `given`."""
    return config_class(**{field.name: getattr(settings, field.name) for field in dataclasses.fields(config_class)
                           if field.name not in given}, **given)


def loss_config(settings):
    """The policy loss's settings: grpo_loss.LossConfig."""
    return settings_config(settings, grpo_loss.LossConfig)


def train_config(settings):
    """The train phase's settings: trainer.TrainConfig, the loss's included."""
    return settings_config(settings, trainer.TrainConfig, loss=loss_config(settings))


def plan_world_size(args):
    """The world size a --plan is made for: --plan-world-size, else torchrun's WORLD_SIZE, else 1."""
    return args.plan_world_size or int(os.environ.get("WORLD_SIZE", "1"))


def plan_config(settings, world_size, bf16):
    """The memory plan's settings: memory_plan.PlanConfig. `bf16`: the GPU's default when --bf16 is
    not given (a plan is made for the GPUs, maybe on a host without one). A micro-batch's
    tokens: --max-tokens-per-micro-batch, else its sequences (--prompts-per-step x
    --group-size per data-parallel rank, over --mini-batches x --micro-batches) x
    --max-new-tokens plus a prompt of rollout.MIN_MODEL_LEN."""
    sequences = settings.prompts_per_step * settings.group_size // (settings.mini_batches * settings.micro_batches)
    return memory_plan.PlanConfig(
        world_size=world_size, tp=settings.tp, cp=settings.cp, ep=settings.ep, pp=settings.pp, bf16=bf16,
        distributed_optimizer=settings.distributed_optimizer,
        mtp_train=settings.mtp_train, mtp_rollout=settings.mtp_rollout, reference_model=settings.kl_coef > 0,
        micro_batch_tokens=(settings.max_tokens_per_micro_batch
                            or sequences * (settings.max_new_tokens + rollout.MIN_MODEL_LEN)),
        rollout_tp=settings.rollout_tp,
        gpu_memory_utilization=settings.gpu_memory_utilization, device_memory=settings.device_memory)


def distributed_optimizer_pays(settings, hf_config, world_size):
    """--distributed-optimizer's default: on where data-parallel ranks share the work and the
    memory plan shows that splitting the optimizer saves memory that matters
    (memory_plan.distributed_optimizer_pays)."""
    data_parallel = world_size // (settings.tp * settings.cp * settings.pp) > 1
    return data_parallel and memory_plan.distributed_optimizer_pays(hf_config,
                                                                    plan_config(settings, world_size, settings.bf16))


def rollout_config(settings):
    """The engine's settings: rollout.RolloutConfig, drafting as `flags.resolve` settled it."""
    return rollout.RolloutConfig(
        dtype="bfloat16" if settings.bf16 else "float32", rollout_tp=settings.rollout_tp, seed=settings.seed,
        temperature=settings.temperature, max_model_len=settings.max_model_len, mtp_rollout=settings.mtp_rollout,
        auto_draft=settings.auto_draft, draft_tokens=settings.draft_tokens, tune_every=settings.tune_every,
        acceptance_check_every=settings.acceptance_check_every, check_draft_every=settings.check_draft_every,
        spec_overrides=settings.spec_config,
        gpu_memory_utilization=settings.gpu_memory_utilization, kv_cache_bytes=settings.engine_kv_cache_bytes)
