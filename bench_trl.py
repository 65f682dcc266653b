"""The trl_step row of bench.py: the default run's step against Hugging Face TRL's
GRPOTrainer on the same work, each in a process of its own, taking turns.

    .venv/bin/python -m pip install -r requirements-bench.txt
    .venv/bin/python bench.py --rows trl_step

Ours is `torchrun --nproc_per_node 2 train_grpo.py` with its defaults; TRL's runs in
`bench.py --trl-worker OUT` (`trl_worker`) with the same model, task, batch, lr and loss
settings. Each run's wall clock and the peak resident memory of its largest process come
from wait4; the row reports the median step times' ratio per round.

Imports torch, the standard library and the project's tasks and harness; TRL, datasets and
transformers (with flags, launch, run_configs and grpo_loss, for the default run's configs)
inside trl_worker.
"""

import json
import os
import shutil
import statistics
import subprocess
import sys
import time

import torch

import tasks
from harness import REPO_DIR

# TRL, pinned in requirements-bench.txt; the tests never import it.
TRL_VERSION = "1.16.0"
TRL_ROUNDS = 3
TRL_RUN_DIR = os.path.join(REPO_DIR, "runs", "bench-trl")
# TRL in one process on every core (its own default); ours: torchrun's processes x 1 thread.
TRL_THREADS = 2
OUR_PROCESSES = 2
REWARD_TARGET = 0.9


