"""vLLM speculative-decoding config for MTP drafting, and draft acceptance statistics.

Rollout with the model's own multi-token-prediction (MTP) head as the speculative draft
is only worth it while drafts get accepted, so every rollout should report the
acceptance rate. Three things live here:

    from spec_config import build_mtp_speculative_config, SpecDecodeMeter
    llm = LLM(model=path, disable_log_stats=False,
              speculative_config=build_mtp_speculative_config(num_speculative_tokens=1,
                                                              engine_speculative_config=user_json))
    meter = SpecDecodeMeter(llm)
    outputs = llm.generate(prompts, sampling_params)
    stats = meter.read(outputs)     # dict of acceptance statistics, or None: never raises

`build_mtp_speculative_config` merges the user's extra speculative options (a mapping or
a JSON string) over the MTP defaults and checks the result before an engine is built.
`SpecDecodeMeter` reads acceptance statistics from whichever source this vLLM offers;
a missing statistic logs one warning per process and never ends a training run.
`fix_cpu_draft_sampling()` repairs vLLM-CPU's sampling of drafted tokens at temperature
> 0 (call it before `LLM(...)` in the process that runs the engine).

Imports only the standard library and torch at module level; vLLM is imported only inside
`fix_cpu_draft_sampling` (the meter only calls methods on the objects vLLM hands it), so
the config merge works without vLLM installed.
"""

import functools
import importlib.metadata
import json
import logging
import math
import re
import time
from collections.abc import Mapping

import torch

logger = logging.getLogger(__name__)

# vLLM 0.11 unified the per-model MTP method names ("deepseek_mtp", "mimo_mtp", ...)
# into method="mtp"; 0.10.2 rejects "mtp".
FIRST_VLLM_WITH_MTP_METHOD = (0, 11)

# Engine-wide cumulative counters in `LLM.get_metrics()` (Counter objects with `.value`;
# the per-position one is a Vector with `.values`, one entry per draft position).
NUM_DRAFTS_COUNTER = "vllm:spec_decode_num_drafts"
NUM_DRAFT_TOKENS_COUNTER = "vllm:spec_decode_num_draft_tokens"
NUM_ACCEPTED_TOKENS_COUNTER = "vllm:spec_decode_num_accepted_tokens"
ACCEPTED_PER_POSITION_VECTOR = "vllm:spec_decode_num_accepted_tokens_per_pos"

ENABLE_STATISTICS_HINT = (
    "build the LLM with a speculative_config and disable_log_stats=False (engine-wide "
    "counters), or on vLLM >= 0.29 with per_request_spec_decode_metrics='summary' "
    "(exact per-request counts)")


@functools.cache
def installed_vllm_version():
    """The installed vLLM release string (e.g. '0.32.0'), or None when vLLM is absent.

    Read from package metadata, not by importing vLLM (which takes seconds); the CPU
    build is distributed as `vllm-cpu`, so look the distribution up by its import name
    (a scan of all installed packages: cached).
    """
    distributions = importlib.metadata.packages_distributions().get("vllm")
    return importlib.metadata.version(distributions[0]) if distributions else None


def _parse_overrides(engine_speculative_config):
    if engine_speculative_config is None:
        return {}
    if isinstance(engine_speculative_config, str):
        try:
            parsed = json.loads(engine_speculative_config)
        except json.JSONDecodeError as error:
            raise ValueError(f"engine_speculative_config is not valid JSON: {engine_speculative_config!r} "
                             f"({error})") from error
        if not isinstance(parsed, dict):
            raise TypeError(f"engine_speculative_config must be a JSON object, got a JSON "
                            f"{type(parsed).__name__}: {engine_speculative_config!r}")
        return parsed
    if isinstance(engine_speculative_config, Mapping):
        return engine_speculative_config
    raise TypeError(f"engine_speculative_config must be None, a mapping or a JSON object string, got "
                    f"{type(engine_speculative_config).__name__}: {engine_speculative_config!r}")


