"""The supervised model RL starts from: a built-in task's answers learned by cross entropy,
the MTP head with them, once; later runs reuse the checkpoint.

    python warm_start.py --task tail --base runs/deep-mimo --out runs/deep-mimo-tail
    model_dir = warm_started(WarmStartConfig(task="tail"), "runs/deep-mimo", "runs/deep-mimo-tail")

Real RL starts from a model that already answers in the task's form (a pretrained and
instruction-tuned one); RL from random weights spends its first minutes finding the form at
all, with rollouts that run to the length limit. This stage gives a built-in task the same
start: a few hundred optimizer steps of teacher-forced cross entropy on the training pool's
answers (EOS included), with the MTP head learning the policy as in RL (trainer.py), then a
Hugging Face checkpoint that RL, vLLM included, loads like any other.

The step is the trainer's own: with every token's advantage 1 and one optimizer step per
batch (the ratio is 1), the PPO loss's gradient is the gradient of the answers' mean
cross entropy, -1/T sum_t d log p(token t). The samples' rollout log-probs are 0, so the
trainer's logprob_mismatch_mean is that cross entropy, which the progress line prints.

The checkpoint is stamped with everything it was made from (the base model's stamp and
this stage's config): a directory with the same stamp is reused, any other is rebuilt; the
stamp is written last, so an interrupted stage is never mistaken for a finished one. The
stage runs in one process, whatever the caller's layout, so every run gets the same model.

Imports torch, megatron-core (through trainer), transformers (the tokenizer) and the
project's tasks, tiny_model (its stamp), trainer, grpo_loss, hf_export, mtp_patch,
mtp_policy_target and cpu_backend.
"""

import argparse
import dataclasses
import json
import os
import random
import shutil
import subprocess
import sys
import time

import torch

import grpo_loss
import hf_export
import mtp_patch
import mtp_policy_target
import tasks
import tiny_model
import trainer
from cpu_backend import init_distributed, init_model_parallel

STAMP = "warm_start.json"
# Environment a torchrun worker passes on: the stage is a world of its own.
DISTRIBUTED_ENVIRONMENT = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                           "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_WORLD_SIZE",
                           "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RUN_ID")
LOG_EVERY = 25


@dataclasses.dataclass(frozen=True)
class WarmStartConfig:
    """The supervised stage: the task whose training answers it learns and how."""
    task: str = "tail"                # tasks.TASKS: its training pool's answers, EOS included
    steps: int = 100                  # optimizer steps
    answers_per_step: int = 32        # drawn from the pool, a fixed seed per step
    lr: float = 1e-3                  # Adam's; the deep model learns count's rule at this rate
    seed: int = 0
    mtp_loss: str = trainer.TrainConfig.mtp_loss  # the MTP head's loss against the policy, as in RL
    mtp_train_depths: int = None      # the MTP depths the head trains, as in RL (None: one per MTP layer)


def train_config(config):
    """The trainer's settings for cross entropy: advantages 1, one optimizer step a batch, no
    entropy bonus, no truncated IS (the samples carry no rollout log-probs)."""
    return trainer.TrainConfig(lr=config.lr, mtp_loss=config.mtp_loss, mtp_train_depths=config.mtp_train_depths,
                               loss=grpo_loss.LossConfig(tis_cap=0.0, entropy_coef=0.0))


def answer_samples(examples, tokenizer, rng):
    """The trainer's samples of teacher-forced answers: {prompt_ids, response_ids (the answer's
    ids and EOS), advantages [R] 1.0, rollout_logprobs [R] 0.0, group}. Each letter's case is
    drawn from `rng` (a random.Random): the built-in tasks credit either, and a policy that
    keeps the free choice keeps its entropy, as a reasoning policy keeps its phrasing's."""
    samples = []
    for index, example in enumerate(examples):
        answer = "".join(char.upper() if char.isalpha() and rng.random() < 0.5 else char for char in example["answer"])
        response_ids = tokenizer.encode(answer, add_special_tokens=False) + [tokenizer.eos_token_id]
        samples.append({"prompt_ids": tasks.prompt_token_ids(tokenizer, example["prompt"]),
                        "response_ids": response_ids, "advantages": torch.ones(len(response_ids)),
                        "rollout_logprobs": [0.0] * len(response_ids), "group": index})
    return samples


def stamp_of(config, base_dir):
    """What the checkpoint is made from: this stage's config and the base model's stamp."""
    # The base checkpoint's own stamp: the warm start is rebuilt when the base model changes.
    with open(os.path.join(base_dir, tiny_model.STAMP_FILE)) as f:
        return {"warm_start": dataclasses.asdict(config), "base": json.load(f)}


