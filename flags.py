"""train_grpo.py's command line: parsed, checked and resolved once; run_configs then hands
out each module's own small config from the resolved settings.

    args = parse_args()                              # the flags as given (None: derived later)
    settings = check_args(args, world_size)          # every problem named at once, or the resolved run
    settings = rollout_context(settings, hf_config, longest_prompt)  # the engines' context, once tokenized
    trainer.build_policy(model_dir, run_configs.train_config(settings))
    rollout.build_engines(model_dir, run_configs.rollout_config(settings), rank)

Every flag is checked before any process group exists (flag_checks.py: a bad value, a flag
that does not fit the model or the layout, a config.json megatron_model cannot build, a data
file or reward that does not load), each problem named with its value and what is expected,
all at once (`usage_error`: rank 0 says it, every process exits). The resolved settings are an argparse.Namespace;
train_grpo.py keeps it whole only as a checkpoint's meta (so that a resume can say which
flag changed). Every module, train_grpo's loop too, takes its own frozen dataclass.
Imports torch, the standard library and the modules whose defaults and checks it uses.
"""

import argparse
import math
import re

import torch

import draft_tuner
import flag_checks
import forward
import grpo_loss
import memory_plan
import preflight
import rollout
import run_configs
import tasks
import tiny_model
import trainer
from hf_families import mtp_layer_count
from megatron_model import DEFAULT_MTP_LOSS_SCALING_FACTOR

DEFAULT_MAX_POSITIONS = 4096
# DAPO's dynamic sampling: how many rollouts a step may take to fill its batch by default.
DEFAULT_SAMPLING_ROUNDS = 4


def usage_error(message):
    """The SystemExit for bad input, `message` on every rank (train_grpo says it once, on rank 0)."""
    return SystemExit(f"train_grpo.py: {message}")


class _ArgumentParser(argparse.ArgumentParser):
    def error(self, message):
        # argparse's own checks (types, bounds, choices) speak once, on rank 0, like ours.
        raise usage_error(f"{message} (--help lists every flag)")


# ---------------------------------------------------------------------------------------
# Flags: each bound next to its flag; every one checked before any process group exists
# ---------------------------------------------------------------------------------------

def number(kind, at_least=None, above=None, below=None, at_most=None, why=""):
    """An argparse `type=`: a finite `kind` (int or float) within the bounds given."""
    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: expected {'an int' if kind is int else 'a number'}") from None
        bounds = [(at_least, ">=", value >= (at_least or 0)), (above, ">", value > (above or 0)),
                  (below, "<", value < (below or 0)), (at_most, "<=", value <= (at_most or 0))]
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{text}: expected a finite number")
        for bound, sign, inside in bounds:
            if bound is not None and not inside:
                raise argparse.ArgumentTypeError(f"{value}: expected a number {sign} {bound}{why}")
        return value
    return parse


# The deepest draft a run may ask for. Each depth is accepted at most with the one before's
# probability, and a verify step costs more per drafted token: peers draft 1-3 (SkyRL 3,
# MiMo and DeepSeek 1-2) and NeMo-RL measured k >= 5 erasing the gain; even at 0.9
# acceptance per depth the 9th token would add 0.39 tokens to a verify step for a whole
# draft forward.
MAX_DRAFT_TOKENS = 8
PAST_MAX_DRAFT = f" (past {MAX_DRAFT_TOKENS} the drafts cost more than they are accepted)"


def draft_tokens_flag(value):
    """--num-speculative-tokens: "auto" or an int in 1..MAX_DRAFT_TOKENS."""
    if value == "auto":
        return value
    if not re.fullmatch(r"\d+", value) or not 1 <= int(value) <= MAX_DRAFT_TOKENS:
        raise argparse.ArgumentTypeError(f"{value!r}: expected auto or an int in 1..{MAX_DRAFT_TOKENS}{PAST_MAX_DRAFT}")
    return int(value)


