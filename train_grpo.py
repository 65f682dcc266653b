"""GRPO on Megatron-Core with colocated vLLM rollouts drafted by the model's own MTP head.

One process per device under torchrun. Each process holds a Megatron-Core policy shard
(tensor parallel --tp, context parallel --cp, data parallel = the rest) and a vLLM engine
on the same device (rollout tensor parallel --rollout-tp). Each step, one call per phase
in `main`'s loop:

    prompts -> (tune: how many tokens to draft) -> vLLM (rollout, MTP drafts) -> rewards
            -> GRPO advantages -> cp_thd packs -> forward (Megatron) -> PPO loss (+ MTP loss)
            -> megatron-core Adam -> vllm_sync -> vLLM (the draft checked against Megatron's)

    torchrun --nproc_per_node 2 train_grpo.py                       # CPU: tiny model, repeat task
    torchrun --nproc_per_node 2 train_grpo.py --task count          # CPU: 16-layer model, long answers
    torchrun --nproc_per_node 8 train_grpo.py --model DIR --tp 2 --cp 2 --rollout-tp 2

Where each concern lives: flags.py (the command line, checked and resolved, and each
module's config from it), tasks.py (built-in tasks, data files, rewards), rollout.py (vLLM
engines), draft_tuner.py (how many tokens to draft), grpo_loss.py (advantages, aggregation,
PPO loss), trainer.py (the Megatron train step), forward.py (Megatron log-probs),
vllm_sync.py (Megatron -> vLLM), hf_weights.py (Megatron <-> HF), checkpoint.py (save, resume,
signals, the --out lock), run_log.py (console, metrics.jsonl, TensorBoard, plots).
Metrics: OUT/metrics.jsonl, TensorBoard under OUT/tensorboard, curves.png and
acceptance_vs_entropy.png at the end; the trained policy as a HF checkpoint in OUT/final.
"""

import copy
import dataclasses
import gc
import hashlib
import json
import os
import random
import signal
import sys
import time

# The process's start: what the imports below and the run's start cost is reported from it.
IMPORTS_STARTED = time.perf_counter()
if __name__ == "__main__":
    # The imports and the run's start allocate millions of objects that live for the run:
    # collections would walk a growing heap for nothing. Off until `start` freezes them.
    gc.disable()
    # megatron-core imports W&B, where installed, for logging this project does not use: a
    # second of CPU per process. Kept out while the modules below import; a run with
    # --wandb-project imports it itself (run_log).
    WANDB_KEPT_OUT = "wandb" not in sys.modules and not any(arg.startswith("--wandb") for arg in sys.argv[1:])
    if WANDB_KEPT_OUT:
        sys.modules["wandb"] = None


def shared_memory_names():
    """The names in /dev/shm (empty where there is none): see exit_now."""
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


# /dev/shm before this process made anything.
SHARED_MEMORY_BEFORE = shared_memory_names()

import preflight  # noqa: E402
import run_log  # noqa: E402

if __name__ == "__main__":
    # A second run on a locked --out is refused before the heavy imports below.
    preflight.refuse_locked_out(sys.argv[1:])
    # The stack's known-harmless warnings are raised while it imports, before the flags are
    # parsed: --verbose is read here for them (parse_args reads it again, with the rest).
    run_log.hide_known_warnings(verbose="--verbose" in sys.argv[1:])

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from megatron.core import parallel_state  # noqa: E402

import checkpoint  # noqa: E402
import draft_tuner  # noqa: E402
import flags  # noqa: E402
import grpo_loss  # noqa: E402
import hf_weights  # noqa: E402
import memory_plan  # noqa: E402
import mtp_patch  # noqa: E402
import rollout  # noqa: E402
import run_configs  # noqa: E402
import spec_config  # noqa: E402
import tasks  # noqa: E402
import tiny_model  # noqa: E402
import trainer  # noqa: E402
from cpu_backend import init_distributed, init_model_parallel  # noqa: E402
from flags import usage_error  # noqa: E402

if __name__ == "__main__" and WANDB_KEPT_OUT:
    del sys.modules["wandb"]

# The built-in models are written once, here, and reused by every later run.
BUILTIN_MODELS_DIR = "runs"


