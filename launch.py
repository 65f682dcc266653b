"""The run before step 1: everything `train_grpo.main` does before its loop.

Checks on every rank before any process group (`prepare`: the flags, the model's files, the
checkpoint to resume, the data and the reward; `refused_on_any_rank` says a refusal once),
the inputs (`load_inputs`, `input_digests`, the built-in models written once), the run's own
config (`RunConfig`) and state (`Run`), then the process group, tokenizer, policy, vLLM
engines and checkpoint (`start`, each part timed), and the outputs with the run's first
lines (`open_outputs`, `header`). train_grpo.py keeps the `torchrun` entry and the loop.
"""

import ctypes
import dataclasses
import gc
import hashlib
import json
import os
import random
import time

import torch
import torch.distributed as dist

import checkpoint
import draft_tuner
import flag_checks
import flags
import grpo_loss
import hf_export
import hf_weights
import memory_plan
import mtp_patch
import preflight
import rewards
import rollout
import run_configs
import run_log
import tasks
import tiny_model

import trainer
import warm_start
from cpu_backend import init_distributed, init_model_parallel
from flags import usage_error

# The built-in models are written once, here, and reused by every later run.
BUILTIN_MODELS_DIR = "runs"


def write_builtin_model(name, task=None):
    """The built-in model `name` (tiny_model.BUILTIN_MODELS) written under BUILTIN_MODELS_DIR
    unless it is there already, and for a built-in `task` that starts RL from a supervised
    stage (tasks.TASKS' "warm_start") that stage's model beside it; returns its directory."""
    family, sizes = tiny_model.BUILTIN_MODELS[name]
    directory = os.path.join(BUILTIN_MODELS_DIR, f"{name}-{family}" if name != family else name)
    directory = tiny_model.build_tiny_model(directory, family, **sizes)
    if task is None or not tasks.TASKS[task]["warm_start"]:
        return directory
    config = warm_start.WarmStartConfig(task=task, mtp_train_depths=tasks.TASKS[task]["mtp_train_depths"])
    return warm_start.warm_started(config, directory, f"{directory}-{task}")


def load_inputs(data, seed):
    """Before any process group: (training pool, held-out set) of `data` (tasks.DataConfig),
    each checked."""

    def load(path, flag):
        return tasks.load_examples(path, data.prompt_key, data.answer_key, flag) if path else None
    examples, held_out = tasks.split_examples(load(data.data, "--data"), load(data.eval_data, "--eval-data"), seed,
                                              data.task, data.count_step)
    if data.reward:
        rewards.try_reward(data.reward, examples[0], data.reward_timeout)
    return examples, held_out


def input_digests(data):
    """{flag: sha256 of its file} for --data, --eval-data and the --reward file of `data`
    (tasks.DataConfig): a resumed run must find them as the checkpoint's run left them
    (checkpoint.refuse_changed_inputs)."""
    reward_file = data.reward.rpartition(":")[0] if data.reward and data.reward != rewards.MATH_REWARD else None
    digests = {}
    for flag, path in (("--data", data.data), ("--eval-data", data.eval_data), ("--reward", reward_file)):
        if path:
            with open(path, "rb") as f:
                digests[flag] = hashlib.file_digest(f, "sha256").hexdigest()
    return digests


def refusing(function, *args):
    """`function(*args)`, a rewards.InputError (bad data, a bad reward) or a
    checkpoint.CheckpointError (a resume or save refused) turned into a refusal."""
    try:
        return function(*args)
    except (rewards.InputError, checkpoint.CheckpointError) as error:
        raise usage_error(str(error)) from None


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """What the run's own loop reads (built in `prepare` by run_configs.settings_config, which takes
    each field from the resolved setting of its name; flags holds every default). Every
    other module's settings reach it as its own config."""
    out: str
    steps: int
    seed: int
    prompts_per_step: int
    eval_every: int
    save_every: int
    keep_checkpoints: int
    resume: str
    tensorboard: bool
    wandb_project: str
    max_new_tokens: int
    ignore_eos: bool
    max_positions: int
    model: str
    builtin_model: str
    tp: int
    cp: int
    ep: int
    pp: int
    rollout_tp: int
    # The resolved settings whole, by name: a checkpoint's meta (a resume says which flag
    # changed) and W&B's record of the run.
    resolved_flags: dict


