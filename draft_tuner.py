"""How many tokens the MTP head drafts per verify step, per band of live batch sizes: chosen
from the rollouts' own speed.

Drafting pays when the target is deep next to its draft and the batch is small; at high
concurrency verifying drafts costs as much as it saves, and a draft the policy has moved
away from only costs. So the number of draft tokens k (0 = no drafting) is measured, not
assumed, and measured on the rollouts themselves: short timing rollouts mislead (on a
shared machine a burst of load slows a short rollout whole, and at temperature 1 a few
sequences sampled off what the draft predicts make one short rollout far slower than the
next), while a few real rollouts taking turns measure what drafting costs. Four tries, per
band of batch sizes: k = 0, k = 1, the deepest k and the plain engine. From them a cost
model chooses each band's k: drafting's fixed and per-draft cost as shares of a step, from
k = 1's and the deepest k's speeds over k = 0's, non-decreasing from thin bands to crowded
ones, against the tokens a verify step at k emits at the acceptance the engine measures
(DraftTuner).

    tuner = DraftTuner(max_tokens=3, num_bands=len(spec_config.BAND_EDGES))
    for step in steps:
        schedule, checked = tuner.plan(step, check, check_every=5, tune_every=50, drafting=drafted)
        ...roll out: no drafts, the draft idle (schedule None), else schedule[band]
           in each band of batch sizes, counting each band's tokens and seconds...
        tuner.after_rollout(schedule, {band: (tokens, seconds)}, acceptance)
        ...train...; tuner.observe_estimate(the step's estimate of A_1, or None)

A_i = P(the first i drafts of a verify step are accepted) moves with the policy and its
MTP head every step: it is read from the engine's acceptance counts after each drafting
rollout and, while nothing drafts, followed by the trainer's estimate of A_1
(`observe_estimate`: with the head trained on the policy's distribution, the mean of
sum_v min(p, q) over the step's tokens, which the MTP loss computes anyway); without
one, from a small check at the deepest k every few steps (`check`, the caller's: it rolls
a few prompts out at the deepest k and returns their statistics). A draft the policy
leaves behind stops being used at the next rollout, and once A_i rose far enough for a
k deeper than the tries' deepest to pay, the k are tried again. Where two k run within a
few percent of each other, two runs of one seed can choose differently; the tuner's state
is plain data for checkpoints, so a resumed run continues with it.

Statistics are the dicts spec_config.SpecDecodeMeter.read returns (num_drafts,
num_draft_tokens, accepted_per_position, ...). Imports the standard library only.
"""

import math


def acceptance_by_depth(statistics):
    """[A_1, ..., A_k] from `SpecDecodeMeter.read`'s statistics: A_i = P(the first i drafts
    of a verify step are accepted) (acceptance stops at the first rejection, so draft i
    accepted means all before it were), k the drafts per verify step (vLLM reports every
    position the engine could draft); [] without verify steps. Where the statistics carry
    `drafts_per_position` (the verify steps that drafted past each position: a schedule
    drafting k = 1 in some bands and 3 in others), A_i is over those steps only, to the
    deepest position any step drafted."""
    if not statistics or not statistics["num_drafts"]:
        return []
    drafts = statistics.get("drafts_per_position")
    if drafts is None:
        depth = statistics["num_draft_tokens"] // statistics["num_drafts"]
        drafts = [statistics["num_drafts"]] * depth
    return [count / drafted for count, drafted in zip(statistics["accepted_per_position"], drafts) if drafted]


# DraftTuner's tries: k = 0, k = 1, the deepest k that could pay and the plain engine,
# each in every band, TRY_ROUNDS times in turn (each try costs where it is slow, and more
# rounds bought less than they cost on the tail task). A band's speed at one k moves
# 14-24% from one rollout to the next (its batch sizes and accepted drafts change), more
# than k = 2, 3 and 4 differ by, so the tries do not compare each k's own speed: they
# measure what drafting costs in each band and the choice follows from it and the
# acceptance. DRIFT_MARGIN: the
# room `_could_pay` gives every estimate for the machine's drift since the tries. And the
# least a drafted token costs, as a share of a target step (one MTP layer next to a
# 16-layer target costs more): a k whose drafts add fewer tokens per step is not tried.
TRY_ROUNDS = 1
DRIFT_MARGIN = 0.15
MIN_DRAFT_COST = 0.05
# The acceptance check (while no rollout drafts): its new tokens (a few verify steps at the
# deepest k) and prompts per engine (each with the rollout's completions per prompt).
ACCEPTANCE_CHECK_TOKENS = 12
ACCEPTANCE_CHECK_PROMPTS = 2
# No band drafts and the draft is idle (spec_config.idle_draft): faster than k = 0 in every
# band, where the draft layer still runs every step (for bands further on that draft).
PLAIN = "plain"