def write_builtin_model(name):
    """The built-in model `name` (tiny_model.BUILTIN_MODELS) written under BUILTIN_MODELS_DIR
    unless it is there already; returns its directory."""
    family, sizes = tiny_model.BUILTIN_MODELS[name]
    directory = os.path.join(BUILTIN_MODELS_DIR, f"{name}-{family}" if name != family else name)
    return tiny_model.build_tiny_model(directory, family, **sizes)


def load_inputs(data, seed):
    """Before any process group: (training pool, held-out set) of `data` (tasks.DataConfig),
    each checked."""

    def load(path, flag):
        return tasks.load_examples(path, data.prompt_key, data.answer_key, flag) if path else None
    examples, held_out = tasks.split_examples(load(data.data, "--data"), load(data.eval_data, "--eval-data"), seed,
                                              data.task, data.count_step)
    if data.reward:
        tasks.try_reward(data.reward, examples[0], data.reward_timeout)
    return examples, held_out


def input_digests(data):
    """{flag: sha256 of its file} for --data, --eval-data and the --reward file of `data`
    (tasks.DataConfig): a resumed run must find them as the checkpoint's run left them
    (checkpoint.refuse_changed_inputs)."""
    reward_file = data.reward.rpartition(":")[0] if data.reward and data.reward != tasks.MATH_REWARD else None
    digests = {}
    for flag, path in (("--data", data.data), ("--eval-data", data.eval_data), ("--reward", reward_file)):
        if path:
            with open(path, "rb") as f:
                digests[flag] = hashlib.file_digest(f, "sha256").hexdigest()
    return digests


# ---------------------------------------------------------------------------------------
# Rewards and advantages
# ---------------------------------------------------------------------------------------

def sample_batch(run, step, examples_now, params):
    """The rollout phase: (samples with their advantages set, rewards [N] fp32, the first
    rollout's draft acceptance, sampling metrics and the first rollout's probe of the
    weights it sampled with: probe_text, probe_logprob, weight_version). One rollout of `examples_now`; with
    --dynamic-sampling the groups whose rewards are all equal are dropped and round r
    rolls out as many prompts again, drawn from (seed, step, r), until the batch holds as
    many informative groups as prompts, or --max-sampling-rounds rollouts ran (the dropped
    groups then fill it, in the order drawn: their advantages are 0)."""
    config, seed, wanted = run.reward_config, run.config.seed, len(examples_now)
    kept, dropped, informative_count = [], [], 0
    for sampling_round in range(config.max_sampling_rounds):
        if sampling_round:
            examples_now = tasks.sample_prompts(run.examples, step, wanted, seed, sampling_round)
        samples, round_acceptance, round_probe = rollout.generate(run.engines, run.policy.model, run.tokenizer,
                                                                  examples_now, step, params, seed, run.rank,
                                                                  sampling_round)
        if not sampling_round:
            # The drafting metrics and the probe are the step's first rollout's.
            acceptance, probe = round_acceptance, round_probe
        rows = credit_rows(samples, run.credit, config, step - 1, run.stop)
        means = torch.tensor([sum(row) / len(row) for row in rows])
        informative = grpo_loss.informative_groups(means, config.group_size).tolist()
        informative_count += sum(informative)
        for group, useful in enumerate(informative):
            members = slice(group * config.group_size, (group + 1) * config.group_size)
            (kept if useful or not config.dynamic_sampling else dropped).append((samples[members], rows[members]))
        if len(kept) >= wanted:
            break
    batch = (kept + dropped)[:wanted]
    # Renumbered: groups of several rounds may share an index within their own round.
    samples = [dict(sample, group=group) for group, (members, _) in enumerate(batch) for sample in members]
    rewards = set_advantages(samples, [row for _, rows in batch for row in rows], config)
    if torch.cuda.is_available():
        run.engines.sleep(level=sleep_level(run.train_config))
    metrics = {"sampling_rounds": sampling_round + 1,
               "informative_group_share": informative_count / ((sampling_round + 1) * wanted), **probe}
    if run.data_config.data:
        metrics["truncated_fraction"] = sum(sample["truncated"] for sample in samples) / len(samples)
    return samples, rewards, acceptance, metrics


class RewardFailure(Exception):
    """A reward that failed while scoring, the same on every rank: the message names the rank,
    the prompt and the error; `signum` is the stop signal that cut it short (0: none) and
    `completed` the last step whose weights are the current ones."""

    def __init__(self, message, signum, completed):
        super().__init__(message)
        self.signum, self.completed = signum, completed