@dataclasses.dataclass
class Run:
    """Everything a step needs, built once by `start`."""
    config: RunConfig
    rank: int
    world_size: int
    device: torch.device
    tokenizer: object
    credit: object
    policy: trainer.Policy
    engines: rollout.Engines
    examples: list
    held_out: list
    start_step: int
    model_dir: str
    lock: object = None  # rank 0's hold on OUT/.lock
    stop: checkpoint.StopRequest = None
    inputs: dict = None  # input_digests: what a resume must find unchanged
    params: object = None  # the rollout's SamplingParams
    check_params: object = None  # auto's acceptance check's
    train_config: trainer.TrainConfig = None
    data_config: tasks.DataConfig = None
    reward_config: grpo_loss.RewardConfig = None
    rollout_config: rollout.RolloutConfig = None
    tuner_before_step: dict = None  # auto's tuner as the step under way found it
    start_seconds: dict = None  # where the run's start went: {phase: wall seconds} before step 1


def header(run, args):
    """The run's first lines (rank 0): model, layout, drafting, the flags `args` sets
    away from their defaults."""
    s, defaults = run.config, vars(flags.parse_args([]))
    data, train, engines = run.data_config, run.train_config, run.rollout_config
    changed = [f"--{name.replace('_', '-')} {value}" for name, value in vars(args).items() if value != defaults[name]]
    dp = run.world_size // (s.tp * s.cp * s.pp)
    drafting = ((f"auto, k in 0..{engines.draft_tokens}" if engines.auto_draft else f"k = {engines.draft_tokens}")
                if engines.mtp_rollout else "off")
    return "\n".join([
        f"train_grpo.py: {s.model or f'built-in {s.builtin_model} model ({run.model_dir})'}, "
        + (f"--data {data.data}" if data.data else f"task {data.task}") + f", {s.steps} steps, out {s.out}",
        f"layout: {run.world_size} processes x {torch.get_num_threads()} thread(s) on {run.device.type}, tp {s.tp} "
        f"cp {s.cp} dp {dp}" + (f" ep {s.ep}" if s.ep > 1 else "") + (f" pp {s.pp}" if s.pp > 1 else "")
        + f", rollout tp {s.rollout_tp}; "
        f"{s.prompts_per_step} prompts x {run.reward_config.group_size} completions per dp rank"
        + (", each prompt trained once" if train.shared_prefix else "")
        + f"; {'bf16' if train.bf16 else 'fp32'}; MTP drafting {drafting}, "
        f"training {'on' if train.mtp_train else 'off'}",
        "flags: " + (" ".join(changed) or "all defaults") + (f"; resumed at step {run.start_step}" if run.start_step
                                                            else ""),
        f"start: {sum(run.start_seconds.values()):.1f} s (" + ", ".join(
            f"{phase} {seconds:.1f}" for phase, seconds in run.start_seconds.items()) + ")"])


# Allocations (less deallocations) between collections of the young generation in the steps.
GC_YOUNG_THRESHOLD = 20_000
# glibc malloc's settings (mallopt's parameter numbers, malloc.h): blocks up to the first
# come from the heap rather than each from fresh pages of its own (glibc's ceiling for it),
# and up to the second of free memory at the heap's top stays with the process.
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MALLOC_MMAP_THRESHOLD_BYTES = 32 << 20
MALLOC_TRIM_THRESHOLD_BYTES = 1 << 30