def _check_vllm_supports_mtp_method(version):
    if version is None:
        return
    release = re.match(r"(\d+)\.(\d+)", version)
    if release and (int(release[1]), int(release[2])) < FIRST_VLLM_WITH_MTP_METHOD:
        needed = ".".join(map(str, FIRST_VLLM_WITH_MTP_METHOD))
        raise RuntimeError(f"speculative method 'mtp' needs vLLM >= {needed}, but vLLM {version} is installed: "
                           f"upgrade vLLM, or pass the per-model method name this release knows "
                           f"(e.g. method='deepseek_mtp')")


def build_mtp_speculative_config(method="mtp", num_speculative_tokens=1, engine_speculative_config=None):
    """vLLM's `speculative_config` dict for MTP drafting, with the user's overrides applied.

    Returns `{"method": method, "num_speculative_tokens": num_speculative_tokens, **overrides}`
    as a new dict. `engine_speculative_config` holds the user's extra options: None, a
    mapping, or a JSON object string (as it arrives from a command line); its keys win
    over the two defaults, and keys whose value is None are dropped (so they leave the
    default in place). The caller's mapping is never mutated.

    Raises TypeError for overrides of any other type (a list, a number, a JSON array),
    ValueError for text that is not JSON, a `num_speculative_tokens` that is not an
    int >= 1, or a `method` that is not a non-empty string, and RuntimeError when the
    installed vLLM predates method="mtp" (0.11).
    """
    overrides = _parse_overrides(engine_speculative_config)
    config = {"method": method, "num_speculative_tokens": num_speculative_tokens}
    config.update({key: value for key, value in overrides.items() if value is not None})
    tokens = config["num_speculative_tokens"]
    # bool is an int subclass: True would silently mean one token.
    if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 1:
        raise ValueError(f"num_speculative_tokens must be an int >= 1, got {tokens!r}")
    if not isinstance(config["method"], str) or not config["method"]:
        raise ValueError(f"method must be a non-empty string such as 'mtp', got {config['method']!r}")
    if config["method"] == "mtp":
        _check_vllm_supports_mtp_method(installed_vllm_version())
    return config


_warned_kinds = set()


def _warn_once(kind, message):
    # Rollouts call `read` every step: one warning per process is enough to be seen.
    if kind not in _warned_kinds:
        _warned_kinds.add(kind)
        logger.warning(message)


def acceptance_statistics(source, num_drafts, num_draft_tokens, num_accepted_tokens, accepted_per_position):
    """The statistics dict `SpecDecodeMeter.read` returns, from counts (ints; accepted_per_position
    a list of ints, one per draft position)."""
    return {
        "source": source,
        "num_drafts": num_drafts,
        "num_draft_tokens": num_draft_tokens,
        "num_accepted_tokens": num_accepted_tokens,
        # vLLM's own conventions for an empty window: rate 0, length 1 (the bonus token).
        "acceptance_rate": num_accepted_tokens / num_draft_tokens if num_draft_tokens else 0.0,
        "mean_acceptance_length": 1.0 + num_accepted_tokens / num_drafts if num_drafts else 1.0,
        "accepted_per_position": accepted_per_position,
    }


def _add_elementwise(total, values):
    width = max(len(total), len(values))
    return [(total[i] if i < len(total) else 0) + (values[i] if i < len(values) else 0) for i in range(width)]


def _from_completion_metrics(completions):
    # vLLM >= 0.29: `RequestSpecDecodeMetrics` per finished sequence. histogram[j] counts
    # the verify steps that accepted exactly j drafted tokens, and acceptance stops at
    # the first rejection, so position i was accepted in every step with j > i.
    num_drafts = num_draft_tokens = num_accepted = 0
    per_position = []
    for completion in completions:
        histogram = completion.spec_decode_metrics.histogram
        num_drafts += sum(histogram)
        num_draft_tokens += completion.spec_decode_metrics.num_draft_tokens
        num_accepted += sum(j * count for j, count in enumerate(histogram))
        per_position = _add_elementwise(per_position, [sum(histogram[i + 1:]) for i in range(len(histogram) - 1)])
    return acceptance_statistics("per_request", num_drafts, num_draft_tokens, num_accepted, per_position)