class DraftTuner:
    """Chooses the engine and, per concurrency band, the number of draft tokens k in
    0..max_tokens whose rollouts run fastest.

    A rollout thins as its sequences end, and drafting pays more the fewer sequences share
    an engine step: the crowded start may be fastest at k = 0 and the tail at k = 3. So
    each rollout's steps are measured per band of batch sizes (spec_config.BandMeter):
    tokens and seconds per band. `plan` and `after_rollout` (above in the module
    docstring) are the whole use.

    The tries: the next 4 x `rounds` rollouts (3 where the deepest k is 1), taking turns:
    k = 0 in every band (the draft layer runs, nothing is drafted), k = 1 and the deepest
    k that could pay in every band, then PLAIN (the whole rollout with the draft idle). A
    run's first rollout pays the engine's warm-up (30-50% slower than the next on the
    default run), so PLAIN, the speed every choice must beat, comes last, and k = 0
    first: its speed is only the base the tried k's costs are shares of, and a tried k's
    modelled speed is its measured one whatever that base. The deepest k that could pay:
    where a verify step's tokens (1 + A_1 + ... + A_k, A_i the acceptance at depth i) are
    at least 1 + margin times its cost with each draft at MIN_DRAFT_COST of a step (1 + k
    x MIN_DRAFT_COST). Nothing is tried where no k could pay (a random draft). A run's first
    tries begin before any acceptance is known (no check rollout of their own): their k = 1
    try measures A_1, and the deepest k is settled from it, deeper depths as A_1^i (none
    past k = 1 where none could pay). A band's speed at each is the mean over its tries.

    The choice (`choose`, after the tries), per band, from a cost model (`draft_costs`): a
    verify step at k costs a k = 0 step, plus what drafting at all adds (the verify path,
    the draft's pass), plus k drafts; it emits 1 + A_1 + ... + A_k tokens where a k = 0
    step emits 1. The k = 1 and deepest tries each give a step's cost over k = 0's (tokens
    per step at the tries' acceptance over speed), first made non-decreasing from thin
    bands to crowded ones (`_non_decreasing`: drafting costs more, relative to its step,
    the more sequences share the step), which pools the bands' noise; a line through the
    two gives the fixed and per-draft parts. Each band then takes the k whose tokens per
    step over its cost is
    highest at today's acceptance (so a draft the policy left behind drops its bands to
    k = 0); k > 0 must beat k = 0 by `margin`, and the bands' rollout time, the tries'
    tokens per band over each band's modelled speed, must beat PLAIN's by `margin` for any
    band to draft. k = 0 counts at most at PLAIN's speed in a band: it does PLAIN's work
    and more (the draft layer's forward and the verify path). A band no try ran takes the
    nearest tried band's k. `retry` (a fraction): the tries are stale once the tokens a
    deepest-k step emits rose this much since they ended and a k deeper than the tries'
    deepest could now pay; a fall needs no tries, the model already drafts less. Neither
    the period nor a rise re-opens them where, on the last rollout's bands, drafting could
    not beat PLAIN even at its best (`_could_pay`). Its state is plain data (`state_dict`,
    `load_state_dict`) for checkpoints: a resumed run continues the tries where they were.
    """

    def __init__(self, max_tokens, num_bands, margin=0.03, retry=0.25, rounds=TRY_ROUNDS):
        for name, value in (("max_tokens", max_tokens), ("num_bands", num_bands), ("rounds", rounds)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r}: expected an int >= 1")
        self.max_tokens, self.num_bands, self.margin, self.retry, self.rounds = (max_tokens, num_bands, margin,
                                                                                 retry, rounds)
        self.acceptance = [0.0] * max_tokens  # [A_1, ..., A_max]
        self.tried_tokens_per_step = None  # 1 + A_1 + ... + A_max when the tries ended (began, while they run)
        self.trying = False  # whether the tries are under way
        self.deepest = 0  # the deepest k that could pay when the tries began (None: not settled yet)
        self.tried = []  # each try's schedule so far (None: PLAIN), in order
        self.realized = {}  # variant -> [each band's tries' tokens/s]
        self.band_tokens = [0] * num_bands  # tokens the tries decoded in each band
        self.tried_acceptance = None  # [A_1, ..., A_max] when the tries ended; None: no tries to choose from
        self.measured = None  # [A_1, ..., A_max] as the engine last measured them
        self.drafted = False  # whether the last rollout drafted (its counts then stand)
        self.estimated = False  # whether the trainer estimates A_1 (then no periodic check)
        self.could_pay = True  # whether drafting could beat PLAIN on the last rollout's bands (_could_pay)

    def tokens_per_step(self, draft_tokens, acceptance=None):
        """1 + A_1 + ... + A_k: the tokens a verify step at k = `draft_tokens` emits on average."""
        return 1 + sum((self.acceptance if acceptance is None else acceptance)[:draft_tokens])

    def observe(self, statistics):
        """Take the acceptance of a rollout or check that drafted k tokens: A_1..A_k are
        replaced, deeper ones (from an earlier, deeper measurement) are capped at A_k."""
        measured = acceptance_by_depth(statistics)[:self.max_tokens]
        if not measured:
            return
        self.acceptance[:len(measured)] = measured
        for depth in range(len(measured), self.max_tokens):
            self.acceptance[depth] = min(self.acceptance[depth], measured[-1])
        self.measured = list(self.acceptance)

    def observe_estimate(self, depth1):
        """Take the trainer's estimate of A_1 after the step's training (None: it has none),
        of the weights the step rolled out with. Where that rollout drafted, its own counts
        stand. Where not, A_1 is the estimate and each deeper A_i the one before times the
        conditional acceptance the engine last measured there (A_i / A_i-1, at most 1): one
        odd measurement lasts until the next rollout. The estimate weighs every response
        token alike; the engine counts the positions its verify steps reach."""
        if depth1 is None:
            return
        self.estimated = True
        if self.drafted or self.measured is None:
            return
        self.acceptance[0] = depth1
        for depth in range(1, self.max_tokens):
            before = self.measured[depth - 1]
            conditional = min(1.0, self.measured[depth] / before) if before > 0 else 0.0
            self.acceptance[depth] = self.acceptance[depth - 1] * conditional

    def try_each(self):
        """Begin the tries (the class docstring) at the current acceptance: k = 0, k = 1, the
        deepest k that could pay and PLAIN (none where no drafting k could: then PLAIN without
        tries). Where the engine never measured the acceptance (a run's first tries), all
        four begin, and the deepest k is settled once the k = 1 try measured A_1
        (`_settle_deepest`)."""
        unmeasured = self.measured is None
        self.deepest = None if unmeasured else self._deepest_paying(self.acceptance)
        self.trying = unmeasured or self.deepest > 0
        self.tried = []
        self.realized = {variant: [[] for _ in range(self.num_bands)]
                         for variant in (PLAIN, 0, 1, self.deepest or 1)} if self.trying else {}
        self.band_tokens = [0] * self.num_bands
        self.tried_tokens_per_step = self.tokens_per_step(self.max_tokens)
        self.tried_acceptance = None

    def _deepest_paying(self, acceptance):
        """The deepest k whose verify step's tokens at `acceptance` are at least 1 + margin
        times its cost with each draft at MIN_DRAFT_COST of a step; 0 where none are."""
        return max((k for k in range(1, self.max_tokens + 1)
                    if self.tokens_per_step(k, acceptance) >= (1 + self.margin) * (1 + k * MIN_DRAFT_COST)), default=0)

    def _settle_deepest(self):
        """The first tries' deepest k, after their k = 1 try: the deepest that could pay with
        each depth past the first accepted as often as the first, given the ones before
        (A_i = A_1^i; the deepest try then measures them). 1 or 0 where none deeper could:
        the tries end there."""
        self.deepest = self._deepest_paying([self.acceptance[0] ** depth for depth in range(1, self.max_tokens + 1)])

    def exploring(self):
        """Whether the next rollouts are tries (at the schedule `choose` names, for `record`)."""
        return self.trying

    def is_stale(self):
        """Whether the acceptance rose so far (by more than `retry`) since the tries ended
        that a k deeper than the tries' deepest could pay now (`_deepest_paying`). Among the
        k's up to the deepest tried, the cost model already chooses at today's acceptance
        (`choose`): the tries measured what drafting costs, not what it earns, so a rise
        alone gives them nothing to measure again. A fall is not either: the model already
        chooses fewer drafts or none, and a dip of one rollout would otherwise cost a round
        of tries."""
        if self.tried_tokens_per_step is None:
            return False
        rose = self.tokens_per_step(self.max_tokens) / self.tried_tokens_per_step - 1 > self.retry
        return rose and self._deepest_paying(self.acceptance) > (self.deepest or 0)

    def record(self, band_counts):
        """A try's measurement: {band: (tokens, seconds)} of the rollout at the schedule
        `choose` named. Outside the tries nothing is kept: the machine's speed drifts over
        minutes, so only rollouts taking turns are compared."""
        if not self.trying:
            return
        for band, (tokens, seconds) in band_counts.items():
            if not (0 <= band < self.num_bands and tokens >= 0 and seconds > 0 and math.isfinite(seconds)):
                raise ValueError(f"band_counts[{band!r}] = {(tokens, seconds)!r}: expected a band in 0..{self.num_bands - 1} "
                                 "with tokens >= 0 and positive finite seconds")
        schedule = self._next_try()
        for band, (tokens, seconds) in band_counts.items():
            variant = PLAIN if schedule is None else schedule[band]
            self.realized.setdefault(variant, [[] for _ in range(self.num_bands)])[band].append(tokens / seconds)
            self.band_tokens[band] += tokens
        self.tried.append(schedule)
        if self.deepest is None and schedule == [1] * self.num_bands:
            self._settle_deepest()
        if len(self.tried) >= len(self._try_order()) * self.rounds:
            self.trying = False
            self.tried_tokens_per_step = self.tokens_per_step(self.max_tokens)
            self.tried_acceptance = list(self.acceptance)

    def _next_try(self):
        """The next try's schedule (None: PLAIN): in this round of `_try_order`, the first
        one not yet tried (a state saved while the tries ran in another order resumes
        with what it lacks)."""
        order = self._try_order()
        turn = len(self.tried) // len(order)
        return next(schedule for schedule in order if self.tried.count(schedule) <= turn)

    def _try_order(self):
        """k = 0 everywhere, k = 1 everywhere, where deeper the deepest k everywhere (max_tokens
        while it is not settled), then PLAIN."""
        deepest = self.max_tokens if self.deepest is None else self.deepest
        return [[k] * self.num_bands for k in sorted({0, 1, deepest})] + [None]

    def band_speeds(self, variant):
        """[each band's mean tried tokens/s at `variant`, None where it ran no step]."""
        return [sum(speeds) / len(speeds) if speeds else None for speeds in self.realized.get(variant, [])] or \
            [None] * self.num_bands

    def choose(self):
        """The next rollout's schedule: the next try's (None: PLAIN; else a k per band),
        else the fastest (above) at today's acceptance."""
        if self.trying:
            return self._next_try()
        if self.tried_acceptance is None:
            return None
        return self._fastest_schedule()

    def _no_draft_speeds(self):
        """Each band's k = 0 speed, at most PLAIN's (None where k = 0 never ran there)."""
        return [min(no_draft, plain) if no_draft and plain else no_draft
                for no_draft, plain in zip(self.band_speeds(0), self.band_speeds(PLAIN))]

    def draft_costs(self):
        """Per band, (what drafting at all adds to a verify step, what each drafted token
        adds), each as a share of a k = 0 step: a tried k's step cost over k = 0's (its
        tokens per step at the tries' acceptance over its speed), less one, is the first
        plus k times the second (a line through the tried k's: the verify path and the
        draft's own pass cost whatever k drafts; one k tried: through the origin). Each
        tried k's extra cost is first made non-decreasing from thin bands to crowded ones.
        None where the band lacks k = 0's speed or any drafting k's."""
        acceptance = self.tried_acceptance or self.acceptance
        no_draft = self._no_draft_speeds()
        extra = {}  # k -> per band, a step at k's cost over a k = 0 step, less one
        for k in sorted(variant for variant in self.realized if variant not in (PLAIN, 0)):
            extra[k] = _non_decreasing([self.tokens_per_step(k, acceptance) * base / speed - 1 if base and speed else None
                                        for base, speed in zip(no_draft, self.band_speeds(k))], self.band_tokens)
        costs = []
        for band in range(self.num_bands):
            points = [(k, max(0.0, values[band])) for k, values in extra.items() if values[band] is not None]
            costs.append(_line(points) if points else None)
        return costs

    def _band_best(self, no_draft, cost, acceptance=None):
        """(the k fastest in a band whose k = 0 speed is `no_draft` and whose drafting costs
        `cost` (draft_costs'), at `acceptance` (default today's); its modelled tokens/s):
        k > 0 only where it beats k = 0 by `margin`."""
        if not no_draft or cost is None:
            return 0, no_draft
        best, gain = self._best_draft(cost, acceptance)
        return (best, no_draft * gain) if gain >= 1 + self.margin else (0, no_draft)

    def _best_draft(self, cost, acceptance=None):
        """(the k in 1..max_tokens whose tokens per step over its cost is highest, that
        ratio: its modelled speed over k = 0's), drafting costing `cost` = (fixed,
        per_draft) shares of a k = 0 step, at `acceptance` (default today's)."""
        fixed, per_draft = cost
        return max(((k, self.tokens_per_step(k, acceptance) / (1 + fixed + k * per_draft))
                    for k in range(1, self.max_tokens + 1)), key=lambda pair: pair[1])

    def _schedule_seconds(self, acceptance=None):
        """(each band's fastest k, _band_best's; the tries' tokens at those k's modelled
        speeds and at PLAIN's, in seconds, over the bands both ran)."""
        plain = self.band_speeds(PLAIN)
        schedule, drafting_seconds, plain_seconds = [], 0.0, 0.0
        for band, (no_draft, cost) in enumerate(zip(self._no_draft_speeds(), self.draft_costs())):
            best, best_speed = self._band_best(no_draft, cost, acceptance)
            schedule.append(best)
            if self.band_tokens[band] and best_speed and plain[band]:
                drafting_seconds += self.band_tokens[band] / best_speed
                plain_seconds += self.band_tokens[band] / plain[band]
        return schedule, drafting_seconds, plain_seconds

    def _fastest_schedule(self, acceptance=None):
        """Per band the fastest k (at `acceptance`, default today's), where the bands'
        rollout time beats PLAIN's; else None."""
        schedule, drafting_seconds, plain_seconds = self._schedule_seconds(acceptance)
        schedule = _fill_unseen(schedule, [speed is not None for speed in self.band_speeds(0)])
        if not any(schedule) or plain_seconds < (1 + self.margin) * drafting_seconds:
            return None
        return schedule

    def plan(self, step, check, check_every, tune_every, drafting):
        """Before rollout `step` (1-based): returns (the rollout's schedule, None: the plain
        engine, else a k per band; the check's statistics or None).

        Outside the tries: while the last rollout did not draft (`drafting` False) and the
        trainer gives no estimates (or the engine never measured the acceptance), every
        `check_every` steps `check()` measures the acceptance at the deepest k (not at the
        first plan: the first tries measure it, `try_each`); at the first plan, every
        `tune_every` steps and once the acceptance rose far (`is_stale`), the tries begin.
        `exploring()` after it says whether this rollout is a try (`after_rollout` then
        needs its band counts).
        """
        checked = None
        first = self.tried_tokens_per_step is None
        if not self.exploring():
            # Estimates need one measurement to follow (observe_estimate): until the engine
            # measured the acceptance (a k = 1 try that verified nothing), checks go on.
            unmeasured = self.measured is None
            if not drafting and not first and (unmeasured or not self.estimated) and (step - 1) % check_every == 0:
                checked = check()
                self.observe(checked)
            if first or ((step - 1) % tune_every == 0 or self.is_stale()) and self.could_pay:
                self.try_each()
        return self.choose(), checked

    def after_rollout(self, schedule, band_counts, statistics):
        """After a rollout at the schedule `plan` named: its {band: (tokens, seconds)} (a
        try's; ignored outside the tries) and its acceptance statistics (None without
        drafting). The acceptance goes in first: the last try's speed was at the acceptance
        it measured, which the tries' cost model reads (`tried_acceptance`)."""
        self.drafted = schedule is not None and any(schedule)
        if self.drafted:
            self.observe(statistics)
        if self.exploring():
            self.record(band_counts)
        if not self.exploring():
            self.could_pay = self._could_pay(band_counts)

    def _could_pay(self, band_counts):
        """Whether a schedule could beat PLAIN by `margin` on a rollout of these {band:
        (tokens, seconds)} at today's acceptance, each band at its modelled best (a draft at
        the tries' `draft_costs`, MIN_DRAFT_COST of a step where none ran there), every
        estimate given DRIFT_MARGIN of room for the machine's drift since. Where even that
        loses, neither the period nor a rise of the acceptance can make a try pay. True
        where a band lacks PLAIN's or k = 0's speed (nothing to judge it by)."""
        if self.tried_acceptance is None or PLAIN not in self.realized or 0 not in self.realized:
            return True
        plain, no_draft, costs = self.band_speeds(PLAIN), self._no_draft_speeds(), self.draft_costs()
        best_seconds = plain_seconds = 0.0
        for band, (tokens, _) in band_counts.items():
            if not tokens:
                continue
            if not plain[band] or not no_draft[band]:
                return True
            best = no_draft[band] * self._best_draft((0.0, MIN_DRAFT_COST) if costs[band] is None else costs[band])[1]
            best_seconds += tokens / max(plain[band], (1 + DRIFT_MARGIN) * best)
            plain_seconds += tokens / plain[band]
        return (1 + self.margin) * best_seconds < plain_seconds

    def state_dict(self):
        return {name: getattr(self, name) for name in self._STATE}

    def load_state_dict(self, state):
        for name in ("max_tokens", "num_bands"):
            if state.get(name) != getattr(self, name):
                raise ValueError(f"a tuner state for {name} {state.get(name)}, this tuner has {getattr(self, name)}")
        state = {"could_pay": True, **state}  # a state saved before the bound: re-opens as it did then
        missing = [name for name in self._STATE if name not in state]
        if missing:
            raise ValueError(f"a tuner state without {missing} (saved by a tuner that kept less, or tried whole "
                             "rollouts at one k, not k per band): expected every name of DraftTuner._STATE")
        for name in self._STATE:
            setattr(self, name, state[name])

    _STATE = ("max_tokens", "num_bands", "margin", "retry", "rounds", "acceptance", "tried_tokens_per_step",
              "trying", "deepest", "tried", "realized", "band_tokens", "tried_acceptance", "measured", "drafted",
              "estimated", "could_pay")


