"""How a response is scored against its example's answer: exact (or numeric) match for data
files, `--reward math`, and your own `--reward FILE.py:FUNCTION`, loaded, tried and called.

    exact_match_reward(" 72", "72.0")                            # data files: 1.0, a numeric match
    math_reward("The answer is 1/2.", "\\frac{1}{2}")            # --reward math: 1.0
    try_reward("my_reward.py:score", example)                    # once, before any work
    credit = reward_credit("my_reward.py:score", timeout_s=300)  # --reward's scorer
    credits = credit(sample)                                     # [floats]: per token or one

Rewards: `--reward math` compares the response's final answer with the example's as
mathematics (math-verify: "#### 72", "1,000", "3/4", "\\frac{3}{4}", "\\boxed{\\sqrt{2}}"); a
"FILE.py:FUNCTION" is your own, checked when it loads (`load_reward_function`), tried once
on an example before any work (`try_reward`), then called on a thread under
`--reward-timeout` (`call_reward`), its value checked (`reward_values`).

Every refusal is an `InputError` (a ValueError; tasks.py raises it too) whose message
names the file, function, prompt, response or value and what was expected. Imports the
standard library only (math-verify for --reward math, when used).
"""

import functools
import importlib.util
import inspect
import math
import multiprocessing
import numbers
import os
import threading
import time

NUMERIC_TOLERANCE = 1e-6
# --reward-timeout's default: a local reward returns in well under a second, a remote judge
# within a minute or two even with retries; one past five minutes is stuck.
REWARD_TIMEOUT_S = 300.0

# --reward math: the response's final answer against the example's, compared as mathematics
# by math-verify (Hugging Face's verifier, the one verl, NeMo-RL and TRL score math with).
MATH_REWARD = "math"
GSM8K_ANSWER_MARK = "####"  # GSM8K's solutions end "#### 72"; models trained on them answer so too
# math-verify's own limits on each parse and each comparison (its defaults, and verl's):
# sympy can work for ever on a response such as 9^{9^{9^{9}}}, and a reward must not hang.
MATH_PARSE_TIMEOUT_S = 5
MATH_VERIFY_TIMEOUT_S = 5
# Off the main thread math-verify's timeouts (signal.alarm) cannot work, so the call runs in
# a worker process, killed past this deadline: the worst case of the limits above there
# (two parses; gold and response each parse to [expression, string]: four comparisons),
# and 10 s more for the round trip.
MATH_WORKER_DEADLINE_S = 2 * MATH_PARSE_TIMEOUT_S + 4 * MATH_VERIFY_TIMEOUT_S + 10
# The worker's first start (a fresh interpreter importing math-verify and the caller's main
# module) is not part of any call's deadline; a worker that cannot start in this long is broken.
MATH_WORKER_START_S = 300


class InputError(ValueError):
    """Bad data, prompts or reward; the message names the offending value."""


def exact_match_reward(response, answer):
    """Data files: exact match, or numeric match when the answer is a number (equal
    infinities match; NaN matches nothing); 0.0 or 1.0."""
    response = response.strip()
    try:
        number, expected = float(response), float(answer)
        return float(number == expected or abs(number - expected) <= NUMERIC_TOLERANCE)
    except ValueError:
        return float(response == answer.strip())


def final_answer_text(text):
    """The part of `text` that holds its final answer: the line after its last "####"
    (GSM8K's solutions, and models trained on them), else all of it. Only that line: a
    model that goes on after its answer (a new "Question: ...") does not change it."""
    _, mark, tail = text.rpartition(GSM8K_ANSWER_MARK)
    return tail.strip().split("\n", 1)[0] if mark else text


def gold_latex(answer):
    """An example's answer as the LaTeX math-verify extracts it from: a boxed answer as it
    is (MATH's solutions box theirs); anything else (GSM8K's "#### 72" tail, a number, a
    fraction, a LaTeX expression) boxed, as verl and NeMo-RL do, so it parses as one
    expression ("1,000" is a thousand, not a list)."""
    answer = final_answer_text(answer)
    return answer if "\\boxed" in answer else f"\\boxed{{{answer}}}"


def _math_match(response, answer):
    # math-verify in this thread, with its signal-based timeouts: the main thread only.
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify
    from math_verify.errors import TimeoutException
    try:
        gold = parse(gold_latex(answer), [LatexExtractionConfig()], parsing_timeout=MATH_PARSE_TIMEOUT_S)
        # A response may answer in plain text ("The answer is 1/2.") or in LaTeX
        # ("\boxed{\frac{1}{2}}"): both extractions, plain first, as verl and NeMo-RL do.
        predicted = parse(final_answer_text(response), [ExprExtractionConfig(), LatexExtractionConfig()],
                          parsing_timeout=MATH_PARSE_TIMEOUT_S)
        return float(bool(gold) and verify(gold, predicted, timeout_seconds=MATH_VERIFY_TIMEOUT_S))
    except (Exception, TimeoutException):
        # math-verify turns its own errors into "no answer", but its TimeoutException (a
        # BaseException) escapes when the alarm fires just as a step ends, and sympy can
        # raise on a strange expression: a response that breaks the parser scores 0.
        return 0.0