def score(samples, credit, completed, stop=None):
    """Each sample's credits ([floats]), on every rank, each sample scored once: rank r scores
    samples r, r + world size, ... (a paid judge is called once per completion) and the
    rows are shared. A reward that fails on any rank is a RewardFailure on every rank."""
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    mine, failure, signum = {}, None, 0
    for index in range(rank, len(samples), world_size):
        try:
            mine[index] = credit(samples[index])
        except (tasks.InputError, tasks.RewardInterrupted) as error:
            failure, signum = f"rank {rank}: {error}", stop.signum if stop is not None else 0
            break
    gathered = [(mine, failure, signum)] * world_size
    if world_size > 1:
        dist.all_gather_object(gathered, gathered[0])
    failures = [(failure, signum) for _, failure, signum in gathered if failure]
    if failures:
        raise RewardFailure(failures[0][0], max(signum for _, signum in failures), completed)
    rows = {index: row for part, _, _ in gathered for index, row in part.items()}
    return [rows[index] for index in range(len(samples))]


def credit_rows(samples, credit, config, completed=0, stop=None):
    """Each sample's credits ([floats]: per token, or one for the sequence; `score`), with
    DAPO's soft overlong punishment (config: grpo_loss.RewardConfig's overlong_buffer) added to each."""
    rows = score(samples, credit, completed, stop)
    if not config.overlong_buffer:
        return rows
    lengths = torch.tensor([len(sample["response_ids"]) for sample in samples])
    penalties = grpo_loss.overlong_penalty(lengths, config.max_new_tokens, config.overlong_buffer,
                                           config.overlong_penalty)
    return [[value + penalty for value in row] for row, penalty in zip(rows, penalties.tolist())]


def set_advantages(samples, rows, config):
    """Rewards [N] fp32 (each completion's mean credit); sets each sample's per-token
    advantages and, under config.overlong_filter (grpo_loss.RewardConfig), whether it is in
    the loss. Per-token credits of unequal lengths are zero-padded for the per-position
    group baseline; a sequence reward spreads over its tokens."""
    lengths = [len(row) for row in rows]
    width = max(lengths)
    credits = torch.tensor([row + [0.0] * (width - len(row)) for row in rows])          # [N, L]
    advantages = grpo_loss.group_advantages(credits, config.group_size, config.advantage)
    for sample, advantage, length in zip(samples, advantages, lengths):
        sample["advantages"] = advantage[:length].expand(len(sample["response_ids"]))
        if config.overlong_filter:
            sample["in_loss"] = not sample["truncated"]
    # The padding adds zeros: each row's sum is its credits'.
    return credits.sum(dim=1) / torch.tensor(lengths, dtype=credits.dtype)


def refusing(function, *args):
    """`function(*args)`, a tasks.InputError (bad data, a bad reward) or a
    checkpoint.CheckpointError (a resume or save refused) turned into a refusal."""
    try:
        return function(*args)
    except (tasks.InputError, checkpoint.CheckpointError) as error:
        raise usage_error(str(error)) from None


# ---------------------------------------------------------------------------------------
# Sync, evaluation and the step's record
# ---------------------------------------------------------------------------------------

def sync_weights(engines, policy, step):
    """The sync phase: push every weight, MTP draft included, into the engine (woken on a
    GPU) and check its draft every --check-draft-every steps. The next rollout probes what
    it holds (sample_batch)."""
    checkpoint.fault_point("sync", step)
    rollout.push_weights(engines, policy.model, step)


def evaluate(run, step):
    """Greedy completions of the held-out examples after `step`, scored like training's:
    {eval_accuracy (reward 1), eval_reward_mean, eval_response_length}, on every rank."""
    s = run.config
    params = rollout.sampling_params(1, 0.0, s.max_new_tokens, ignore_eos=s.ignore_eos)
    samples, _, _ = rollout.rollout(run.engines.active(), run.tokenizer, run.held_out, params, s.rollout_tp, run.rank)
    rewards = torch.tensor([sum(row) / len(row) for row in score(samples, run.credit, step, run.stop)])
    return {"eval_accuracy": (rewards == 1).float().mean().item(), "eval_reward_mean": rewards.mean().item(),
            "eval_response_length": sum(len(s["response_ids"]) for s in samples) / len(samples)}