def _line(points):
    """(intercept, slope), both >= 0, of the least-squares line through [(k, value)]: where
    the free line's intercept or slope would fall below 0, the best line with it at 0
    (through the origin; flat at the mean); through the origin where the points hold one k."""
    through_origin = max(0.0, sum(k * value for k, value in points) / sum(k * k for k, _ in points))
    if len({k for k, _ in points}) == 1:
        return 0.0, through_origin
    count = len(points)
    mean_k, mean_value = sum(k for k, _ in points) / count, sum(value for _, value in points) / count
    slope = sum((k - mean_k) * (value - mean_value) for k, value in points) / sum((k - mean_k) ** 2 for k, _ in points)
    if slope < 0:
        return max(0.0, mean_value), 0.0
    if mean_value - slope * mean_k < 0:
        return 0.0, through_origin
    return mean_value - slope * mean_k, slope


def _non_decreasing(values, weights):
    """`values` (None skipped) made non-decreasing in order, each run that falls replaced by
    its `weights`-weighted mean (pool adjacent violators: the least squares fit)."""
    blocks = []  # [mean, weight, indices]
    for index, value in enumerate(values):
        if value is None:
            continue
        blocks.append([value, max(weights[index], 1), [index]])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (high, high_weight, high_indices), (low, low_weight, low_indices) = blocks.pop(-2), blocks.pop()
            total = high_weight + low_weight
            blocks.append([(high * high_weight + low * low_weight) / total, total, high_indices + low_indices])
    fitted = list(values)
    for mean, _, indices in blocks:
        for index in indices:
            fitted[index] = mean
    return fitted


def _fill_unseen(schedule, seen):
    """Bands the tries never ran take the k of the nearest band they ran (the fewer
    sequences side on a tie); all 0 where they ran none."""
    seen_bands = [band for band, ran in enumerate(seen) if ran]
    if not seen_bands:
        return [0] * len(schedule)
    return [schedule[band] if seen[band] else schedule[min(seen_bands, key=lambda s: (abs(s - band), s))]
            for band in range(len(schedule))]
