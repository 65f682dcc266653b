"""How many tokens the MTP head drafts per verify step: chosen from the rollouts' own speed.

Drafting pays when the target is deep next to its draft and the batch is small; at high
concurrency verifying drafts costs as much as it saves, and a draft the policy has moved
away from only costs. So the number of draft tokens k (0 = no drafting) is measured, not
assumed, and measured on the rollouts themselves: short timing rollouts mislead (on a
shared machine a burst of load slows a short rollout whole, and at temperature 1 a few
sequences sampled off what the draft predicts make one short rollout far slower than the
next), while a few real rollouts taking turns over k measure each to a few percent.

    tuner = DraftTuner(max_tokens=3)
    for step in steps:
        k, checked = tuner.plan(step, check, check_every=5, tune_every=50, drafting=k > 0)
        ...roll out at k (0: no drafting), timing it...
        tuner.after_rollout(k, tokens_per_second, acceptance)

A_i = P(the first i drafts of a verify step are accepted) moves with the policy and its
MTP head every step: it is read from the engine's acceptance counts after each drafting
rollout and, while nothing drafts, from a small check at the deepest k every few steps
(`check`, the caller's: it rolls a few prompts out at the deepest k and returns their
statistics). A draft the policy leaves behind stops being used at the next rollout, and
once A_i moved far the k are tried again. Where two k run within a few percent of each
other, two runs of one seed can choose differently; the tuner's state is plain data for
checkpoints, so a resumed run continues with it.

Statistics are the dicts spec_config.SpecDecodeMeter.read returns (num_drafts,
num_draft_tokens, accepted_per_position, ...). Imports the standard library only.
"""

import math


def acceptance_by_depth(statistics):
    """[A_1, ..., A_k] from `SpecDecodeMeter.read`'s statistics: A_i = P(the first i drafts
    of a verify step are accepted) (acceptance stops at the first rejection, so draft i
    accepted means all before it were), k the drafts per verify step (vLLM reports every
    position the engine could draft); [] without verify steps."""
    if not statistics or not statistics["num_drafts"]:
        return []
    depth = statistics["num_draft_tokens"] // statistics["num_drafts"]
    return [count / statistics["num_drafts"] for count in statistics["accepted_per_position"][:depth]]


# DraftTuner: each k tried on this many rollouts (in turns), its fastest counting (one
# rollout's speed differs from the next by about 5%, and a burst of load slows one of
# them); and the least a drafted token costs, as a share of a target step (one MTP layer
# next to a 16-layer target costs more): a k whose drafts add fewer tokens per step is not
# tried.
TRY_ROUNDS = 3
MIN_DRAFT_COST = 0.05
# The acceptance check (while no rollout drafts): its new tokens (a few verify steps at the
# deepest k) and prompts per engine (each with the rollout's completions per prompt).
ACCEPTANCE_CHECK_TOKENS = 12
ACCEPTANCE_CHECK_PROMPTS = 2