def draft_record(engines, acceptance, checked, tried):
    """The step's drafting metrics: draft_tokens (the most the rollout drafted in any band,
    0: none), draft_schedule (its k per band of batch sizes, spec_config.BAND_EDGES; None:
    none drafts, the draft idle), bands (per band the rollout ran: {steps, seconds, tokens,
    drafted, accepted, k}, summed over engines), the rollout's acceptance_rate,
    mean_acceptance_length and acceptance_by_depth ([A_1..A_k], A_i the share of verify
    steps that accepted the first i drafts; None without drafting), and under auto
    check_acceptance_by_depth (the tune phase's check, at the deepest k, on the steps it
    ran) and tried_band_speeds (each variant's fastest tokens/s per band so far, on the
    steps whose rollout was a try)."""
    record = {"draft_tokens": engines.draft_tokens(), "draft_schedule": engines.schedule,
              "bands": {spec_config.band_label(band): counts for band, counts in engines.bands.items()},
              "acceptance_rate": acceptance["acceptance_rate"] if acceptance else None,
              "mean_acceptance_length": acceptance["mean_acceptance_length"] if acceptance else None,
              "acceptance_by_depth": draft_tuner.acceptance_by_depth(acceptance) or None}
    if checked is not None:
        record["check_acceptance_by_depth"] = draft_tuner.acceptance_by_depth(checked)
    if tried:
        record["tried_band_speeds"] = {str(variant): engines.tuner.band_speeds(variant)
                                       for variant in engines.tuner.realized}
    return record