def _from_request_metrics(request_stats):
    # Forks that predate per-request metrics attach a `SpecDecodingStats`-shaped record
    # (vLLM's per-step scheduler statistics, restricted to one request) to
    # `RequestOutput.metrics.request_spec_decode_stats`.
    num_drafts = num_draft_tokens = num_accepted = 0
    per_position = []
    for stats in request_stats:
        num_drafts += stats.num_drafts
        num_draft_tokens += stats.num_draft_tokens
        num_accepted += stats.num_accepted_tokens
        per_position = _add_elementwise(per_position, list(stats.num_accepted_tokens_per_pos))
    return acceptance_statistics("request_metrics", num_drafts, num_draft_tokens, num_accepted, per_position)


def _engine_counters(llm):
    """Cumulative engine-wide spec-decode counters as a dict, or None when this engine has none."""
    get_metrics = getattr(llm, "get_metrics", None)
    if get_metrics is None:
        return None
    try:
        metrics = get_metrics()
    except AssertionError:
        # vLLM asserts "Stat logging disabled" when built with disable_log_stats=True.
        return None
    keys = {NUM_DRAFTS_COUNTER: "num_drafts", NUM_DRAFT_TOKENS_COUNTER: "num_draft_tokens",
            NUM_ACCEPTED_TOKENS_COUNTER: "num_accepted_tokens"}
    counters = dict.fromkeys(keys.values(), 0)
    counters["accepted_per_position"] = []
    found = False
    # Summed over label sets: a data-parallel engine reports one series per engine index.
    for metric in metrics:
        if metric.name in keys:
            counters[keys[metric.name]] += metric.value
            found = True
        elif metric.name == ACCEPTED_PER_POSITION_VECTOR:
            counters["accepted_per_position"] = _add_elementwise(counters["accepted_per_position"],
                                                                 list(metric.values))
    return counters if found else None


def _from_counter_difference(now, before):
    negated_before = [-count for count in before["accepted_per_position"]]
    return acceptance_statistics("engine_counters", now["num_drafts"] - before["num_drafts"],
                       now["num_draft_tokens"] - before["num_draft_tokens"],
                       now["num_accepted_tokens"] - before["num_accepted_tokens"],
                       _add_elementwise(now["accepted_per_position"], negated_before))


class SpecDecodeMeter:
    """Draft acceptance statistics of the requests an `LLM` generated since the last read.

    `read(outputs)` takes the list of `RequestOutput` that `llm.generate` returned and
    gives a dict: `num_drafts` (verify steps that had drafted tokens), `num_draft_tokens`,
    `num_accepted_tokens` (ints), `acceptance_rate` (accepted / drafted, float in [0, 1]),
    `mean_acceptance_length` (tokens emitted per verify step, bonus token included,
    float >= 1), `accepted_per_position` (list of ints, one per draft position), and
    `source`, the first of these that exists:

      "per_request"      `CompletionOutput.spec_decode_metrics` on every output (vLLM >= 0.29
                         with `per_request_spec_decode_metrics` on): exactly these outputs;
      "request_metrics"  `RequestOutput.metrics.request_spec_decode_stats` (older forks);
      "engine_counters"  `llm.get_metrics()` counters minus their values at the previous
                         read (or at construction): everything the engine decoded in between,
                         including requests from other callers.

    With no source it logs one warning per process saying how to enable statistics, and
    returns None. It never raises: statistics must not end a rollout.
    """

    def __init__(self, llm):
        self.llm = llm
        self._previous_counters = self._safe_engine_counters()

    def _safe_engine_counters(self):
        try:
            return _engine_counters(self.llm)
        except Exception as error:
            _warn_once("counters", f"could not read vLLM's speculative-decoding counters: {error!r}")
            return None

    def read(self, outputs):
        """Acceptance statistics for `outputs` (list of vLLM `RequestOutput`); dict or None."""
        # Snapshot the counters on every read, whichever source answers, so that the
        # engine-counter window always starts where the previous read ended.
        counters = self._safe_engine_counters()
        previous, self._previous_counters = self._previous_counters, counters
        try:
            completions = [completion for output in outputs for completion in output.outputs]
            if completions and all(getattr(c, "spec_decode_metrics", None) is not None for c in completions):
                return _from_completion_metrics(completions)
            request_stats = [getattr(getattr(output, "metrics", None), "request_spec_decode_stats", None)
                             for output in outputs]
            if request_stats and all(stats is not None for stats in request_stats):
                return _from_request_metrics(request_stats)
        except Exception as error:
            _warn_once("outputs", f"could not read speculative-decoding statistics from the request outputs: "
                                  f"{error!r}; falling back to engine counters")
        if counters is not None and previous is not None:
            return _from_counter_difference(counters, previous)
        _warn_once("no_source", f"no speculative-decoding statistics from this vLLM engine; to see the draft "
                                f"acceptance rate, {ENABLE_STATISTICS_HINT}")
        return None