def is_built(config, base_dir, out_dir):
    """Whether `out_dir` holds this stage's checkpoint from `base_dir` already."""
    path = os.path.join(out_dir, STAMP)
    if not os.path.exists(path):
        return False
    with open(path) as f:
        return json.load(f) == stamp_of(config, base_dir)


def warm_start(config, base_dir, out_dir):
    """Run the stage in this process (a world of one) and write the checkpoint to `out_dir`
    (the stamp last); returns `out_dir`. Prints a progress line after the first step, every LOG_EVERY and the last."""
    from transformers import AutoTokenizer
    init_distributed()
    init_model_parallel()
    mtp_patch.patch_megatron_mtp()
    torch.manual_seed(config.seed)
    settings = train_config(config)
    policy = trainer.build_policy(base_dir, settings)
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    examples, _ = tasks.split_examples(None, None, config.seed, config.task)
    started = time.perf_counter()
    for step in range(1, config.steps + 1):
        rng = random.Random(tasks.step_seed(config.seed, step))
        batch = rng.choices(examples, k=config.answers_per_step)
        sums = trainer.train(policy, answer_samples(batch, tokenizer, rng), settings)
        if step == 1 or step % LOG_EVERY == 0 or step == config.steps:
            metrics = trainer.reduce_metrics(sums, torch.device("cpu"))
            elapsed = time.perf_counter() - started
            print(f"warm start {config.task} step {step}/{config.steps}: cross entropy "
                  f"{metrics['logprob_mismatch_mean']:.3f}, MTP acceptance {metrics['mtp_acceptance'] or 0:.3f}, "
                  f"{step / elapsed:.1f} steps/s, ETA {(config.steps - step) * elapsed / step:.0f} s", flush=True)
    if os.path.exists(out_dir):
        shutil.rmtree(out_dir)
    hf_export.save_hf_checkpoint(policy.model, base_dir, out_dir)
    with open(os.path.join(out_dir, STAMP), "w") as f:
        json.dump(stamp_of(config, base_dir), f, indent=2)
    return out_dir


def warm_started(config, base_dir, out_dir):
    """`out_dir` holding the stage's checkpoint from `base_dir`: reused when its stamp
    matches, else built by `python warm_start.py` in a process of its own (the caller may
    be one rank of a larger world). Returns `out_dir`; a failed stage raises RuntimeError."""
    if is_built(config, base_dir, out_dir):
        return out_dir
    environment = {name: value for name, value in os.environ.items() if name not in DISTRIBUTED_ENVIRONMENT}
    flags = [f"--{name.replace('_', '-')}={value}" for name, value in dataclasses.asdict(config).items()
             if value is not None]
    command = [sys.executable, os.path.abspath(__file__), f"--base={base_dir}", f"--out={out_dir}", *flags]
    print(f"warm start: building {out_dir} ({config.steps} supervised steps on {config.task}; once)", flush=True)
    if subprocess.run(command, env=environment).returncode != 0 or not is_built(config, base_dir, out_dir):
        raise RuntimeError(f"the warm start of {out_dir} from {base_dir} failed (its output is above); run "
                           f"{' '.join(command)} to see it alone")
    return out_dir


def positive_int(text):
    """argparse type: an int >= 1, else the value named and what was expected."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text}: expected an int >= 1")
    return value


def main():
    defaults = WarmStartConfig()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, help="the Hugging Face checkpoint to start from")
    parser.add_argument("--out", required=True, help="directory to write the supervised checkpoint into")
    parser.add_argument("--task", choices=sorted(tasks.TASKS), default=defaults.task,
                        help="the built-in task whose training answers the model learns")
    parser.add_argument("--steps", type=positive_int, default=defaults.steps, help="optimizer steps")
    parser.add_argument("--answers-per-step", type=positive_int, default=defaults.answers_per_step,
                        help="answers in each step's batch, drawn from the training pool")
    parser.add_argument("--lr", type=float, default=defaults.lr, help="Adam's learning rate")
    parser.add_argument("--seed", type=int, default=defaults.seed, help="seed of the batches' draws")
    parser.add_argument("--mtp-loss", choices=mtp_policy_target.POLICY_TARGET_LOSSES, default=defaults.mtp_loss,
                        help="the MTP head's loss against the policy (train_grpo's --mtp-loss)")
    parser.add_argument("--mtp-train-depths", type=positive_int, default=defaults.mtp_train_depths,
                        help="the MTP depths the head trains (train_grpo's --mtp-train-depths; default: one per "
                             "MTP layer)")
    args = parser.parse_args()
    config = WarmStartConfig(task=args.task, steps=args.steps, answers_per_step=args.answers_per_step, lr=args.lr,
                             seed=args.seed, mtp_loss=args.mtp_loss, mtp_train_depths=args.mtp_train_depths)
    print(f"wrote {warm_start(config, args.base, args.out)}")


if __name__ == "__main__":
    main()