_math_pool = None  # the worker process of off-main-thread calls, started on first use
_math_pool_lock = threading.Lock()


def _math_worker():
    # The worker, started (and waited for) on first use. Spawned, not forked: a fork of a
    # process running torch's and vLLM's threads can deadlock on a lock one of them held.
    global _math_pool
    with _math_pool_lock:
        if _math_pool is None:
            pool = multiprocessing.get_context("spawn").Pool(1)
            try:
                pool.apply_async(_math_match, ("1", "1")).get(MATH_WORKER_START_S)
            except multiprocessing.TimeoutError:
                pool.terminate()
                raise RuntimeError(f"--reward {MATH_REWARD}: its worker process did not start in "
                                   f"{MATH_WORKER_START_S} s; expected a fresh Python to import math_verify and "
                                   "this program's main module") from None
            _math_pool = pool
        return _math_pool


def _math_match_in_worker(response, answer):
    # math_reward from a thread that is not the main one: scored in the worker process's main
    # thread (where math-verify's timeouts work); a worker past its deadline is killed (0.0).
    global _math_pool
    pool = _math_worker()
    try:
        return pool.apply_async(_math_match, (response, answer)).get(MATH_WORKER_DEADLINE_S)
    except multiprocessing.TimeoutError:
        with _math_pool_lock:
            pool.terminate()
            if _math_pool is pool:
                _math_pool = None
        return 0.0


def math_reward(response, answer):
    """--reward math: 1.0 when the response's final answer equals the example's answer as
    mathematics (math-verify: 72 = 72.0 = "1,000" / 1000 = 1/2 = 0.5 = \\frac{1}{2}), else 0.0.

    answer: GSM8K's solution ("... #### 72", the tail is the answer), a bare number or
    fraction, a LaTeX expression, or a solution with its answer in \\boxed{...}.
    response: the model's text; its answer is the line after its last "####", else what
    math-verify finds ("The answer is 72.", \\boxed{...}, the last number). A response or an
    answer that does not parse, or takes longer than math-verify's limits, scores 0.0. Safe
    from any thread: off the main thread it runs in a spawned worker process, which imports
    the program's main module as any spawned process does (keep its work under
    `if __name__ == "__main__":`).
    """
    if threading.current_thread() is threading.main_thread():
        return _math_match(response, answer)
    return _math_match_in_worker(response, answer)


def _math_reward_function(prompt, response, answer):
    # math_reward as a --reward function is called: (prompt, response, answer).
    return math_reward(response, answer)


def load_reward_function(spec):
    """--reward's spec -> its function, called function(prompt, response, answer):
    MATH_REWARD ("math") gives math_reward's, once math-verify is found; "FILE.py:FUNCTION"
    the function, after checking that the file exists and imports, that FUNCTION exists
    there, and that it takes (prompt, response, answer). Raises InputError naming the file
    and the function."""
    if spec == MATH_REWARD:
        if importlib.util.find_spec("math_verify") is None:
            raise InputError(f"--reward {MATH_REWARD}: the math-verify package is not installed; expected it "
                             "importable (pip install math-verify==0.9.0)")
        return _math_reward_function
    path, _, name = spec.rpartition(":")
    if not path or not name:
        raise InputError(f"--reward {spec!r}: expected FILE.py:FUNCTION or {MATH_REWARD}")
    if not os.path.isfile(path):
        raise InputError(f"--reward {spec!r}: no such file {path!r}")
    module_spec = importlib.util.spec_from_file_location(f"reward_{os.path.basename(path).rsplit('.', 1)[0]}", path)
    if module_spec is None:
        raise InputError(f"--reward {spec!r}: {path!r} is not a Python file")
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except Exception as error:
        raise InputError(f"--reward {spec!r}: {path} does not import ({type(error).__name__}: {error})") from error
    function = getattr(module, name, None)
    if not callable(function):
        raise InputError(f"--reward {spec!r}: {path} has no function {name!r}")
    try:
        inspect.signature(function).bind("prompt", "response", "answer")
    except TypeError as error:
        raise InputError(f"--reward {spec!r}: {name}{inspect.signature(function)} cannot be called as "
                         f"{name}(prompt, response, answer) ({error})") from None
    return function