def _expand_batch_to_tokens(x, cu_num_tokens, num_tokens, replace_from=0, replace_to=0):
    """vLLM's `expand_batch_to_tokens` in plain torch: x [B] repeated per request's token
    count (cu_num_tokens [B], cumulative) into [num_tokens], replace_from -> replace_to."""
    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1, dtype=torch.long))
    expanded = torch.repeat_interleave(x, counts, output_size=num_tokens)
    return torch.where(expanded == replace_from, torch.full_like(expanded, replace_to), expanded)


def fix_cpu_draft_sampling():
    """Make vLLM-CPU sample drafted tokens from the right distribution; returns True when patched.

    The rejection sampler scales the drafted positions' logits by each request's
    temperature, expanded per token by `expand_batch_to_tokens`. vLLM-CPU (0.32 at least)
    runs that expansion through a C++ fallback that writes into an int64 copy of the
    float output and drops it: the logits are divided by uninitialised memory, so samples
    at temperature > 0 are garbage (NaN log-probs, near-zero draft acceptance, reward
    collapse in RL) while greedy decoding is fine. This replaces the expansion with plain
    torch on the CPU platform. It patches this process: the engine core must run here
    (`distributed_executor_backend="external_launcher"`, or
    `VLLM_ENABLE_V1_MULTIPROCESSING=0`). Idempotent; a no-op on other platforms.
    """
    from vllm.platforms import current_platform
    from vllm.v1.sample import rejection_sampler
    if not current_platform.is_cpu():
        return False
    rejection_sampler.expand_batch_to_tokens = _expand_batch_to_tokens
    return True


# ---------------------------------------------------------------------------------------
# How many tokens to draft: chosen from what this engine measures
# ---------------------------------------------------------------------------------------
# Drafting pays when the target is deep next to its draft and the batch is small; at high
# concurrency verifying drafts costs as much as it saves, and a draft the policy has moved
# away from only costs. So the number of draft tokens k (0 = no drafting) is measured, not
# assumed. A rollout of T new tokens per sequence with k drafts takes
#
#     a_k + (T - 1) / (1 + A_1 + ... + A_k) * c_k   seconds,
#
# A_i = P(the first i drafts of a verify step are accepted), a_k the seconds of the first
# engine step (the prefill, and the draft's) and c_k of each later one (verify k drafts,
# draft k more, emit what was accepted). a_k and c_k depend on the model's shapes, the
# concurrency, the machine and, through the tokens each step emits, on the acceptance
# itself: they are timed on the policy as it is, at the rollout's concurrency, now and then
# and whenever the acceptance moved far. A short answer leaves drafting few steps to save
# what its first step costs. A_i moves with the policy and its MTP head every step: it is
# read from the engine's own acceptance counts after each drafting rollout (a draft the
# policy leaves behind stops being used at the next rollout, not at the next timing) and,
# while nothing drafts, from a small check at the deepest k every few steps. The choice
# depends on timings, so two runs of one seed can choose differently; checkpoints carry
# the tuner, so a resumed run continues with its state.