class DraftTuner:
    """Chooses the number of draft tokens k in 0..max_tokens whose rollouts run fastest.

    `plan` and `after_rollout` (above in the module docstring) are the whole use; inside
    them: `observe` takes a drafting rollout's or check's acceptance, `try_each` lines up
    the tries, `choose` names each rollout's k and `record` takes a try's tokens/s.

    `try_each` lines up the next rollouts: k = 0 and every k that could pay, `rounds` each
    in turn (0, 1, 2, 3, 0, 1, 2, 3, ...); `choose` names the k of each, `record` takes its
    tokens/s. Each k counts its fastest try (a burst of load slows one rollout, not the
    choice), and the fastest k stays; drafting must beat no drafting by `margin` (a
    fraction), so noise does not buy a slower rollout. Which rollouts are tries depends on
    the acceptance alone: where one k wins clearly, a run is as reproducible as with a
    fixed k. A k could pay only where a verify step's tokens (1 + A_1 + ... + A_k, A_i the
    acceptance at depth i) are at least 1 + margin times its cost with each draft at
    MIN_DRAFT_COST of a step (1 + k x MIN_DRAFT_COST): a random draft is not tried. Between
    tries a rollout's speed at k follows the tokens its steps emit, so the chosen k's tried
    speed is scaled by 1 + A_1 + ... + A_k now over then: where that falls below no
    drafting's (a draft the policy left behind) the next rollout does not draft. `retry` (a
    fraction): the tries are stale once the tokens a deepest-k step emits rose this much
    since they ended (or fell this much while drafting). Its state is plain data
    (`state_dict`, `load_state_dict`) for checkpoints.
    """

    def __init__(self, max_tokens, margin=0.03, retry=0.25, rounds=TRY_ROUNDS):
        for name, value in (("max_tokens", max_tokens), ("rounds", rounds)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r}: expected an int >= 1")
        self.max_tokens, self.margin, self.retry, self.rounds = max_tokens, margin, retry, rounds
        self.acceptance = [0.0] * max_tokens  # [A_1, ..., A_max]
        self.tried_tokens_per_step = None  # 1 + A_1 + ... + A_max when the tries ended (began, while they run)
        self.schedule = []  # the k of the rollouts still to try, in order
        self.realized = [[] for _ in range(max_tokens + 1)]  # tokens/s of the tries at each k
        # The k the tries chose, and 1 + A_1 + ... + A_k when they ended.
        self.chosen, self.chosen_tokens_per_step = 0, 1.0

    def tokens_per_step(self, draft_tokens):
        """1 + A_1 + ... + A_k: the tokens a verify step at k = `draft_tokens` emits on average."""
        return 1 + sum(self.acceptance[:draft_tokens])

    def observe(self, statistics):
        """Take the acceptance of a rollout or check that drafted k tokens: A_1..A_k are
        replaced, deeper ones (from an earlier, deeper measurement) are capped at A_k."""
        measured = acceptance_by_depth(statistics)[:self.max_tokens]
        if not measured:
            return
        self.acceptance[:len(measured)] = measured
        for depth in range(len(measured), self.max_tokens):
            self.acceptance[depth] = min(self.acceptance[depth], measured[-1])

    def try_each(self):
        """Line up the tries of k = 0 and every k that could pay at the current acceptance
        (none where no drafting k could: then k = 0)."""
        candidates = [0] + [k for k in range(1, self.max_tokens + 1)
                            if self.tokens_per_step(k) >= (1 + self.margin) * (1 + k * MIN_DRAFT_COST)]
        self.schedule = candidates * self.rounds if len(candidates) > 1 else []
        self.realized = [[] for _ in range(self.max_tokens + 1)]
        self.tried_tokens_per_step = self.tokens_per_step(self.max_tokens)
        self.chosen, self.chosen_tokens_per_step = 0, 1.0

    def exploring(self):
        """Whether the next rollouts are tries (at the k `choose` names, for `record`)."""
        return bool(self.schedule)

    def is_stale(self):
        """Whether the acceptance moved so far since the tries began that their choice may
        no longer hold: up by more than `retry` (a k that lost may win now), or down by more
        while a drafting k was chosen (fewer drafts may be best now). Down while nothing
        drafts is not: a k that lost at the tries' acceptance loses at a lower one."""
        if self.tried_tokens_per_step is None:
            return False
        moved = self.tokens_per_step(self.max_tokens) / self.tried_tokens_per_step - 1
        return moved > self.retry or (self.chosen > 0 and -moved > self.retry)

    def record(self, draft_tokens, tokens_per_second):
        """The tokens/s of a rollout at `draft_tokens`, the k `choose` named. Outside the tries
        nothing is kept: the machine's speed drifts over minutes, so only rollouts taking
        turns are compared."""
        if not self.schedule:
            return
        if draft_tokens != self.schedule[0]:
            raise ValueError(f"draft_tokens={draft_tokens!r}: expected {self.schedule[0]}, the k choose() named for "
                             "this rollout")
        if not (isinstance(tokens_per_second, (int, float)) and tokens_per_second > 0
                and math.isfinite(tokens_per_second)):
            raise ValueError(f"tokens_per_second={tokens_per_second!r}: expected a positive finite speed")
        self.realized[self.schedule.pop(0)].append(tokens_per_second)
        if not self.schedule:  # k = 0 was tried first: every speed is relative to its
            speeds = self.realized_speeds()
            best = max(range(len(speeds)), key=lambda k: speeds[k] or 0.0)
            self.chosen = best if speeds[best] >= 1 + self.margin else 0
            self.chosen_tokens_per_step = self.tokens_per_step(self.chosen)
            # The tries' drafting rollouts measured the acceptance as they went: staleness
            # counts from where they left it.
            self.tried_tokens_per_step = self.tokens_per_step(self.max_tokens)

    def realized_speeds(self):
        """[each k's fastest try relative to k = 0's, None where not tried], None before k = 0's."""
        if not self.realized[0]:
            return None
        return [max(speeds) / max(self.realized[0]) if speeds else None for speeds in self.realized]

    def choose(self):
        """The k of the next rollout: the next try, else the fastest tried (0 where nothing
        was tried, or the acceptance since scales it below no drafting)."""
        if self.schedule:
            return self.schedule[0]
        if not self.chosen:
            return 0
        scaled = self.realized_speeds()[self.chosen] * self.tokens_per_step(self.chosen) / self.chosen_tokens_per_step
        return self.chosen if scaled >= 1 else 0

    def plan(self, step, check, check_every, tune_every, drafting):
        """Before rollout `step` (1-based): returns (k, the check's statistics or None).

        Outside the tries: while the last rollout did not draft (`drafting` False), at a
        run's first plan and every `check_every` steps `check()` measures the acceptance at
        the deepest k; at the first plan, every `tune_every` steps and once the acceptance
        moved far, the next rollouts try each k that could pay in turn. `exploring()`
        after it says whether this rollout is a try (`after_rollout` then needs its speed).
        """
        checked = None
        first = self.tried_tokens_per_step is None
        if not self.exploring():
            if not drafting and (first or (step - 1) % check_every == 0):
                checked = check()
                self.observe(checked)
            if first or (step - 1) % tune_every == 0 or self.is_stale():
                self.try_each()
        return self.choose(), checked

    def after_rollout(self, draft_tokens, tokens_per_second, statistics):
        """After a rollout at the k `plan` named: its tokens/s (a try's speed; None outside
        the tries) and its acceptance statistics (None without drafting)."""
        if self.exploring():
            self.record(draft_tokens, tokens_per_second)
        if draft_tokens:
            self.observe(statistics)

    def state_dict(self):
        return {name: getattr(self, name) for name in self._STATE}

    def load_state_dict(self, state):
        if state["max_tokens"] != self.max_tokens:
            raise ValueError(f"a tuner state for max_tokens {state['max_tokens']}, this tuner has {self.max_tokens}")
        for name in self._STATE:
            setattr(self, name, state[name])

    _STATE = ("max_tokens", "margin", "retry", "rounds", "acceptance", "tried_tokens_per_step", "schedule", "realized",
              "chosen", "chosen_tokens_per_step")