POSITIVE_INT, COUNT = number(int, at_least=1), number(int, at_least=0)
# Where a flag's default is a module's setting, the module's config holds it, and the reason.
LOSS, TRAIN, ROLLOUT = grpo_loss.LossConfig(), trainer.TrainConfig(), rollout.RolloutConfig()
DATA, REWARD = tasks.DataConfig(), grpo_loss.RewardConfig  # REWARD's defaults (max_new_tokens: resolve's)
POSITIVE, NON_NEGATIVE = number(float, above=0), number(float, at_least=0)


def add_data_flags(p):
    p.add_argument("--model", default=None,
                   help="HF checkpoint dir of a MiMo, DeepSeek-V3, GLM-4.5 or Qwen3.5 model with MTP layers; default: "
                        "the built-in model of --builtin-model")
    p.add_argument("--builtin-model", choices=sorted(tiny_model.BUILTIN_MODELS), default=None,
                   help="the built-in model (written once under runs/) used without --model; default: the task's "
                        "(" + ", ".join(f"{task}: {spec['model']}" for task, spec in tasks.TASKS.items()) + ")")
    p.add_argument("--task", choices=sorted(tasks.TASKS), default=DATA.task,
                   help="built-in task without --data: repeat ('repeat:c' -> 'ccc', per-letter credit) or count "
                        f"('count:7' -> the next {tasks.TASKS['count']['length']} digits counting up mod 10, "
                        "'8901...', credit for each digit that follows the one before) or walk ('walk:q' -> "
                        "'rStu...z' then EOS: long-tailed response lengths, credit for each symbol that follows the "
                        "one before, in either case) or tail ('tail:x7' -> 'x8X9y0...z9' then EOS: lengths lognormal "
                        "like real RL's, from a supervised warm start, credit for each token that follows the two "
                        "before)")
    p.add_argument("--count-step", type=number(int, at_least=1, at_most=tasks.MAX_COUNT_STEP), default=DATA.count_step,
                   help="--task count counts in steps of this many mod 10 (2: 'count:7' -> '9135...'); a policy "
                        "trained on one step and then on another is a policy that moves away from its MTP draft")
    p.add_argument("--data", default=None,
                   help="examples, .jsonl or .parquet: {prompt, answer} rows, or verl's layout (prompt as chat "
                        "messages, answer under reward_model.ground_truth); default: the built-in --task")
    p.add_argument("--prompt-key", default=DATA.prompt_key,
                   help="--data field holding the prompt (a string or a list of {role, content} chat messages); "
                        "a dotted path reaches into nested fields")
    p.add_argument("--answer-key", default=None,
                   help="--data field holding the answer, a dotted path reaches into nested fields; default: "
                        + " or ".join(tasks.DEFAULT_ANSWER_KEYS))
    p.add_argument("--eval-data", default=None,
                   help="held-out examples in --data's formats and keys; default: the built-in task's held-out "
                        f"prompts, or with --data a fixed {tasks.EVAL_HOLDOUT_FRACTION:.0%}% of it (at most "
                        f"{tasks.EVAL_HOLDOUT_MAX}) that training never samples")
    p.add_argument("--eval-every", type=POSITIVE_INT, default=25,
                   help="greedy accuracy and mean reward on the held-out set every N steps (and after the last)")
    p.add_argument("--reward", default=None, metavar="FILE.py:FUNCTION|math",
                   help="your reward: FUNCTION(prompt: str, response: str, answer: str) -> float or a list of "
                        "per-token floats; or math: the final answer (GSM8K's '#### 72', \\boxed{}, fractions, "
                        "LaTeX) checked against the answer's with math-verify; default: per-character credit "
                        "(built-in task), exact match (--data)")
    p.add_argument("--reward-timeout", type=NON_NEGATIVE, default=DATA.reward_timeout,
                   help="seconds a --reward FILE.py:FUNCTION call may take before the run stops, with a checkpoint "
                        "of the last completed step, naming the prompt (0: no limit)")