# ---------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class RunConfig:
    """What the run's own loop reads (built in `main` by run_configs.settings_config, which takes
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


def start(settings, config, data, reward, resume_dir, examples, held_out, stop, inputs):
    """Process group, tokenizer, policy, engines and checkpoint: the run before step 1, each
    part timed (Run.start_seconds; the imports and flag checks before it as "imports").
    config: RunConfig, data: tasks.DataConfig, reward: grpo_loss.RewardConfig; `settings`,
    the resolved flags, go to flags alone, which settles the engines' context from them once
    the prompts are tokenized and makes the train and rollout configs."""
    s, timer = config, run_log.PhaseTimer()
    timer.seconds["imports"] = time.perf_counter() - IMPORTS_STARTED
    with timer("process group"):
        rank, world_size, device = init_distributed()
        lock = lock_out(s.out, rank)
        if rank == 0 and s.resume in ("auto", "afresh"):  # choose_checkpoint's warnings said so
            checkpoint.set_aside_failed(s.out, resume_dir)
    random.seed(s.seed)
    torch.manual_seed(s.seed)
    with timer("model files"):
        # The built-in model is written once and cached; only rank 0 writes it.
        model_dir = s.model or broadcast(write_builtin_model(s.builtin_model) if rank == 0 else None)
        # The one tokenizer of prompts and answers (vLLM loads the same, through transformers).
        from transformers import AutoTokenizer
        # Never the checkpoint's remote code (MiMo's config names some): its tokenizer files suffice.
        tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=False)
        # The engines' context is the run's, not the model's (a published 128k one would
        # ask for KV cache the run never uses): refused here when it does not fit.
        longest = refusing(tasks.check_prompts, examples + held_out, tokenizer, s.max_positions, s.max_new_tokens)
        longest = max(longest, len(tasks.prompt_token_ids(tokenizer, rollout.PROBE_PROMPT)))
        hf_config = flags.model_config(settings)
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
        hf_weights.copy_hf_metadata(model_dir, directory)
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


def save_state(run, step, tuner_state=None):
    """Every rank's checkpoint of the run after `step`; `tuner_state` is auto's tuner's
    state then, where the tuner has moved on since (default: its state now)."""
    state = {"model": run.policy.model.state_dict(), "optimizer": trainer.optimizer_state(run.policy.optimizer),
             "step": step}
    if run.engines.tuner is not None:
        # Its tries and acceptance: the resumed run drafts as the uninterrupted one would.
        state["draft_tuner"] = tuner_state or run.engines.tuner.state_dict()
    meta = dict(run_layout(run.config, run.world_size), flags=run.config.resolved_flags, inputs=run.inputs)
    refusing(checkpoint.save_checkpoint, run.config.out, step, state, meta, run.config.keep_checkpoints, run.rank)


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
        hf_config = flags.model_config(s)
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
    # Each part of the run takes its own config from here on (`start` hands the settings to flags
    # and run_configs alone).
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


def main(args):
    world_size = run_configs.plan_world_size(args) if args.plan else int(os.environ.get("WORLD_SIZE", "1"))
    prepared = refused_on_any_rank(prepare, args, world_size)
    if prepared is None:
        return []
    s, config, data, reward, resume_dir, changed, inputs, examples, held_out = prepared
    # SIGTERM / SIGINT from here on: stop after the step under way, with a checkpoint.
    stop = checkpoint.StopRequest()
    run = start(s, config, data, reward, resume_dir, examples, held_out, stop, inputs)
    metrics_path, records, writer, wandb_run = open_outputs(run, resume_dir, args, changed)
    # The ranks begin step 1 together: their skew at the start (rank 0 alone opens the
    # loggers) belongs to the start, not to step 1's first phase.
    dist.barrier()
    started = time.time()

    for step in range(run.start_step + 1, config.steps + 1):
        try:
            record = run_step(run, step)
        except RewardFailure as failure:
            raise stopped_by_reward(run, step, failure)
        except FloatingPointError as error:
            raise non_finite(run, resume_dir, step, error)
        if run.rank == 0:
            records.append(record)
            run_log.log_step(record, metrics_path, writer, config.steps, time.time() - started, step - run.start_step,
                             wandb_run)
        stop_signal = stop.agreed(run.device)
        if step % config.save_every == 0 or step == config.steps or stop_signal:
            save_state(run, step)
        if stop_signal:
            raise stopped(run, step, stop_signal)

    finish(run, records, (writer, wandb_run), time.time() - started)
    return records


def run_step(run, step):
    """One training step, a call per phase; returns its metrics record. A reward that fails
    is a RewardFailure, on every rank."""
    s, engines, policy, timer = run.config, run.engines, run.policy, run_log.PhaseTimer()
    dp_size = parallel_state.get_data_parallel_world_size()
    # What a checkpoint of the step before holds, should this one stop at its rewards.
    run.tuner_before_step = copy.deepcopy(engines.tuner.state_dict()) if engines.tuner is not None else None
    # Prompts: the same examples on every rank, from (seed, step) alone
    examples_now = tasks.sample_prompts(run.examples, step, s.prompts_per_step * dp_size, s.seed)
    # Tune: how many tokens the MTP head drafts in this rollout (auto)
    with timer("tune"):
        checked, tried = rollout.tune_draft_tokens(engines, policy.model, run.tokenizer, examples_now, step,
                                                   run.check_params, run.rank)
    # Rollout: vLLM samples --group-size completions per prompt, the MTP head drafting;
    # rewards and GRPO advantages (--dynamic-sampling: more rollouts for informative groups)
    with timer("rollout"):
        samples, rewards, acceptance, sampling = sample_batch(run, step, examples_now, run.params)
    # The policy loss on this data-parallel rank's share
    with timer("train"):
        train_sums = trainer.train(policy, samples, run.train_config)
    # Sync: the new weights, MTP draft included, into vLLM
    with timer("sync"):
        sync_weights(engines, policy, step)
    # Evaluate: greedy on the held-out set, every --eval-every steps and after the last
    eval_metrics = {}
    if step % s.eval_every == 0 or step == s.steps:
        with timer("eval"):
            eval_metrics = evaluate(run, step)
    train_metrics = trainer.reduce_metrics(train_sums, run.device)
    if engines.tuner is not None:
        # The trainer's estimate of the draft acceptance: the same on every rank, of the rollout's weights.
        engines.tuner.observe_estimate(train_metrics["mtp_acceptance"])
    record = run_log.step_record(step, samples, rewards, train_metrics,
                                 draft_record(engines, acceptance, checked, tried), eval_metrics, timer.seconds)
    record.update(sampling)
    return record


def stopped_by_reward(run, step_under_way, failure):
    """The SystemExit of a run whose reward failed (`failure`, a RewardFailure) in the step
    under way: the last completed step saved first, unless a checkpoint of it exists. A
    failure in the rollout leaves the weights of the step before; auto's tuner goes back to
    where that step left it."""
    s, step = run.config, failure.completed
    saved = step == run.start_step or step % s.save_every == 0
    if step and not saved:
        save_state(run, step, run.tuner_before_step if step < step_under_way else None)
    kept = (f"the checkpoint of step {step} is in {os.path.join(s.out, checkpoint.CHECKPOINTS_DIR)}, and the same "
            "command resumes from it" if step else "no step had completed")
    if failure.signum:
        return stopped(run, step, failure.signum)
    return usage_error(f"{failure}; {kept}")


def non_finite(run, resume_dir, step, error):
    """The SystemExit of a step whose loss or gradient norm is not finite (`error`). When it
    is the first step after a resume, the checkpoint resumed from is what holds the bad
    state: it is set aside (rank 0), so that the same command falls back to the one before."""
    message = f"step {step}: {error}"
    if resume_dir and step == run.start_step + 1:
        dist.barrier()
        if run.rank == 0:
            aside = checkpoint.set_aside(resume_dir, "nonfinite")
            message += (f"; the checkpoint it resumed from gives this at its first step, so it was set aside as "
                        f"{aside}, and the same command resumes from the one before it")
    return usage_error(message)


def stopped(run, step, signum):
    """The SystemExit of a run stopped by a signal after `step` (status 128 + its number, as
    the signal itself would give), said once."""
    if run.rank == 0:
        print(f"train_grpo.py: stopped by {signal.Signals(signum).name} after step {step}; its checkpoint is in "
              f"{os.path.join(run.config.out, checkpoint.CHECKPOINTS_DIR)}, and the same command resumes from it",
              file=sys.stderr, flush=True)
    return SystemExit(128 + signum)


def sleep_level(train_config):
    """vLLM's sleep level after a GPU rollout: 2 drops its weights (every push sends them
    all again); 1 keeps a host copy, needed when the draft drafts but does not train
    (nothing refills it). train_config: trainer.TrainConfig."""
    return 1 if train_config.mtp_rollout and not train_config.mtp_train else 2


def finish(run, records, loggers, seconds):
    """The trained policy as a HF checkpoint in OUT/final, the plots, the closing summary;
    `loggers` (TensorBoard's writer, the W&B run; each None when off) are closed."""
    out = run.config.out
    try:
        hf_weights.save_hf_checkpoint(run.policy.model, run.model_dir, os.path.join(out, "final"))
    except hf_weights.ExportError as error:
        raise usage_error(f"{error}; the checkpoint of step {run.config.steps} is in "
                          f"{os.path.join(out, checkpoint.CHECKPOINTS_DIR)}: free some space, and the same command "
                          "resumes from it and exports again") from None
    writer, wandb_run = loggers
    if writer is not None:
        writer.close()
    if wandb_run is not None:
        wandb_run.finish()
    if run.rank != 0 or not records:
        return
    run_log.plot_curves(records, os.path.join(out, "curves.png"))
    written = [os.path.join(out, name) for name in ("metrics.jsonl", "curves.png")]
    if run_log.plot_acceptance_against_entropy(records, os.path.join(out, "acceptance_vs_entropy.png")):
        written.append(os.path.join(out, "acceptance_vs_entropy.png"))
    print(run_log.summary(records, seconds, run.config.steps - run.start_step), flush=True)
    print(f"wrote {', '.join(written)}, {os.path.join(out, 'final')}", flush=True)


def exit_now(code):
    """Ends the process with SystemExit's `code` (None or 0: success; a message: said on
    stderr by rank 0, status 1), skipping the interpreter's shutdown. Every output is written,
    flushed and closed by then, and the checkpoint lock is the kernel's to release; left to
    themselves, vLLM's exit hooks would collect garbage engine by engine and the interpreter
    would tear down every module: seconds of a short run's wall, with nothing left to save."""
    if code is not None and not isinstance(code, int):
        if os.environ.get("RANK", "0") == "0":  # every rank has the message; one says it
            print(code, file=sys.stderr)
        code = 1
    if code and os.environ.get("RANK", "0") != "0":
        # Rank 0 alone says why a run stopped, maybe a moment later: torchrun would stop it,
        # unsaid, as soon as another rank is gone. The slow way out leaves it that moment.
        sys.exit(code)
    if shared_memory_names() - SHARED_MEMORY_BEFORE:
        # vLLM's CPU engines over several ranks (--rollout-tp) share memory there that only
        # their destructors unlink; left behind, it would stop the next run's engines.
        sys.exit(code)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)


if __name__ == "__main__":
    try:
        main(flags.parse_args())
    except SystemExit as stop:
        exit_now(stop.code)
    exit_now(0)