# A drafting engine's k is switched between rollouts through vLLM's dynamic speculative
# decoding schedule (batch size -> k, `num_speculative_tokens_per_batch_size`, vLLM >= 0.32):
# built with the deepest k, one range covering every batch size, rewritten per rollout.
DYNAMIC_SCHEDULE_KEY = "num_speculative_tokens_per_batch_size"


def dynamic_speculative_config(config):
    """`config` (a `build_mtp_speculative_config` result) with a batch-size schedule that
    lets `set_draft_tokens` choose any k up to its num_speculative_tokens at run time."""
    return {**config, DYNAMIC_SCHEDULE_KEY: [(1, 1, config["num_speculative_tokens"])]}


def _scheduler(llm):
    engine_core = getattr(llm.llm_engine.engine_core, "engine_core", None)
    if engine_core is None:
        raise ValueError("the vLLM engine core runs in another process; set_draft_tokens needs it in this one: "
                         "distributed_executor_backend='external_launcher' or VLLM_ENABLE_V1_MULTIPROCESSING=0")
    return engine_core.scheduler


def set_draft_tokens(llm, num_tokens):
    """Draft `num_tokens` tokens per verify step (0: none) in every rollout from now on, on an
    engine built with `dynamic_speculative_config`; at most its num_speculative_tokens.
    With num_tokens 0 the draft still reads each step (one draft-layer forward) to keep its
    cache in step: an engine without a speculative_config decodes faster."""
    scheduler = _scheduler(llm)
    if scheduler.dynamic_sd_lookup is None:
        raise ValueError(f"this engine has no {DYNAMIC_SCHEDULE_KEY}; build its speculative_config with "
                         "dynamic_speculative_config")
    if not isinstance(num_tokens, int) or not 0 <= num_tokens <= scheduler.num_spec_tokens:
        raise ValueError(f"num_tokens={num_tokens!r}: expected an int from 0 to the engine's "
                         f"num_speculative_tokens {scheduler.num_spec_tokens}")
    scheduler.dynamic_sd_lookup[1:] = [num_tokens] * (len(scheduler.dynamic_sd_lookup) - 1)


def acceptance_by_depth(statistics):
    """[A_1, ..., A_k] from `SpecDecodeMeter.read`'s statistics: A_i = P(the first i drafts
    of a verify step are accepted) (acceptance stops at the first rejection, so draft i
    accepted means all before it were), k the drafts per verify step (vLLM reports every
    position the engine could draft); [] without verify steps."""
    if not statistics or not statistics["num_drafts"]:
        return []
    depth = statistics["num_draft_tokens"] // statistics["num_drafts"]
    return [count / statistics["num_drafts"] for count in statistics["accepted_per_position"][:depth]]