def keep_freed_memory():
    """Has glibc's malloc keep the memory a step frees for the next step; True where it took
    (glibc), False elsewhere (the allocator's own defaults). A step allocates and frees the
    same megabyte-sized tensors each time; by default glibc gives each large one fresh pages
    from the kernel, or hands the heap's freed top back to it, and every page of the next
    step's tensors is a page fault again: a few percent of a CPU step."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    return bool(libc.mallopt(M_MMAP_THRESHOLD, MALLOC_MMAP_THRESHOLD_BYTES)
                and libc.mallopt(M_TRIM_THRESHOLD, MALLOC_TRIM_THRESHOLD_BYTES))


def start(settings, config, data, reward, resume_dir, examples, held_out, stop, inputs, imports_started):
    """Process group, tokenizer, policy, engines and checkpoint: the run before step 1, each
    part timed (Run.start_seconds; the imports and flag checks before it as "imports", from
    `imports_started`, the process's start by time.perf_counter).
    config: RunConfig, data: tasks.DataConfig, reward: grpo_loss.RewardConfig; `settings`,
    the resolved flags, go to flags alone, which settles the engines' context from them once
    the prompts are tokenized and makes the train and rollout configs."""
    s, timer = config, run_log.PhaseTimer()
    keep_freed_memory()
    timer.seconds["imports"] = time.perf_counter() - imports_started
    with timer("process group"):
        rank, world_size, device = init_distributed()
        lock = lock_out(s.out, rank)
        if rank == 0 and s.resume in ("auto", "afresh"):  # choose_checkpoint's warnings said so
            checkpoint.set_aside_failed(s.out, resume_dir)
    random.seed(s.seed)
    torch.manual_seed(s.seed)
    with timer("model files"):
        # The built-in model is written once and cached; only rank 0 writes it.
        model_dir = s.model or broadcast(write_builtin_model(s.builtin_model, None if data.data else data.task)
                                         if rank == 0 else None)
        # The one tokenizer of prompts and answers (vLLM loads the same, through transformers).
        from transformers import AutoTokenizer
        # Never the checkpoint's remote code (MiMo's config names some): its tokenizer files suffice.
        tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=False)
        # The engines' context is the run's, not the model's (a published 128k one would
        # ask for KV cache the run never uses): refused here when it does not fit.
        longest = refusing(tasks.check_prompts, examples + held_out, tokenizer, s.max_positions, s.max_new_tokens)
        longest = max(longest, len(tasks.prompt_token_ids(tokenizer, rollout.PROBE_PROMPT)))
        hf_config = flag_checks.model_config(settings)
        settings = flags.rollout_context(settings, hf_config, longest)
        # The checkpoint's meta keeps the settings with the engines' context.
        s = dataclasses.replace(s, resolved_flags=vars(settings))
        credit = refusing(tasks.credit_function, tokenizer, None if data.data else data.task, data.count_step,
                          data.reward, data.reward_timeout, lambda: stop.signum != 0)
    with timer("policy"):
        train_config = run_configs.train_config(settings)
        init_model_parallel(tensor_parallel=s.tp, context_parallel=s.cp, expert_parallel=s.ep, seed=s.seed,
                            pipeline_parallel=s.pp)
        mtp_patch.patch_megatron_mtp()
        policy = trainer.build_policy(model_dir, train_config)
    with timer("vLLM engines"):
        engines_dir, rollout_config = rollout_model(model_dir, hf_config, run_configs.rollout_config(settings), s.out, rank)
        engines = rollout.build_engines(engines_dir, rollout_config, rank)
    with timer("checkpoint"):
        start_step = load_state(resume_dir, policy, engines, rank, train_config.lr) if resume_dir else 0
    params = rollout.sampling_params(reward.group_size, rollout_config.temperature, s.max_new_tokens,
                                     ignore_eos=s.ignore_eos)
    check_params = rollout.sampling_params(reward.group_size, rollout_config.temperature,
                                           draft_tuner.ACCEPTANCE_CHECK_TOKENS, ignore_eos=True)
    gc.freeze()
    # A step allocates hundreds of thousands of short-lived objects and keeps few: at
    # Python's default threshold (700) the young generation is collected about ten times a
    # step for nearly nothing. A larger one collects it rarely; each older generation is
    # collected every 20 collections of the one before: a long run's cycles still go.
    gc.set_threshold(GC_YOUNG_THRESHOLD, 20, 20)
    gc.enable()
    return Run(s, rank, world_size, device, tokenizer, credit, policy, engines, examples, held_out, start_step,
               model_dir, lock, stop, inputs, params, check_params, train_config, data, reward, rollout_config,
               start_seconds=timer.seconds)


def rollout_model(model_dir, hf_config, config, out, rank):
    """(directory, rollout.RolloutConfig) the engines are built from (`hf_config`: the
    model's config.json as a dict; `config` the engines' own): the model's own directory
    and `config`, or a copy of its config and tokenizer (in `out`/rollout-model) with dummy
    weights, the first push bringing the policy's. The copy is for what vLLM cannot read as
    published: an FP8 block-quantized checkpoint (its config without `quantization_config`:
    the engines hold bf16/fp32 layers, the policy's weights dequantized; vLLM's own FP8
    rollout is not used), and MiMo's `model_type` "mimo", which only its remote code defines
    (a Qwen2 trunk: "qwen2")."""
    renamed = hf_config.get("model_type") == "mimo"
    if not hf_weights.fp8_block_size(hf_config) and not renamed:
        return model_dir, config
    directory = os.path.join(out, "rollout-model")
    if rank == 0:
        os.makedirs(directory, exist_ok=True)
        hf_export.copy_hf_metadata(model_dir, directory)
        if renamed:
            copied = {key: value for key, value in hf_config.items() if key not in ("auto_map", "quantization_config")}
            with open(os.path.join(directory, "config.json"), "w") as f:
                json.dump({**copied, "model_type": "qwen2"}, f, indent=2)
    dist.barrier()
    return directory, dataclasses.replace(config, load_format="dummy")


def lock_out(out, rank):
    """Rank 0 holds OUT/.lock for the run (checkpoint.lock_out); every rank stops, before any
    model exists, when another run holds it."""
    lock, problem = None, None
    if rank == 0:
        try:
            lock = checkpoint.lock_out(out)
        except checkpoint.CheckpointError as error:
            problem = str(error)
    problem = broadcast(problem)
    if problem:
        raise usage_error(problem)
    return lock


def load_state(directory, policy, engines, rank, lr):
    """Restore this rank's model and optimizer state (and auto's draft tuner, when both this
    run and the checkpoint have one of the same depth); returns the step it was saved at.
    The optimizer continues at `lr` (a resumed run may change it). The engines receive the
    weights when they are next used."""
    state = checkpoint.load_rank_state(directory, rank)
    policy.model.load_state_dict(state["model"])
    try:
        trainer.load_optimizer_state(policy.optimizer, state["optimizer"])
    except ValueError as error:
        raise usage_error(f"checkpoint {directory}: {error}") from None
    for group in policy.optimizer.param_groups:
        group["lr"] = lr
    tuner = state.get("draft_tuner")
    if engines.tuner is not None and tuner is not None:
        try:
            engines.tuner.load_state_dict(tuner)
        except ValueError:
            pass  # a tuner of another depth, or saved by code that kept less state: it starts afresh
    return state["step"]


def run_layout(config, world_size):
    """What a checkpoint must match to be resumed: the process layout and the model (from
    `config`, a RunConfig)."""
    s = config
    return {"world_size": world_size, "tp": s.tp, "cp": s.cp, "ep": s.ep, "rollout_tp": s.rollout_tp,
            "model": os.path.abspath(s.model) if s.model else f"built-in {s.builtin_model}",
            # Named only when set: the layouts of runs without stages stay as they were saved.
            **({"pp": s.pp} if s.pp > 1 else {})}


def broadcast(value):
    holder = [value]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def open_outputs(run, resume_dir, args, changed):
    """(metrics.jsonl's path, the records kept from before the start step, a TensorBoard
    writer or None, a W&B run or None); records and loggers on rank 0 only."""
    os.makedirs(run.config.out, exist_ok=True)
    metrics_path = os.path.join(run.config.out, "metrics.jsonl")
    if run.rank != 0:
        return metrics_path, [], None, None
    print(header(run, args), flush=True)
    if run.start_step:
        print(f"resumed from {resume_dir} (step {run.start_step})" + (f" with {changed}" if changed else ""),
              flush=True)
    writer = run_log.open_tensorboard(run.config.out, run.start_step) if run.config.tensorboard else None
    wandb_run = run_log.open_wandb(run.config.out, run.config.wandb_project, run.config.resolved_flags, run.start_step)
    return metrics_path, checkpoint.keep_records(metrics_path, run.start_step), writer, wandb_run


def prepare(args, world_size):
    """Before any process group: the flags, the model's files, the outputs, the checkpoint to
    resume and the inputs, each checked; (settings, RunConfig, tasks.DataConfig,
    grpo_loss.RewardConfig, resume_dir, the flags changed since it, input digests, examples,
    held-out examples), or None for --plan (printed)."""
    s = flags.check_args(args, world_size)
    if s.plan:
        # Before any process group or model: the layout judged from config.json alone.
        hf_config = flag_checks.model_config(s)
        config = run_configs.plan_config(s, world_size, bf16=args.bf16 is not False)
        try:
            plan = memory_plan.device_plan(hf_config, config)
        except ValueError as error:  # a layout the flags' own checks let through (a vocabulary TP does not split)
            raise usage_error(f"--plan: {error}") from None
        print(memory_plan.format_plan(plan, hf_config), flush=True)
        return None
    problems = preflight.run_problems(s.model, s.out)
    if problems:
        raise usage_error("\n  ".join(["bad files:"] + problems) if len(problems) > 1 else problems[0])
    # Each part of the run takes its own config from here on (`start` hands the settings to flags alone).
    config = run_configs.settings_config(s, RunConfig, resolved_flags=vars(s))
    data, reward = run_configs.settings_config(s, tasks.DataConfig), run_configs.settings_config(s, grpo_loss.RewardConfig)
    resume_dir = refusing(checkpoint.choose_checkpoint, config.out, config.resume, run_layout(config, world_size))
    changed = refusing(checkpoint.resume_changes, resume_dir, config.resolved_flags) if resume_dir else ""
    inputs = input_digests(data)
    if resume_dir:
        refusing(checkpoint.refuse_changed_inputs, resume_dir, config.resolved_flags, inputs)
    examples, held_out = refusing(load_inputs, data, config.seed)
    return s, config, data, reward, resume_dir, changed, inputs, examples, held_out


def refused_on_any_rank(function, *args):
    """`function(*args)` on every rank, where a refusal (SystemExit) on any rank stops them
    all: under torchrun the ranks meet in the process group and rank 0 says each refusal
    once, naming the ranks that found it unless all did. A reward, a data file or a model
    file that fails on one rank (one node) alone is said, and the other ranks stop at once."""
    try:
        result, refusal = function(*args), None
    except SystemExit as error:
        result, refusal = None, error
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size > 1 and (refusal is not None or result is not None):  # --plan (None) makes no process group
        init_distributed()
        said = [None] * world_size
        dist.all_gather_object(said, None if refusal is None else str(refusal.code))
        found = {message: [str(rank) for rank, text in enumerate(said) if text == message]
                 for message in said if message}
        if found:
            raise SystemExit("\n".join(message if len(ranks) == world_size else message.replace(
                "train_grpo.py: ", f"train_grpo.py: rank {', '.join(ranks)}: ", 1) for message, ranks in found.items()))
    if refusal is not None:
        raise refusal
    return result