def reward_credit(reward_spec, timeout_s=REWARD_TIMEOUT_S, interrupted=None):
    """--reward's scorer: credit(sample) -> [floats], one per response token or a single one.

    sample: {example: {prompt, answer}, response_ids, text}. `reward_spec`: MATH_REWARD or
    "FILE.py:FUNCTION" (load_reward_function). A reward that raises (SystemExit included),
    runs past `timeout_s` seconds (0: no limit) or returns anything but finite floats is an
    InputError naming the prompt, the response and the value; `interrupted()` true while it
    runs (a stop signal) is RewardInterrupted.
    """
    reward_function = load_reward_function(reward_spec)
    if reward_spec == MATH_REWARD:
        # math-verify keeps its own deadlines, on the main thread.
        timeout_s = None
    return functools.partial(_user_credits, reward_function, reward_spec, timeout_s, interrupted)


def _user_credits(reward_function, reward_spec, timeout_s, interrupted, sample):
    example, response = sample["example"], sample["text"]
    where = f"--reward {reward_spec} on prompt {str(example['prompt'])[:80]!r}, response {response[:80]!r}"
    value = call_reward(reward_function, (example["prompt"], response, example["answer"]), where, timeout_s,
                        interrupted)
    values = reward_values(value, where)
    if isinstance(value, (list, tuple)) and len(values) != len(sample["response_ids"]):
        raise InputError(f"{where} returned {len(values)} per-token rewards for {len(sample['response_ids'])} "
                         "response tokens; expected one per token or a single float")
    return values


class RewardInterrupted(Exception):
    """A stop signal arrived while a reward function ran: the run stops, the call is abandoned."""


# How often a wait on a reward function looks at the clock and for a stop signal.
REWARD_POLL_S = 0.05


def call_reward(reward_function, args, where, timeout_s=REWARD_TIMEOUT_S, interrupted=None):
    """reward_function(*args), where a run can still stop: on a daemon thread, waited on for
    at most `timeout_s` seconds (None: called here, unguarded; 0: no limit). An exception,
    SystemExit included, or a call past the limit is an InputError naming `where`;
    `interrupted()` turning true while it runs is RewardInterrupted. A call that never
    returns is abandoned on its thread (Python cannot stop a thread), which cannot hold the
    process at exit."""
    outcome = {}

    def call():
        try:
            outcome["value"] = reward_function(*args)
        except (Exception, SystemExit) as error:  # an exit is said, not silent
            outcome["error"] = error
    if timeout_s is None:
        call()
    else:
        worker = threading.Thread(target=call, name="reward", daemon=True)
        deadline = time.monotonic() + timeout_s if timeout_s else math.inf
        worker.start()
        while worker.is_alive():
            worker.join(min(REWARD_POLL_S, max(0.0, deadline - time.monotonic())))
            if worker.is_alive() and interrupted is not None and interrupted():
                raise RewardInterrupted(f"{where}: a stop signal arrived while it ran")
            if worker.is_alive() and time.monotonic() >= deadline:
                raise InputError(f"{where} did not return within --reward-timeout {timeout_s:g} s; stopped (raise "
                                 "--reward-timeout for a slower reward, 0 for no limit)")
    if "error" in outcome:
        error = outcome["error"]
        raise InputError(f"{where} raised {type(error).__name__}: {error}; stopped before the weights changed") \
            from error
    return outcome["value"]


def reward_values(value, where):
    """A reward function's return value as [floats]: a real number (numpy's included) or a
    list of them, each finite; a bool, None, a string or anything else is an InputError."""
    values = list(value) if isinstance(value, (list, tuple)) else [value]
    if not all(isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v) for v in values):
        raise InputError(f"{where} returned {value!r} ({type(value).__name__}); expected a finite float or a list "
                         "of them; stopped before the weights changed")
    return [float(v) for v in values]


def try_reward(reward_spec, example, timeout_s=REWARD_TIMEOUT_S):
    """Call the reward once, before any work, on `example` with its own answer as the
    response: a reward that raises or returns no number is refused now, not at step 1, and
    so is MATH_REWARD on an answer it does not score 1.0 against itself (one math-verify
    cannot parse would score every response 0: a run that learns nothing)."""
    reward_function = load_reward_function(reward_spec)
    where = (f"--reward {reward_spec} on prompt {str(example['prompt'])[:80]!r}, response {example['answer'][:80]!r} "
             "(the example's own answer, tried before any work)")
    value = call_reward(reward_function, (example["prompt"], example["answer"], example["answer"]), where,
                        None if reward_spec == MATH_REWARD else timeout_s)
    if reward_values(value, where) != [1.0] and reward_spec == MATH_REWARD:
        raise InputError(f"{where}: math-verify finds no answer in {example['answer'][-80:]!r} equal to itself; "
                         "expected an answer it parses (a number, a fraction, LaTeX, \\boxed{...} or a solution "
                         f"ending {GSM8K_ANSWER_MARK} N)")