def time_draft_steps(plain, drafting, meter, prompts, params, warm_up=True, rounds=2):
    """Time a rollout of `prompts` at each k: ([a_0, ..., a_max], [c_0, ..., c_max],
    statistics): a_k the seconds of its first engine step (prefill, and at k >= 1 the
    draft's), c_k the seconds of each later step, and the acceptance statistics of the last
    rollout at the deepest k (`meter` reads `drafting`). k = 0 runs on `plain` (an engine
    without a speculative_config), k = 1..max on `drafting` (built with
    `dynamic_speculative_config`, left at k = max).

    `params` must sample a fixed number of tokens (max_tokens > 1, ignore_eos). A step
    after the first emits one token per sequence and verify step, so a sequence takes 1 +
    its verify steps. Each k is timed twice per round, with one new token (a_k) and with
    `params` (c_k from the difference), `rounds` rounds taking turns over k, the fastest of
    each counting: a burst of load from elsewhere slows one round, not the choice. A step's cost
    grows with the drafts it accepts (each emitted token is processed): time on the weights
    the rollouts will use. `warm_up` runs each engine once untimed first.
    """
    if params.max_tokens < 2 or not params.ignore_eos:
        raise ValueError(f"params: max_tokens={params.max_tokens}, ignore_eos={params.ignore_eos}; expected a fixed "
                         "number of tokens, at least 2 (max_tokens >= 2 and ignore_eos=True)")
    first_step = params.clone()
    first_step.max_tokens = 1
    max_tokens = _scheduler(drafting).num_spec_tokens
    first_seconds, whole_seconds = [math.inf] * (max_tokens + 1), [math.inf] * (max_tokens + 1)
    later_steps, statistics = [1.0] * (max_tokens + 1), None

    def timed(engine, sampling):
        start = time.perf_counter()
        outputs = engine.generate(prompts, sampling, use_tqdm=False) if prompts else []
        return time.perf_counter() - start, outputs

    if warm_up:
        timed(plain, params)
        timed(drafting, params)
    for _ in range(rounds):
        for draft_tokens in range(max_tokens + 1):
            engine = drafting if draft_tokens else plain
            if draft_tokens:
                set_draft_tokens(engine, draft_tokens)
            first, _ = timed(engine, first_step)
            whole, outputs = timed(engine, params)
            rollout_statistics = meter.read(outputs) if draft_tokens else None
            sequences = max(1, sum(len(output.outputs) for output in outputs))
            later_steps[draft_tokens] = max(1.0, rollout_statistics["num_drafts"] / sequences if rollout_statistics
                                            else params.max_tokens - 1)
            first_seconds[draft_tokens] = min(first_seconds[draft_tokens], first)
            whole_seconds[draft_tokens] = min(whole_seconds[draft_tokens], whole)
            if draft_tokens == max_tokens:
                statistics = rollout_statistics
    # Each the fastest of its rounds, then the difference: a slow first step in one round
    # cannot make that round's later steps look fast. (Should noise make the whole rollout
    # no longer than its first step, every step counts alike.)
    step_seconds = [(whole - first) / steps if whole > first else whole / (steps + 1)
                    for whole, first, steps in zip(whole_seconds, first_seconds, later_steps)]
    return first_seconds, step_seconds, statistics


# DraftTuner.hopeless: the best-case speed relative to no drafting below which nothing
# more is measured between periodic timings.
HOPELESS_SPEED = 0.8