def trl_worker(out):
    """Runs in its own process (`bench.py --trl-worker OUT`): TRL's GRPOTrainer with plain HF
    generate on the default run's work: the built-in model (its Qwen2 trunk; TRL has no MTP
    head to train), task, prompts per step (both data-parallel ranks' share), group size,
    completion length (forced, as ours ignores EOS), lr, PPO clips, entropy bonus, no KL, the
    task's mean per-character credit as the sequence reward, fp32 without activation recompute
    (as ours; TRL defaults to bf16 and gradient checkpointing). Writes OUT/trl.json: per-step
    seconds and rewards, the seconds of the whole training."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    import flags
    import launch
    import run_configs
    from grpo_loss import RewardConfig
    torch.set_num_threads(TRL_THREADS)
    settings = flags.check_args(flags.parse_args(["--out", out]), world_size=OUR_PROCESSES)
    # The default run's configs, as launch.prepare builds them.
    run = run_configs.settings_config(settings, launch.RunConfig, resolved_flags=vars(settings))
    data, reward = run_configs.settings_config(settings, tasks.DataConfig), run_configs.settings_config(settings, RewardConfig)
    train = run_configs.train_config(settings)
    model_dir = launch.write_builtin_model(run.builtin_model)
    examples, _ = tasks.split_examples(None, None, run.seed, data.task, data.count_step)
    prompts_per_step = OUR_PROCESSES * run.prompts_per_step
    steps = []

    def credit(completions, answer, **_):
        return [sum(a == b for a, b in zip(text, gold)) / len(gold) for text, gold in zip(completions, answer)]

    class StepTimes(TrainerCallback):
        def on_step_begin(self, args, state, control, **_):
            self.started = time.perf_counter()

        def on_step_end(self, args, state, control, **_):
            steps.append({"seconds": time.perf_counter() - self.started})

    config = GRPOConfig(
        output_dir=out, per_device_train_batch_size=prompts_per_step * reward.group_size,
        num_generations=reward.group_size, max_completion_length=run.max_new_tokens,
        generation_kwargs={"min_new_tokens": run.max_new_tokens}, temperature=train.temperature,
        learning_rate=train.lr, lr_scheduler_type="constant", warmup_steps=0, max_steps=run.steps,
        beta=0.0, epsilon=train.loss.clip_low, epsilon_high=train.loss.clip_high, entropy_coef=train.loss.entropy_coef,
        max_grad_norm=train.grad_clip, adam_beta2=0.99, seed=run.seed, use_cpu=True, report_to="none",
        # fp32 without activation recompute, as ours: TRL's own defaults are bf16 and gradient
        # checkpointing, which on a CPU without bf16 matrix units run its step several times slower.
        bf16=False, gradient_checkpointing=False,
        save_strategy="no", logging_steps=1, disable_tqdm=True, dataloader_num_workers=0)
    rows = [{"prompt": e["prompt"], "answer": e["answer"]} for e in examples]
    dataset = Dataset.from_list(rows * (run.steps * prompts_per_step // len(rows) + 1))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    grpo = GRPOTrainer(model=model, reward_funcs=credit, args=config, train_dataset=dataset,
                       processing_class=AutoTokenizer.from_pretrained(model_dir), callbacks=[StepTimes()])
    started = time.perf_counter()
    grpo.train()
    rewards = [entry["reward"] for entry in grpo.state.log_history if "reward" in entry]
    for step, reward in zip(steps, rewards):
        step["reward_mean"] = reward
    with open(os.path.join(out, "trl.json"), "w") as f:
        json.dump({"steps": steps, "train_s": time.perf_counter() - started}, f)


def timed_process(command, out):
    """(wall seconds, peak resident bytes of its largest process) of `command` run in a fresh
    `out`; its output goes to OUT/console.log."""
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    started = time.perf_counter()
    with open(os.path.join(out, "console.log"), "w") as log:
        process = subprocess.Popen(command, cwd=REPO_DIR, stdout=log, stderr=subprocess.STDOUT)
        # wait4's usage covers this child and the descendants it waited for (torchrun's workers).
        _, status, usage = os.wait4(process.pid, 0)
    seconds = time.perf_counter() - started
    if os.waitstatus_to_exitcode(status):
        raise RuntimeError(f"{' '.join(command)} exited with {os.waitstatus_to_exitcode(status)}; see "
                           f"{os.path.join(out, 'console.log')}")
    return seconds, usage.ru_maxrss * 1024


def run_summary(step_seconds, rewards, wall_s, peak_bytes):
    reached = next((step for step, reward in enumerate(rewards, 1) if reward >= REWARD_TARGET), None)
    return {"median_step_s": statistics.median(step_seconds), "wall_s": wall_s, "peak_bytes": peak_bytes,
            "reward_last": rewards[-1], "reward_target_step": reached}


def row_trl_step():
    """Ours (`torchrun --nproc_per_node 2 train_grpo.py`, defaults) and TRL's GRPOTrainer on
    the same work, taking turns for TRL_ROUNDS rounds; the ratio is TRL's median step time
    over ours, per round. A step is a rollout plus a train step: ours is the sum of its
    phases (tune, rollout, train, sync, eval), TRL's the wall time of its training step
    (generation included)."""
    import importlib.metadata
    try:
        installed = importlib.metadata.version("trl")
    except importlib.metadata.PackageNotFoundError:
        raise SystemExit(f"bench.py --rows trl_step needs TRL: .venv/bin/pip install -r requirements-bench.txt "
                         f"(trl=={TRL_VERSION})") from None
    rounds = []
    for number in range(1, TRL_ROUNDS + 1):
        ours_out, trl_out = (os.path.join(TRL_RUN_DIR, f"{name}_{number}") for name in ("ours", "trl"))
        print(f"trl_step round {number}/{TRL_ROUNDS}: ours ...", file=sys.stderr, flush=True)
        wall, peak = timed_process([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node",
                                    str(OUR_PROCESSES), "train_grpo.py", "--out", ours_out, "--resume", "never"],
                                   ours_out)
        with open(os.path.join(ours_out, "metrics.jsonl")) as f:
            records = [json.loads(line) for line in f]
        phases = ("tune_s", "rollout_s", "train_s", "sync_s", "eval_s")
        ours = run_summary([sum(r.get(phase) or 0.0 for phase in phases) for r in records],
                           [r["reward_mean"] for r in records], wall, peak)
        ours.update({phase: statistics.median(r.get(phase) or 0.0 for r in records) for phase in phases})
        print(f"trl_step round {number}/{TRL_ROUNDS}: TRL {installed} ...", file=sys.stderr, flush=True)
        wall, peak = timed_process([sys.executable, "bench.py", "--trl-worker", trl_out], trl_out)
        with open(os.path.join(trl_out, "trl.json")) as f:
            trl = json.load(f)["steps"]
        trl = run_summary([s["seconds"] for s in trl], [s["reward_mean"] for s in trl], wall, peak)
        rounds.append((ours, trl))
    return [{"row": f"trl_step round {number}", "ours_ms": 1000 * ours["median_step_s"],
             "baseline_ms": 1000 * trl["median_step_s"], "speedup": trl["median_step_s"] / ours["median_step_s"],
             "notes": (f"ours: wall {ours['wall_s']:.0f} s, phases (median s) "
                       + " ".join(f"{phase[:-2]} {ours[phase]:.3f}" for phase in ("tune_s", "rollout_s", "train_s",
                                                                                  "sync_s"))
                       + f", reward >= {REWARD_TARGET} at step {ours['reward_target_step']}; TRL {installed}: wall "
                       f"{trl['wall_s']:.0f} s, reward >= {REWARD_TARGET} at step {trl['reward_target_step']}; peak "
                       f"RSS of the largest process {ours['peak_bytes'] / 2**20:.0f} / "
                       f"{trl['peak_bytes'] / 2**20:.0f} MiB")}
            for number, (ours, trl) in enumerate(rounds, 1)]