def add_output_flags(p):
    p.add_argument("--out", default=preflight.DEFAULT_OUT,
                   help="metrics.jsonl, curves.png, tensorboard/ event files, checkpoints, final HF dir")
    p.add_argument("--tensorboard", action=argparse.BooleanOptionalAction, default=True,
                   help="also write every metric to TensorBoard event files under OUT/tensorboard")
    p.add_argument("--wandb-project", default=None,
                   help="also log every metric to Weights & Biases under this project (WANDB_MODE=offline keeps it "
                        "on disk)")
    p.add_argument("--verbose", action="store_true",
                   help="show vLLM's INFO logs and periodic engine statistics, and the stack's known-harmless "
                        "warnings (hidden by default)")
    p.add_argument("--resume", default="auto",
                   help="auto: continue from the newest complete checkpoint in OUT/checkpoints if there is one, "
                        "else start fresh (so torchrun --max-restarts survives a killed worker); never: start fresh "
                        "(refused if OUT holds checkpoints); afresh: start fresh where every checkpoint in OUT failed "
                        "verification (they are set aside as step_N.corrupt); or a checkpoint dir (OUT/checkpoints/"
                        "step_N, or a run's OUT/checkpoints for its newest)")
    p.add_argument("--resume-with-changed-inputs", action="store_true",
                   help="resume although --data, --eval-data or the --reward file differ in content from what the "
                        "checkpoint's run read (refused by default: the data a run trains on, and its held-out set, "
                        "would change mid-run)")
    p.add_argument("--save-every", type=POSITIVE_INT, default=50, help="checkpoint every N steps (and at the end)")
    p.add_argument("--keep-checkpoints", type=POSITIVE_INT, default=2,
                   help="how many of the newest checkpoints to keep")


def add_layout_flags(p):
    p.add_argument("--steps", type=POSITIVE_INT, default=None,
                   help="training steps (one rollout batch each); default: the task's (" + ", ".join(
                       f"{task} {spec['steps']}" for task, spec in tasks.TASKS.items()) + f"), or with --data {tasks.DATA_STEPS}")
    p.add_argument("--seed", type=int, default=ROLLOUT.seed, help="seed of data, init and sampling")
    p.add_argument("--tp", type=POSITIVE_INT, default=TRAIN.tp, help="Megatron tensor parallel size")
    p.add_argument("--cp", type=POSITIVE_INT, default=TRAIN.cp, help="Megatron context parallel size")
    p.add_argument("--ep", type=POSITIVE_INT, default=TRAIN.ep,
                   help="Megatron expert parallel size: an MoE model's routed experts split over this many "
                        "data-parallel ranks (1: every rank holds every expert)")
    p.add_argument("--pp", type=POSITIVE_INT, default=TRAIN.pp,
                   help="Megatron pipeline parallel size: the decoder layers split evenly over this many stages, the "
                        "MTP layers on the last (megatron-core's 1F1B schedule over the micro-batches; set "
                        "--micro-batches to at least --pp to keep every stage busy)")
    p.add_argument("--routing-replay", action=argparse.BooleanOptionalAction, default=None,
                   help="MoE models: Megatron's routers use the experts vLLM routed each token to in the rollout "
                        "(rollout routing replay, R3); off, the share of tokens routed alike is logged as "
                        "routing_agreement (default: on for an MoE model without --pp; it costs no measurable time)")
    p.add_argument("--distributed-optimizer", action=argparse.BooleanOptionalAction, default=None,
                   help="megatron-core's distributed optimizer (ZeRO-1): each data-parallel rank holds 1/DP of the "
                        "fp32 main weights and Adam states (experts: 1/DP of their own data-parallel group) "
                        "(default: on where data-parallel size > 1 and it saves at least "
                        f"{memory_plan.DISTRIBUTED_OPTIMIZER_MIN_SAVING / 2**30:g} GiB of the device's peak in --plan)")
    p.add_argument("--rollout-tp", type=POSITIVE_INT, default=ROLLOUT.rollout_tp, help="vLLM tensor parallel size")
    p.add_argument("--prompts-per-step", type=POSITIVE_INT, default=None,
                   help="prompts per data-parallel rank per step; default: the task's (" + ", ".join(
                       f"{task} {spec['prompts_per_step']}" for task, spec in tasks.TASKS.items())
                   + f"), or with --data {tasks.DATA_PROMPTS_PER_STEP}")
    p.add_argument("--group-size", type=number(int, at_least=2, why=" (GRPO baselines each completion against the "
                                                                  "others of its prompt)"), default=REWARD.group_size,
                   help="completions per prompt (the GRPO group)")
    p.add_argument("--max-new-tokens", type=POSITIVE_INT, default=None,
                   help="response length limit (a built-in task always samples exactly this many); default: the "
                        "built-in task's answer length, " + ", ".join(f"{task} {spec['length']}"
                                                                      for task, spec in tasks.TASKS.items())
                        + ", or with --data " + str(tasks.DATA_MAX_NEW_TOKENS))
    p.add_argument("--temperature", type=number(float, above=0, why=" (greedy decoding would give every completion "
                                                                     "of a group the same answer)"),
                   default=TRAIN.temperature, help="rollout sampling temperature (> 0)")
    p.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=None,
                   help="bf16 weights and rollout (default: on with CUDA, off on CPU)")
    p.add_argument("--gpu-memory-utilization", type=number(float, above=0, at_most=1),
                   default=ROLLOUT.gpu_memory_utilization,
                   help="vLLM's share of GPU memory")
    p.add_argument("--kv-cache-bytes", type=POSITIVE_INT, default=None,
                   help="vLLM KV cache size on CPU (default: one rollout's batch whole, each sequence at the longest "
                        f"prompt plus its new and drafted tokens, at most {ROLLOUT.kv_cache_bytes} bytes unless one "
                        "context needs more)")