class DraftTuner:
    """Chooses the number of draft tokens k in 0..max_tokens that makes rollouts fastest.

        tuner = DraftTuner(max_tokens=3, new_tokens=32)
        tuner.calibrate(*time_draft_steps(plain, drafting, meter, prompts, params))
        tuner.observe(meter.read(outputs))             # after each drafting rollout
        k = tuner.choose()
        if tuner.timing_is_stale(): ...                # acceptance moved: time again

    A rollout of `new_tokens` tokens per sequence at k takes a_k + (new_tokens - 1) /
    (1 + A_1 + ... + A_k) x c_k seconds (first step a_k, later ones c_k, each emitting 1 +
    A_1 + ... + A_k tokens on average): a short answer leaves drafting few steps to save.
    `margin` (a fraction): drafting must be predicted at least this much faster than not
    drafting to be chosen, so timing noise does not buy a slower rollout. `retime` (a
    fraction): the timings are stale once the tokens a deepest-k step emits moved this
    much from when they were taken (a step's cost grows with what it emits). Its state is
    plain data (`state_dict`, `load_state_dict`) for checkpoints.
    """

    def __init__(self, max_tokens, new_tokens, margin=0.03, retime=0.25):
        for name, value in (("max_tokens", max_tokens), ("new_tokens", new_tokens)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r}: expected an int >= 1")
        self.max_tokens, self.new_tokens, self.margin, self.retime = max_tokens, new_tokens, margin, retime
        self.first_seconds = self.step_seconds = None  # [a_0, ..., a_max], [c_0, ..., c_max]
        self.acceptance = [0.0] * max_tokens  # [A_1, ..., A_max]
        self.timed_tokens_per_step = None  # 1 + A_1 + ... + A_max when the steps were timed

    def calibrate(self, first_seconds, step_seconds, statistics):
        """Take `time_draft_steps`' timings and the acceptance statistics of its deepest-k rollout."""
        for name, seconds in (("first_seconds", first_seconds), ("step_seconds", step_seconds)):
            if len(seconds) != self.max_tokens + 1 or not all(s > 0 and math.isfinite(s) for s in seconds):
                raise ValueError(f"{name}={seconds!r}: expected {self.max_tokens + 1} positive finite seconds, one "
                                 "per k = 0..max_tokens")
        self.first_seconds, self.step_seconds = list(first_seconds), list(step_seconds)
        self.observe(statistics)
        self.timed_tokens_per_step = 1 + sum(self.acceptance)

    def timing_is_stale(self):
        """Whether the acceptance moved so far since the timing that the step costs did too."""
        return (self.timed_tokens_per_step is not None
                and abs(1 + sum(self.acceptance) - self.timed_tokens_per_step) > self.retime * self.timed_tokens_per_step)

    def observe(self, statistics):
        """Take the acceptance of a rollout or check that drafted k tokens: A_1..A_k are
        replaced, deeper ones (from an earlier, deeper measurement) are capped at A_k."""
        measured = acceptance_by_depth(statistics)[:self.max_tokens]
        if not measured:
            return
        self.acceptance[:len(measured)] = measured
        for depth in range(len(measured), self.max_tokens):
            self.acceptance[depth] = min(self.acceptance[depth], measured[-1])

    def predicted_seconds(self, acceptance=None):
        """[seconds of a rollout at k, for k = 0..max_tokens], at the measured acceptance
        or at `acceptance` ([A_1, ..., A_max])."""
        if self.step_seconds is None:
            raise RuntimeError("DraftTuner.choose before calibrate: time the engine steps first")
        acceptance = self.acceptance if acceptance is None else acceptance
        return [self.first_seconds[k] + (self.new_tokens - 1) / (1 + sum(acceptance[:k])) * self.step_seconds[k]
                for k in range(self.max_tokens + 1)]

    def predicted_speeds(self, acceptance=None):
        """[tokens per second relative to k = 0, for k = 0..max_tokens]."""
        seconds = self.predicted_seconds(acceptance)
        return [seconds[0] / value for value in seconds]

    def hopeless(self):
        """Whether drafting stays well below no drafting (HOPELESS_SPEED) even with every
        draft accepted, at these timings (which only grow with the acceptance): checking the
        acceptance or timing again on its account is wasted. Not merely below 1 + margin:
        one timing disturbed by a burst of load must not switch the checks off."""
        return max(self.predicted_speeds([1.0] * self.max_tokens)[1:]) < HOPELESS_SPEED

    def choose(self):
        speeds = self.predicted_speeds()
        best = max(range(len(speeds)), key=speeds.__getitem__)
        return best if speeds[best] >= 1 + self.margin else 0

    def state_dict(self):
        return {name: getattr(self, name) for name in self._STATE}

    def load_state_dict(self, state):
        if (state["max_tokens"], state["new_tokens"]) != (self.max_tokens, self.new_tokens):
            raise ValueError(f"a tuner state for max_tokens {state['max_tokens']} and new_tokens "
                             f"{state['new_tokens']}, this tuner has {self.max_tokens} and {self.new_tokens}")
        for name in self._STATE:
            setattr(self, name, state[name])

    _STATE = ("max_tokens", "new_tokens", "margin", "retime", "first_seconds", "step_seconds", "acceptance",
              "timed_tokens_per_step")
