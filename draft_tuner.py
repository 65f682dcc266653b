"""How many tokens the MTP head drafts per verify step, per band of live batch sizes: chosen
from the rollouts' own speed.

Drafting pays when the target is deep next to its draft and the batch is small; at high
concurrency verifying drafts costs as much as it saves, and a draft the policy has moved
away from only costs. So the number of draft tokens k (0 = no drafting) is measured, not
assumed, and measured on the rollouts themselves: short timing rollouts mislead (on a
shared machine a burst of load slows a short rollout whole, and at temperature 1 a few
sequences sampled off what the draft predicts make one short rollout far slower than the
next), while a few real rollouts taking turns measure each k to a few percent (one
rollout's speed differs from the next by about 5%). The tries are per band of batch sizes
and cost little where drafting cannot pay: each band starts at k = 0 and 1, goes to the
deepest k only once its deepest is about the fastest, then down from its fastest, drops a k
once it is clearly slower, and runs its fastest k once nothing is left to measure; the plain engine is tried again only while
its time and the bands' are close (DraftTuner).

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
leaves behind stops being used at the next rollout, and once A_i moved far the k are
tried again. Where two k run within a few percent of each other, two runs of one seed can
choose differently; the tuner's state is plain data for checkpoints, so a resumed run
continues with it.

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


# DraftTuner: each candidate gets up to this many measurements per band (one rollout's speed
# differs from the next by about 5%, and a burst of load slows one of them: the fastest
# counts); one whose fastest is slower than its band's best by more than ELIMINATION_MARGIN
# is dropped there (twice the spread two noisy rollouts can show, plus room: a candidate
# that far behind does not catch up by noise); and the least a drafted token costs, as a
# share of a target step (one MTP layer next to a 16-layer target costs more): a k whose
# drafts add fewer tokens per step is not tried.
TRY_ROUNDS = 3
ELIMINATION_MARGIN = 0.15
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

    The tries: the next rollouts are tries, of two kinds taking turns. A PLAIN try rolls
    the whole rollout out with the draft idle. A band try gives each band its own k: each
    band keeps its own candidates and measurements, and the bands are tried side by side.
    - The search: a band's candidates start as k = 0 and 1. Once the deepest k opened
      there was measured and ran within `margin` of the band's fastest, the deepest k that
      could pay joins them (the jump: a band where k = 1 loses never tries deeper), and the
      k just below the band's fastest joins once measured (the descent). The deepest that
      could pay: where a verify step's tokens (1 + A_1 + ... + A_k, A_i the acceptance at
      depth i) are at least 1 + margin times its cost with each draft at MIN_DRAFT_COST of
      a step (1 + k x MIN_DRAFT_COST). Nothing is tried where no k could pay (a random
      draft). Climbing one k at a time stalls where one noisy try of k measured slower
      than k - 1 (a band's speed moves 15-25% from one rollout to the next on a
      long-tailed task), and thin bands, where the deepest k pays most, reach it last.
    - Successive elimination: a measured candidate whose fastest is slower than its band's
      fastest by more than ELIMINATION_MARGIN is dropped there; the others get up to
      `rounds` measurements, the fewest-measured (then the smallest k) first. A band with
      nothing left to measure runs the k it would choose now, the cheapest it can.
    - PLAIN is measured first; once every band a try reached has measured each of its
      candidates, again (after a band try, up to `rounds`) only while the rollout time of
      the bands' fastest k and PLAIN's are within ELIMINATION_MARGIN of each other: a
      clear winner needs no more rounds (and a PLAIN try costs where drafting wins). Once
      no schedule could beat PLAIN by `margin` with every candidate of the bands PLAIN ran
      measured once (`_plain_cannot_lose`), the drafting ones are dropped whole: further
      measurements cannot pay. k = 0 counts at most at PLAIN's speed in a band: it does
      PLAIN's work and more (the draft layer's forward and the verify path).
    The tries end when neither PLAIN nor any band a try reached has a candidate left to
    measure, or after `rounds` x (2 + the deepest k) of them (a band reached only now and
    then); each counts its fastest per band (a burst of load slows one rollout, not the
    choice).

    The choice (`choose`, after the tries): per band, the drafting k fastest there (k > 0
    must beat k = 0 by `margin`, so noise does not buy a slower band; a band no try ran
    takes the nearest tried band's); that schedule's rollout time, the tries' tokens per
    band over each band's speed, against PLAIN's, which must be slower by `margin` for any
    band to draft. Between tries a band's speed at k follows the tokens its steps emit, so
    each tried speed is scaled by 1 + A_1 + ... + A_k now over then: a draft the policy
    left behind drops its bands to k = 0, and PLAIN once no band drafts. `retry` (a
    fraction): the tries are stale once the tokens a deepest-k step emits rose this much
    since they ended; a fall needs no tries, the scaled speeds already draft less. Neither
    the period nor a rise re-opens them where, on the last rollout's bands, drafting could
    not beat PLAIN even at its best (`_could_pay`). Its state is plain data
    (`state_dict`, `load_state_dict`) for checkpoints: a resumed run
    continues the tries where they were.
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
        self.deepest = 0  # the deepest k that could pay when the tries began
        self.candidates = [[] for _ in range(num_bands)]  # per band, the k still tried there
        self.opened = [[] for _ in range(num_bands)]  # per band, the k the search opened there
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
        """Begin the tries (the class docstring) at the current acceptance: every band at
        candidates k = 0 and 1, up to the deepest k that could pay (none where no drafting
        k could: then PLAIN without tries)."""
        paying = [k for k in range(1, self.max_tokens + 1)
                  if self.tokens_per_step(k) >= (1 + self.margin) * (1 + k * MIN_DRAFT_COST)]
        self.deepest = max(paying, default=0)
        self.trying = bool(paying)
        self.candidates = [[0, 1] if paying else [] for _ in range(self.num_bands)]
        self.opened = [[0, 1] if paying else [] for _ in range(self.num_bands)]
        self.tried = []
        variants = [PLAIN, 0, 1] if paying else []
        self.realized = {variant: [[] for _ in range(self.num_bands)] for variant in variants}
        self.band_tokens = [0] * self.num_bands
        self.tried_tokens_per_step = self.tokens_per_step(self.max_tokens)
        self.tried_acceptance = None

    def exploring(self):
        """Whether the next rollouts are tries (at the schedule `choose` names, for `record`)."""
        return self.trying

    def is_stale(self):
        """Whether the acceptance rose so far (by more than `retry`) since the tries ended
        that a k that lost then may win now. A fall is not: each band's tried speeds,
        scaled to today's acceptance, already choose fewer drafts or none (`choose`), and a
        dip of one rollout would otherwise cost a round of tries."""
        if self.tried_tokens_per_step is None:
            return False
        return self.tokens_per_step(self.max_tokens) / self.tried_tokens_per_step - 1 > self.retry

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
            self.realized[PLAIN if schedule is None else schedule[band]][band].append(tokens / seconds)
            self.band_tokens[band] += tokens
        self.tried.append(schedule)
        for band in range(self.num_bands):
            self._eliminate_and_open(band)
        if not self._tries_left():
            self.trying = False
            self.tried_tokens_per_step = self.tokens_per_step(self.max_tokens)
            self.tried_acceptance = list(self.acceptance)

    def _eliminate_and_open(self, band):
        """Drop `band`'s candidates slower than its fastest by more than ELIMINATION_MARGIN;
        open the deepest k once the deepest opened ran within `margin` of the fastest (the
        jump), and the k below the fastest (the descent)."""
        speeds = {k: speed for k in self.opened[band] if (speed := self.band_speeds(k)[band]) is not None}
        if not speeds:
            return
        fastest_k = max(speeds, key=speeds.get)
        fastest = speeds[fastest_k]
        self.candidates[band] = [k for k in self.candidates[band]
                                 if k not in speeds or speeds[k] * (1 + ELIMINATION_MARGIN) >= fastest]
        top = max(self.opened[band])
        opening = {fastest_k - 1} if fastest_k > 1 else set()
        if top < self.deepest and top in self.candidates[band] and top in speeds and \
                speeds[top] * (1 + self.margin) >= fastest:
            opening.add(self.deepest)
        for k in sorted(opening - set(self.opened[band])):
            self.opened[band] = sorted(self.opened[band] + [k])
            self.candidates[band].append(k)
            self.realized.setdefault(k, [[] for _ in range(self.num_bands)])

    def _unmeasured(self, band, least=None):
        """`band`'s candidates with fewer than `least` (default `rounds`) measurements."""
        return [k for k in self.candidates[band] if len(self.realized[k][band]) < (least or self.rounds)]

    def _unmeasured_bands(self, least=None):
        """The bands a try reached with a candidate measured fewer than `least` (default
        `rounds`) times."""
        return [band for band in range(self.num_bands) if self.band_tokens[band] and self._unmeasured(band, least)]

    def _plain_due(self):
        """Whether PLAIN needs another try: none yet, or fewer than `rounds` while its
        rollout time and the bands' fastest k's are within ELIMINATION_MARGIN, judged once
        every band a try reached has measured each of its candidates."""
        plain_tries = self.tried.count(None)
        if not plain_tries or plain_tries >= self.rounds or self._unmeasured_bands(least=1):
            return not plain_tries
        _, drafting_seconds, plain_seconds = self._schedule_seconds()
        return not drafting_seconds or max(drafting_seconds / plain_seconds,
                                           plain_seconds / drafting_seconds) <= 1 + ELIMINATION_MARGIN

    def _bands_due(self):
        """Whether a band a try reached has a candidate to measure, while PLAIN has not beaten
        the bands' fastest k by more than ELIMINATION_MARGIN with every candidate measured,
        nor beaten any schedule's bound (`_plain_cannot_lose`)."""
        if not self._unmeasured_bands() or (None in self.tried and self._plain_cannot_lose()):
            return False
        if self._unmeasured_bands(least=1) or None not in self.tried:
            return True
        _, drafting_seconds, plain_seconds = self._schedule_seconds()
        return not (drafting_seconds and drafting_seconds > (1 + ELIMINATION_MARGIN) * plain_seconds)

    def _plain_cannot_lose(self):
        """Whether no schedule the tries could still find would be chosen over PLAIN (by
        `margin`): with each candidate of the bands PLAIN ran measured, those bands at their
        fastest k (k = 0 at most at PLAIN's speed), even with the other bands free, do not
        beat PLAIN's whole rollout at most (those bands at their k = 0 speed, which PLAIN's
        idle draft beats) by `margin`. A band a try reaches now and then (a few sequences
        ending early) opens candidates of its own, but cannot buy back a loss in the bands
        that hold the tokens; False where such a band never ran k = 0."""
        plain, no_draft = self.band_speeds(PLAIN), self.band_speeds(0)
        if any(tokens and plain[band] and self._unmeasured(band, least=1) for band, tokens in enumerate(self.band_tokens)):
            return False  # a k not yet tried where the tokens are may still beat PLAIN
        _, drafting_seconds, plain_seconds = self._schedule_seconds()
        for band, tokens in enumerate(self.band_tokens):
            if tokens and not plain[band]:
                if not no_draft[band]:
                    return False
                plain_seconds += tokens / no_draft[band]
        return bool(plain_seconds) and (1 + self.margin) * drafting_seconds > plain_seconds

    def _tries_left(self):
        """Whether a try is due (PLAIN or a band's), within `rounds` x (2 + the deepest k) tries."""
        return len(self.tried) < self.rounds * (2 + self.deepest) and (self._plain_due() or self._bands_due())

    def _next_try(self):
        """The next try's schedule: PLAIN (None) where due and the last try was not PLAIN
        (or no band is due); else per band its fewest-measured candidate (the smallest k
        on a tie), or where none is left, the k it would choose now."""
        bands_due = self._bands_due()
        if self._plain_due() and (not bands_due or not self.tried or self.tried[-1] is not None):
            return None
        return [min(due, key=lambda k: (len(self.realized[k][band]), k)) if (due := self._unmeasured(band))
                else self._band_best(band)[0] for band in range(self.num_bands)]

    def band_speeds(self, variant):
        """[each band's fastest tried tokens/s at `variant`, None where it ran no step]."""
        return [max(speeds) if speeds else None for speeds in self.realized[variant]]

    def choose(self):
        """The next rollout's schedule: the next try's (None: PLAIN; else a k per band),
        else the fastest (above) at today's acceptance."""
        if self.trying:
            return self._next_try()
        if self.tried_acceptance is None:
            return None
        return self._fastest_schedule()

    def _band_best(self, band, acceptance=None):
        """(the drafting k fastest in `band`, its tokens/s; k = 0's, at most PLAIN's, without
        another that beats it by `margin`; None where k = 0 never ran there), each speed
        scaled to `acceptance` (default today's) after the tries."""
        no_draft = self.band_speeds(0)[band] if 0 in self.realized else None
        plain = self.band_speeds(PLAIN)[band] if PLAIN in self.realized else None
        if no_draft and plain:
            # k = 0 does PLAIN's work and more (the draft layer's forward, the verify path):
            # faster only by noise or against a PLAIN try that met cold shapes first.
            no_draft = min(no_draft, plain)
        best, best_speed = 0, no_draft
        for k in (variant for variant in self.realized if variant not in (PLAIN, 0)):
            speed = self.band_speeds(k)[band]
            if speed is None or best_speed is None:
                continue
            if self.tried_acceptance is not None:
                speed *= self.tokens_per_step(k, acceptance) / self.tokens_per_step(k, self.tried_acceptance)
            if speed >= (1 + self.margin) * no_draft and speed > best_speed:
                best, best_speed = k, speed
        return best, best_speed

    def _schedule_seconds(self, acceptance=None):
        """(each band's fastest drafting k, _band_best's; the tries' tokens at those k's
        speeds and at PLAIN's, in seconds, over the bands both ran)."""
        plain = self.band_speeds(PLAIN)
        schedule, drafting_seconds, plain_seconds = [], 0.0, 0.0
        for band in range(self.num_bands):
            best, best_speed = self._band_best(band, acceptance)
            schedule.append(best)
            if self.band_tokens[band] and best_speed and plain[band]:
                drafting_seconds += self.band_tokens[band] / best_speed
                plain_seconds += self.band_tokens[band] / plain[band]
        return schedule, drafting_seconds, plain_seconds

    def _fastest_schedule(self, acceptance=None):
        """Per band the fastest drafting k (its speed scaled to `acceptance`, default
        today's), where the bands' rollout time beats PLAIN's; else None."""
        schedule, drafting_seconds, plain_seconds = self._schedule_seconds(acceptance)
        schedule = _fill_unseen(schedule, [speed is not None for speed in self.band_speeds(0)])
        if not any(schedule) or plain_seconds < (1 + self.margin) * drafting_seconds:
            return None
        return schedule

    def plan(self, step, check, check_every, tune_every, drafting):
        """Before rollout `step` (1-based): returns (the rollout's schedule, None: the plain
        engine, else a k per band; the check's statistics or None).

        Outside the tries: while the last rollout did not draft (`drafting` False), at a
        run's first plan and, without the trainer's estimates, every `check_every` steps
        `check()` measures the acceptance at the deepest k; at the first plan, every
        `tune_every` steps and once the acceptance moved far, the tries begin
        (`try_each`). `exploring()` after it says whether this rollout is a try
        (`after_rollout` then needs its band counts).
        """
        checked = None
        first = self.tried_tokens_per_step is None
        if not self.exploring():
            if not drafting and (first or (not self.estimated and (step - 1) % check_every == 0)):
                checked = check()
                self.observe(checked)
            if first or ((step - 1) % tune_every == 0 or self.is_stale()) and self.could_pay:
                self.try_each()
        return self.choose(), checked

    def after_rollout(self, schedule, band_counts, statistics):
        """After a rollout at the schedule `plan` named: its {band: (tokens, seconds)} (a
        try's; ignored outside the tries) and its acceptance statistics (None without
        drafting)."""
        if self.exploring():
            self.record(band_counts)
        self.drafted = schedule is not None and any(schedule)
        if self.drafted:
            self.observe(statistics)
        if not self.exploring():
            self.could_pay = self._could_pay(band_counts)

    def _could_pay(self, band_counts):
        """Whether a schedule could beat PLAIN by `margin` on a rollout of these {band:
        (tokens, seconds)} at today's acceptance, each band's speed at k estimated from its
        tries: a verify step at k costs k = 0's step plus k drafts, each draft what the
        deepest k tried there added over k = 0 (MIN_DRAFT_COST of a step where no k > 0
        ran), and emits 1 + A_1 + ... + A_k tokens now; every estimate given
        ELIMINATION_MARGIN of room for the machine's drift since. Where even that loses,
        neither the period nor a rise of the acceptance can make a try pay. True where a
        band lacks PLAIN's or k = 0's speed (nothing to judge it by)."""
        if self.tried_acceptance is None or PLAIN not in self.realized or 0 not in self.realized:
            return True
        plain, no_draft = self.band_speeds(PLAIN), self.band_speeds(0)
        best_seconds = plain_seconds = 0.0
        for band, (tokens, _) in band_counts.items():
            if not tokens:
                continue
            if not plain[band] or not no_draft[band]:
                return True
            step_cost, draft_cost = 1 / no_draft[band], MIN_DRAFT_COST / no_draft[band]
            tried = [k for k in self.realized if k not in (PLAIN, 0) and self.band_speeds(k)[band]]
            if tried:
                deepest = max(tried)
                cost = self.tokens_per_step(deepest, self.tried_acceptance) / self.band_speeds(deepest)[band]
                draft_cost = max(0.0, cost - step_cost) / deepest
            best = max(self.tokens_per_step(k) / (step_cost + k * draft_cost) for k in range(1, self.max_tokens + 1))
            best_seconds += tokens / max(plain[band], (1 + ELIMINATION_MARGIN) * best)
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
        # A state saved while the search climbed one k at a time kept each band's deepest.
        self.opened = [list(range(opened + 1)) if isinstance(opened, int) else opened for opened in self.opened]

    _STATE = ("max_tokens", "num_bands", "margin", "retry", "rounds", "acceptance", "tried_tokens_per_step",
              "trying", "deepest", "candidates", "opened", "tried", "realized", "band_tokens", "tried_acceptance",
              "measured", "drafted", "estimated", "could_pay")


def _fill_unseen(schedule, seen):
    """Bands the tries never ran take the k of the nearest band they ran (the fewer
    sequences side on a tie); all 0 where they ran none."""
    seen_bands = [band for band, ran in enumerate(seen) if ran]
    if not seen_bands:
        return [0] * len(schedule)
    return [schedule[band] if seen[band] else schedule[min(seen_bands, key=lambda s: (abs(s - band), s))]
            for band in range(len(schedule))]