def byte_size(text):
    """--device-memory: '80GB', '141GB', '96GiB' -> bytes (memory_plan.parse_bytes)."""
    try:
        return memory_plan.parse_bytes(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def add_plan_flags(p):
    p.add_argument("--plan", action="store_true",
                   help="print the memory plan per device for the model and the layout flags (weights, gradients, "
                        "optimizer states, activations, vLLM's weights and KV cache), whether it fits "
                        "--device-memory and what to change if not, then exit: no process group, no model built")
    p.add_argument("--device-memory", type=byte_size, default=None,
                   help="--plan: one device's memory, e.g. 80GB (H100), 141GB (H200), 96GiB; without it the plan "
                        "gives no verdict")
    p.add_argument("--plan-world-size", type=POSITIVE_INT, default=None,
                   help="--plan: the processes the run would have (nodes x devices per node); default: torchrun's "
                        "WORLD_SIZE, else 1")


def add_loss_flags(p):
    p.add_argument("--lr", type=POSITIVE, default=None,
                   help="Adam learning rate; default: the built-in task's, " + ", ".join(
                       f"{task} {spec['lr']:g}" for task, spec in tasks.TASKS.items()) + f", or with --data {tasks.DATA_LR:g}")
    p.add_argument("--shared-prefix", action=argparse.BooleanOptionalAction, default=None,
                   help="train on each group's prompt once, its completions attending to it (the same loss and "
                        "gradients on fewer tokens; default: on where the attention runs it: cp 1 without "
                        "Transformer Engine)")
    p.add_argument("--micro-batches", type=POSITIVE_INT, default=TRAIN.micro_batches,
                   help="gradient accumulation micro-batches per optimizer step (per mini-batch)")
    p.add_argument("--max-tokens-per-micro-batch", type=COUNT, default=TRAIN.max_tokens_per_micro_batch,
                   help="fill each micro-batch with sequences up to this many tokens (prompt + response; a longer "
                        "sequence gets a micro-batch of its own) instead of counting them, the batch split over "
                        "data-parallel ranks so each holds about as many tokens, every rank running as many "
                        "micro-batches; the loss is the same (0: off, --micro-batches counts them)")
    p.add_argument("--mini-batches", type=POSITIVE_INT, default=TRAIN.mini_batches,
                   help="optimizer steps per pass over the rollout batch; > 1 (or --ppo-epochs > 1) makes the PPO "
                        "ratio move and the clip act")
    p.add_argument("--ppo-epochs", type=POSITIVE_INT, default=TRAIN.ppo_epochs, help="passes over each rollout batch")
    p.add_argument("--grad-clip", type=POSITIVE, default=TRAIN.grad_clip, help="global gradient-norm clip")
    p.add_argument("--advantage", choices=grpo_loss.ADVANTAGE_MODES, default=REWARD.advantage,
                   help="group baseline: mean/std (GRPO), mean only (Dr. GRPO), leave-one-out mean")
    p.add_argument("--loss-agg", choices=grpo_loss.LOSS_AGGREGATIONS, default=LOSS.loss_agg,
                   help="how per-token losses are averaged")
    p.add_argument("--clip-low", type=number(float, at_least=0, below=1), default=LOSS.clip_low,
                   help="PPO ratio clip below 1")
    p.add_argument("--clip-high", type=NON_NEGATIVE, default=LOSS.clip_high, help="PPO ratio clip above 1")
    p.add_argument("--dual-clip", type=number(float, above=1, why=" (it bounds the loss of negative advantages from "
                                                                   "below at dual-clip x advantage)"),
                   default=LOSS.dual_clip,
                   help="dual-clip bound for negative advantages (> 1)")
    p.add_argument("--loss", choices=grpo_loss.POLICY_LOSSES, default=LOSS.loss,
                   help="policy loss: ppo (token ratio, clipped), gspo (the sequence's ratio, geometric mean of its "
                        "tokens', clipped per sequence; no dual clip; pair with --loss-agg seq-mean-token-mean), "
                        "cispo (REINFORCE on every token, weighted by the stop-gradient ratio capped at "
                        "1 + --clip-high)")
    p.add_argument("--tis-cap", type=NON_NEGATIVE, default=LOSS.tis_cap,
                   help="truncated importance sampling: weight min(p_megatron / p_vllm, cap); 0 disables")
    p.add_argument("--rollout-mask", choices=grpo_loss.ROLLOUT_MASK_LEVELS, default=LOSS.rollout_mask,
                   help="masked importance sampling against vLLM: drop the policy loss of tokens (token) or whole "
                        "sequences (sequence: the geometric mean of their tokens') whose p_megatron / p_vllm leaves "
                        "[--rollout-mask-low, --rollout-mask-high]")
    p.add_argument("--rollout-mask-low", type=POSITIVE, default=LOSS.rollout_mask_low,
                   help="--rollout-mask's lower bound on the ratio")
    p.add_argument("--rollout-mask-high", type=POSITIVE, default=LOSS.rollout_mask_high,
                   help="--rollout-mask's upper bound on the ratio")
    p.add_argument("--kl-coef", type=NON_NEGATIVE, default=LOSS.kl_coef,
                   help="k3 KL to the initial policy (0: no reference model)")
    p.add_argument("--entropy-coef", type=NON_NEGATIVE, default=LOSS.entropy_coef,
                   help="entropy bonus (keeps a random-init policy from collapsing onto one answer)")


def add_sampling_flags(p):
    p.add_argument("--dynamic-sampling", action="store_true", default=REWARD.dynamic_sampling,
                   help="DAPO's dynamic sampling: drop the groups whose rewards are all equal (no advantage) and "
                        "roll out more prompts until the batch is full of informative groups, at most "
                        "--max-sampling-rounds rollouts per step (then the dropped groups fill it)")
    p.add_argument("--max-sampling-rounds", type=POSITIVE_INT, default=None,
                   help=f"--dynamic-sampling: rollouts per step at most (default {DEFAULT_SAMPLING_ROUNDS})")
    p.add_argument("--overlong-filter", action="store_true", default=REWARD.overlong_filter,
                   help="truncated completions (no end-of-sequence token within --max-new-tokens) stay out of the "
                        "loss (--data only: the built-in tasks always sample --max-new-tokens)")
    p.add_argument("--overlong-buffer", type=COUNT, default=REWARD.overlong_buffer,
                   help="DAPO's soft overlong punishment: the reward falls linearly by up to --overlong-penalty over "
                        "the last N tokens before --max-new-tokens (0: off; --data only)")
    p.add_argument("--overlong-penalty", type=NON_NEGATIVE, default=REWARD.overlong_penalty,
                   help="the reward taken from a completion of --max-new-tokens tokens under --overlong-buffer")


def add_mtp_flags(p):
    p.add_argument("--mtp-train", action=argparse.BooleanOptionalAction, default=TRAIN.mtp_train,
                   help="train the MTP head (its loss rides on the policy's backward pass)")
    p.add_argument("--mtp-rollout", action=argparse.BooleanOptionalAction, default=None,
                   help="draft with the MTP head in vLLM (speculative decoding); default: on when the model "
                        "has MTP layers")
    p.add_argument("--mtp-loss-scale", type=NON_NEGATIVE, default=TRAIN.mtp_loss_scale,
                   help=f"multiplies megatron's MTP loss weight: the MTP loss enters the gradient with weight "
                        f"{DEFAULT_MTP_LOSS_SCALING_FACTOR} x this / MTP layers")
    p.add_argument("--mtp-target", choices=forward.MTP_TARGET_MODES, default=TRAIN.mtp_target,
                   help="what the MTP head learns at each position: sampled, the token drawn there (cross entropy), "
                        "or policy, the policy's own next-token distribution at --temperature, detached (soft cross "
                        "entropy; one more output-layer pass per forward)")
    p.add_argument("--mtp-loss", choices=forward.POLICY_TARGET_LOSSES, default=TRAIN.mtp_loss,
                   help="--mtp-target policy: the MTP head's loss against the policy's distribution: ce, the soft "
                        "cross entropy, or tv, the total variation 1 - sum_v min(p, q), one minus the chance that a "
                        "draft sampled from the head is accepted, so it maximises the acceptance directly (plus a "
                        "small cross entropy, which steers a head far from the policy)")
    p.add_argument("--mtp-train-depths", type=POSITIVE_INT, default=TRAIN.mtp_train_depths,
                   help="MTP depths the head trains: past the model's MTP layers they run again in turn on their own "
                        "outputs, as vLLM drafts more tokens than the model has MTP layers (depth d learns token t + d "
                        "+ 1 from the depth before's output); a multiple of the MTP layers; default: one depth per "
                        "MTP layer")
    p.add_argument("--num-speculative-tokens", type=draft_tokens_flag, default="auto",
                   help="MTP draft tokens per verify step, or auto: per band of batch sizes the k in "
                        "0..--max-speculative-tokens (0: no drafting) a cost model says runs fastest: every "
                        "--tune-every steps, and when the acceptance rose far, the next rollouts try in turn k = 0, "
                        "k = 1, the deepest k that could pay and the plain engine, which give each band's cost of "
                        "drafting; the acceptance the engine measures then sets each band's k")
    p.add_argument("--max-speculative-tokens", type=number(int, at_least=1, at_most=MAX_DRAFT_TOKENS, why=PAST_MAX_DRAFT),
                   default=None, help="the deepest k auto considers; default: the built-in task's ("
                   + ", ".join(f"{task} {spec['max_draft_tokens']}" for task, spec in tasks.TASKS.items()
                               if spec["max_draft_tokens"]) + f"), else {ROLLOUT.draft_tokens}")
    p.add_argument("--tune-every", type=POSITIVE_INT, default=ROLLOUT.tune_every,
                   help="auto: every N steps (and at the first) the rollouts try k = 0, k = 1, the deepest k that "
                        "could pay and the plain engine again, in turns, on the current weights")
    p.add_argument("--acceptance-check-every", type=POSITIVE_INT, default=ROLLOUT.acceptance_check_every,
                   help="auto, while no rollout drafts and the trainer estimates no acceptance (--mtp-target sampled): "
                        "every N steps measure the draft's acceptance at every depth on "
                        f"{draft_tuner.ACCEPTANCE_CHECK_PROMPTS} of the step's prompts per engine")
    p.add_argument("--check-draft-every", type=COUNT, default=ROLLOUT.check_draft_every,
                   help="every N weight pushes, check that vLLM's MTP draft holds exactly Megatron's MTP weights and "
                        "stop naming the tensor when not (0: never)")
    p.add_argument("--spec-config", default=None,
                   help="JSON object merged into vLLM's speculative_config (drafts are sampled from the head "
                        "unless it sets draft_sample_method)")


def build_parser():
    p = _ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for add_flags in (add_data_flags, add_output_flags, add_layout_flags, add_loss_flags, add_sampling_flags,
                      add_mtp_flags, add_plan_flags):
        add_flags(p)
    return p


def parse_args(argv=None):
    """The flags as given, the task's steps and prompts per step where not given (None where
    a default is derived from the model: see `resolve`)."""
    args = build_parser().parse_args(argv)
    for name, data_default in (("steps", tasks.DATA_STEPS), ("prompts_per_step", tasks.DATA_PROMPTS_PER_STEP)):
        if getattr(args, name) is None:
            setattr(args, name, data_default if args.data else tasks.TASKS[args.task][name])
    return args


def resolve(args, hf_config, world_size=1):
    """The run's settings: a new Namespace with what is derived filled in (max_new_tokens,
    ignore_eos, lr, mtp_rollout, mtp_train, routing_replay, bf16, max_sampling_rounds,
    shared_prefix, `mtp_train_depths`, max_speculative_tokens, distributed_optimizer
    (run_configs.distributed_optimizer_pays),
    the built-in model's name, `draft_plan`'s auto_draft and draft_tokens); `args` is untouched."""
    has_mtp = hf_config.get("num_nextn_predict_layers", 0) > 0
    mtp_rollout = has_mtp if args.mtp_rollout is None else args.mtp_rollout
    auto_draft, draft_tokens = flag_checks.draft_plan(args, mtp_rollout)
    derived = {
        "max_new_tokens": args.max_new_tokens if args.max_new_tokens is not None else (
            tasks.DATA_MAX_NEW_TOKENS if args.data else tasks.TASKS[args.task]["length"]),
        # A built-in task without EOS samples exactly max_new_tokens; data and walk end at EOS.
        "ignore_eos": args.data is None and not tasks.TASKS[args.task]["eos"],
        "lr": args.lr if args.lr is not None else tasks.DATA_LR if args.data else tasks.TASKS[args.task]["lr"],
        "mtp_rollout": mtp_rollout, "auto_draft": auto_draft, "draft_tokens": draft_tokens,
        "mtp_train": args.mtp_train and has_mtp,
        "routing_replay": ("n_routed_experts" in hf_config and args.pp == 1) if args.routing_replay is None
        else args.routing_replay,
        "bf16": torch.cuda.is_available() if args.bf16 is None else args.bf16,
        "builtin_model": None if args.model else flag_checks.builtin_model(args)[0],
        "max_positions": hf_config.get("max_position_embeddings", DEFAULT_MAX_POSITIONS),
        "max_sampling_rounds": (args.max_sampling_rounds or DEFAULT_SAMPLING_ROUNDS) if args.dynamic_sampling else 1,
        "shared_prefix": (flag_checks.shared_prefix_obstacle(args, hf_config) is None if args.shared_prefix is None
                          else args.shared_prefix),
        "mtp_train_depths": mtp_train_depths(args, hf_config),
        # The task's default filled in: a resume compares the deepest k auto ran with.
        "max_speculative_tokens": flag_checks.deepest_draft(args),
    }
    settings = argparse.Namespace(**{**vars(args), **derived})
    if args.distributed_optimizer is None:
        settings.distributed_optimizer = run_configs.distributed_optimizer_pays(settings, hf_config, world_size)
    return settings


def mtp_train_depths(args, hf_config):
    """--mtp-train-depths, else the built-in task's (tasks.TASKS) where the model's MTP layers
    divide it and one stage holds them, else None: one depth per MTP layer."""
    if args.mtp_train_depths is not None:
        return args.mtp_train_depths
    layers = mtp_layer_count(hf_config)
    depths = None if args.data else tasks.TASKS[args.task]["mtp_train_depths"]
    return depths if depths and layers and depths % layers == 0 and args.pp == 1 else None


def check_args(args, world_size):
    """Raise `usage_error` listing every problem with the flags; return the resolved settings."""
    problems = flag_checks.flag_problems(args, world_size)
    if problems:
        raise usage_error("\n  ".join(["bad flags:"] + problems))
    return resolve(args, flag_checks.model_config(args), world_size)


# ---------------------------------------------------------------------------------------
# The rollout's context, once the prompts are tokenized
# ---------------------------------------------------------------------------------------

def rollout_context(settings, hf_config, longest_prompt):
    """The settings with the engines' max_model_len and engine_kv_cache_bytes: the longest
    prompt (in tokens) plus the most tokens a request generates (--max-new-tokens; auto's
    acceptance check) plus the draft tokens of the last verify step, at least
    rollout.MIN_MODEL_LEN, capped by the model's max_position_embeddings. A published 128k
    context would ask for KV cache the run never uses. On CPU, where --kv-cache-bytes sizes
    the cache, a context that does not fit it is a `usage_error` (train_grpo asks once the
    tokenizer loads, before any model). Without --kv-cache-bytes the cache holds one
    rollout's batch, each sequence in whole blocks (at most the 256 MiB default of
    RolloutConfig unless one context needs more): vLLM writes every page of its cache, so a
    larger one is resident memory no rollout uses."""
    generated = max(settings.max_new_tokens, draft_tuner.ACCEPTANCE_CHECK_TOKENS if settings.auto_draft else 0)
    drafts = settings.draft_tokens if settings.mtp_rollout else 0
    max_model_len = min(max(longest_prompt + generated + drafts, rollout.MIN_MODEL_LEN), settings.max_positions)
    plan = memory_plan.PlanConfig(rollout_tp=settings.rollout_tp, bf16=settings.bf16)
    needed = memory_plan.kv_cache_bytes(hf_config, plan, settings.mtp_rollout, max_model_len)
    kv_cache_bytes = settings.kv_cache_bytes
    if kv_cache_bytes is None:
        # The rollout's completions and the probe riding along (rollout.probe_params): one
        # block fewer queues a request, and the batch then samples other tokens.
        sequences = settings.prompts_per_step * settings.group_size * settings.rollout_tp + 1
        batch = memory_plan.kv_cache_bytes(hf_config, plan, settings.mtp_rollout, longest_prompt + generated + drafts,
                                           sequences)
        kv_cache_bytes = max(needed, min(batch, ROLLOUT.kv_cache_bytes))
    elif not torch.cuda.is_available() and needed > kv_cache_bytes:
        per_token = memory_plan.kv_bytes_per_token(hf_config, plan, settings.mtp_rollout)
        raise usage_error(f"--kv-cache-bytes {settings.kv_cache_bytes}: the rollout's context of {max_model_len} "
                          f"tokens (the longest prompt, {longest_prompt}, plus {generated} generated and {drafts} "
                          f"drafted) needs {needed} bytes of KV cache ({per_token} per token); expected "
                          f"--kv-cache-bytes {needed} or more, or shorter prompts or --max-new-tokens")
    return argparse.Namespace(**{**vars(settings), "max_model_len": max_model_len,
                                 "engine_kv_cache_bytes": kv_cache_bytes})
