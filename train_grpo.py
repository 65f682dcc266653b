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

Where each concern lives: launch.py (the run before step 1: the checks on every rank, the
inputs, the process group, policy, engines and checkpoint to resume), flags.py (the command
line, checked and resolved, and each module's config from it), tasks.py (built-in tasks,
data files), rewards.py (exact match, --reward), rollout.py (vLLM engines), draft_tuner.py
(how many tokens to draft), grpo_loss.py (advantages, aggregation, PPO loss), trainer.py
(the Megatron train step), forward.py (Megatron log-probs), vllm_sync.py (Megatron -> vLLM),
hf_weights.py (Megatron <-> HF), hf_export.py (the final HF directory), checkpoint.py (save, resume, signals, the --out lock),
run_log.py (console, metrics.jsonl, TensorBoard, plots).
Metrics: OUT/metrics.jsonl, TensorBoard under OUT/tensorboard, curves.png and
acceptance_vs_entropy.png at the end; the trained policy as a HF checkpoint in OUT/final.
"""

import copy
import gc
import os
import signal
import sys
import time

# The process's start: what the imports below and the run's start cost is reported from it.
IMPORTS_STARTED = time.perf_counter()
if __name__ == "__main__":
    # The imports and the run's start allocate millions of objects that live for the run:
    # collections would walk a growing heap for nothing. Off until `launch.start` freezes them.
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
import hf_export  # noqa: E402
import launch  # noqa: E402
import rewards  # noqa: E402
import rollout  # noqa: E402
import run_configs  # noqa: E402
import spec_config  # noqa: E402
import tasks  # noqa: E402
import trainer  # noqa: E402
from flags import usage_error  # noqa: E402

if __name__ == "__main__" and WANDB_KEPT_OUT:
    del sys.modules["wandb"]


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
        except (rewards.InputError, rewards.RewardInterrupted) as error:
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
    ran) and tried_band_speeds (each variant's mean tokens/s per band so far, on the
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

def save_state(run, step, tuner_state=None):
    """Every rank's checkpoint of the run after `step`; `tuner_state` is auto's tuner's
    state then, where the tuner has moved on since (default: its state now)."""
    state = {"model": run.policy.model.state_dict(), "optimizer": trainer.optimizer_state(run.policy.optimizer),
             "step": step}
    if run.engines.tuner is not None:
        # Its tries and acceptance: the resumed run drafts as the uninterrupted one would.
        state["draft_tuner"] = tuner_state or run.engines.tuner.state_dict()
    meta = dict(launch.run_layout(run.config, run.world_size), flags=run.config.resolved_flags, inputs=run.inputs)
    launch.refusing(checkpoint.save_checkpoint, run.config.out, step, state, meta, run.config.keep_checkpoints,
                    run.rank)


def main(args):
    world_size = run_configs.plan_world_size(args) if args.plan else int(os.environ.get("WORLD_SIZE", "1"))
    prepared = launch.refused_on_any_rank(launch.prepare, args, world_size)
    if prepared is None:
        return []
    s, config, data, reward, resume_dir, changed, inputs, examples, held_out = prepared
    # SIGTERM / SIGINT from here on: stop after the step under way, with a checkpoint.
    stop = checkpoint.StopRequest()
    run = launch.start(s, config, data, reward, resume_dir, examples, held_out, stop, inputs, IMPORTS_STARTED)
    metrics_path, records, writer, wandb_run = launch.open_outputs(run, resume_dir, args, changed)
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
        hf_export.save_hf_checkpoint(run.policy.model, run.model_dir, os.path.join(out, "final"))
    except hf_export.ExportError as error:
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


# How long a rank other than 0 waits for rank 0 to say a message both have (exit_now).
RANK_0_SAYS_IT_WITHIN_SECONDS = 60


def wait_for_rank_0_to_say(message):
    """On a rank other than 0, with a usage error's `message`: waits until torchrun stops
    this process (status 1), which it does once rank 0 has said the message and exited. Rank
    0 may be seconds behind, still importing on a loaded machine; had this rank exited first,
    torchrun would have stopped rank 0 before it spoke. A message only this rank has (rank 0
    never exits) is said here, with the rank, after RANK_0_SAYS_IT_WITHIN_SECONDS."""
    def stop(signum, frame):
        sys.exit(1)  # the slow way out: vLLM's destructors unlink their shared memory

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    time.sleep(RANK_0_SAYS_IT_WITHIN_SECONDS)
    print(f"[rank {os.environ['RANK']}] {message}", file=sys.stderr, flush=True)
    sys.exit(1)


def exit_now(code):
    """Ends the process with SystemExit's `code` (None or 0: success; a message: said on
    stderr by rank 0, status 1), skipping the interpreter's shutdown. Every output is written,
    flushed and closed by then, and the checkpoint lock is the kernel's to release; left to
    themselves, vLLM's exit hooks would collect garbage engine by engine and the interpreter
    would tear down every module: seconds of a short run's wall, with nothing left to save."""
    rank = os.environ.get("RANK", "0")
    if code is not None and not isinstance(code, int):
        if rank != "0":  # every rank has the message; one says it
            wait_for_rank_0_to_say(code)
        print(code, file=sys.stderr)
        code = 1
    if code and rank != "0":
        # Rank 0 alone says why a run stopped (a signal), maybe a moment later: torchrun would
        # stop it, unsaid, as soon as another rank is gone. The slow way out leaves it that moment.
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
