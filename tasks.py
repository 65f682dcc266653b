"""What the policy is trained on and how it is scored: built-in tasks, data files, rewards.

    examples = load_examples("train.parquet")                 # or task_examples("repeat", ["ab", "ba"])
    train, held_out = split_examples(examples, None, seed=0, task=None)
    check_prompts(train + held_out, tokenizer, max_len=1024, max_new_tokens=64)   # once, before any work
    batch = sample_prompts(train, step=1, count=16, seed=0)   # the same on every rank
    credit = credit_function(tokenizer, task=None)            # exact match; or your reward, or "math"
    credits = credit(sample)                                  # [floats]: per token or one

Built-in tasks (no data file), per-token credit; a random policy over the 128-token
vocabulary earns about 1%:
- repeat: "repeat:ab" -> "aba", a pair of letters from a small alphabet repeated to
  the answer length; a token's credit is 1 where it equals the answer's at its place.
  Each answer token copies the token two back: a random-init model finds the rule by RL
  alone in a few minutes on 2 cores, and answers the held-out pairs it never trained on.
- count: "count:7" -> the next 32 digits counting up mod `count_step`'s steps, "8901...";
  a digit earns its credit when it follows the one before it. Answers long enough to
  draft, on a model deep enough for a draft to be cheap next to a target step.
- walk: "walk:q" -> "rStuVwxYz</s>", the rest of the chain (27 punctuation marks, 0-9,
  a-z) from the symbol after the prompt's, each letter in either case, then the
  end-of-sequence token. Shaped like reasoning RL for drafting: responses end at EOS and
  their lengths are long-tailed (the training pool weighs a start by 1 / its answer's
  length: median 8 tokens, a tenth 41 or longer, at most 63), so a rollout's wall time is
  its few longest responses, decoded at low concurrency; the free choice of case and the
  long walks' rarely trained start keep the policy's entropy (as a reasoning policy's
  phrasing and its uncertain long answers), so a trained MTP head accepts less than
  always. A token earns its credit when it follows the one before it (any case; EOS after
  "z"); docs/RESULTS.md.

Data files: .jsonl or .parquet, in our layout ({"prompt", "answer"}) or verl's (prompt
as chat messages, answer under reward_model.ground_truth); keys are column names or
dotted paths. Prompts are token ids from `prompt_token_ids`: chat messages through the
tokenizer's chat template, so the rollout engine and the trainer see the same tokens.

Rewards: `--reward math` compares the response's final answer with the example's as
mathematics (math-verify: "#### 72", "1,000", "3/4", "\\frac{3}{4}", "\\boxed{\\sqrt{2}}"); a
"FILE.py:FUNCTION" is your own.

Every refusal is an `InputError` (a ValueError) whose message names the file, row, key
or value and what was expected. Imports the standard library only (pyarrow for Parquet,
math-verify for --reward math, when used); the tokenizer is any Hugging Face tokenizer
the caller passes.
"""

import dataclasses
import functools
import importlib.util
import inspect
import json
import math
import multiprocessing
import numbers
import os
import random
import sys
import threading
import time

# The repeat task's prompts are letter pairs: "repeat:ab" -> "aba", the pair repeated to
# the answer length. The pairs held out for evaluation are combinations no training prompt
# has, of letters every training prompt uses (each letter once first, once second): a
# policy that learned the rule (copy the letter two back) answers them, one that memorised
# twenty answers does not.
REPEAT_LETTERS = "abcde"
REPEAT_HELD_OUT = tuple(REPEAT_LETTERS[i] + REPEAT_LETTERS[(i + 2) % len(REPEAT_LETTERS)]
                        for i in range(len(REPEAT_LETTERS)))
# walk's chain: a start symbol's answer is the symbols after it, then EOS. Punctuation
# (no ':' the prompt ends with, no quotes or backslash) leads the digits and letters, so
# the longest answers are 62 symbols while the common short ones are letters. Held out:
# starts whose answers are 2, 5, 11, 23, 30 and 47 symbols long; every symbol still
# appears in the training answers, so a policy that learned the rule walks from them too.
WALK_CHAIN = "!#$%&()*+,-./;<=>?@[]^_{|}~0123456789abcdefghijklmnopqrstuvwxyz"
WALK_HELD_OUT = tuple(WALK_CHAIN[len(WALK_CHAIN) - 1 - length] for length in (2, 5, 11, 23, 30, 47))
WALK_STARTS = tuple(symbol for symbol in WALK_CHAIN[:-1] if symbol not in WALK_HELD_OUT)
# tail's chain: items of a letter and a digit, "n0" .. "z9", each letter in either case. A
# start item's answer is the items after it, then EOS, so the prompt fixes the answer's
# length (two tokens an item and EOS: 3 to 259 tokens), and each token follows from the two
# before it: a digit counts up from the one two back, a letter repeats the one two back or
# moves on after a 9, EOS after "z9" (a rule the deep model learns in a short supervised
# stage). The training pool draws TAIL_POOL_SIZE answer lengths from a lognormal (median
# TAIL_MEDIAN tokens, sigma TAIL_SIGMA), each the nearest trained start's, as real RL's
# response lengths are long-tailed: median 9 tokens, at most 157, the longest tenth holding 38%
# of the tokens (docs/RESULTS.md). Held out: starts whose answers are 7 to 179 tokens long;
# their items all appear inside the training answers.
DIGITS = "0123456789"
TAIL_LETTERS = "nopqrstuvwxyz"
TAIL_CHAIN = tuple(letter + digit for letter in TAIL_LETTERS for digit in DIGITS)
TAIL_MEDIAN = 10
TAIL_SIGMA = 1.0
TAIL_POOL_SIZE = 1000
TAIL_POOL_SEED = 0
TAIL_HELD_OUT = tuple(TAIL_CHAIN[len(TAIL_CHAIN) - 1 - items] for items in (3, 5, 8, 13, 21, 34, 55, 89))
TAIL_STARTS = tuple(item for item in TAIL_CHAIN[:-1] if item not in TAIL_HELD_OUT)
# Each built-in task: the symbols (repeat: letter pairs, count: digits, walk: chain symbols, tail: items)
# its prompts are drawn from, those held out for evaluation (training never samples them),
# the answer length (walk: the longest, EOS included, with room for a few wrong tokens), the
# built-in model (tiny_model.BUILTIN_MODELS) and learning rate it runs with by default (the
# deep model's 16 thin layers learn the count rule in about 60 steps at 1e-3, hardly at
# 3e-4), whether a response ends at its EOS token, and whether RL starts from a supervised
# stage on its answers (warm_start.py: tail's long answers are out of reach of RL from random
# weights in minutes, as real RL starts from a supervised model). count holds out digits its
# training never shows.
TASKS = {
    "repeat": {"train": tuple(first + second for first in REPEAT_LETTERS for second in REPEAT_LETTERS
                              if first + second not in REPEAT_HELD_OUT),
               "held_out": REPEAT_HELD_OUT, "length": 3, "model": "tiny", "lr": 3e-4, "eos": False,
               "warm_start": False},
    "count": {"train": "01234567", "held_out": "89", "length": 32, "model": "deep", "lr": 1e-3, "eos": False,
              "warm_start": False},
    "walk": {"train": WALK_STARTS, "held_out": WALK_HELD_OUT, "length": 67, "model": "deep", "lr": 1e-3,
             "eos": True, "warm_start": False},
    "tail": {"train": TAIL_STARTS, "held_out": TAIL_HELD_OUT, "length": 2 * len(TAIL_CHAIN) + 3, "model": "deep",
             "lr": 3e-4, "eos": True, "warm_start": True},
}
MAX_COUNT_STEP = 9
DATA_FORMATS = (".jsonl", ".parquet")
DEFAULT_PROMPT_KEY = "prompt"
# Where an example's answer lives when no answer key is given: our layout's "answer",
# then verl's (its example preprocessors write reward_model = {style, ground_truth}).
DEFAULT_ANSWER_KEYS = ("answer", "reward_model.ground_truth")
# A data file without a held-out file: this share of it (at most the cap) is held out.
EVAL_HOLDOUT_FRACTION = 0.1
EVAL_HOLDOUT_MAX = 256
NUMERIC_TOLERANCE = 1e-6
# --reward-timeout's default: a local reward returns in well under a second, a remote judge
# within a minute or two even with retries; one past five minutes is stuck.
REWARD_TIMEOUT_S = 300.0
UTF8_BOM = "\ufeff"
# A data file's bad rows named in its refusal; the rest are counted.
MAX_BAD_ROWS_SHOWN = 20
SEED_STRIDE = 1_000_003  # a prime: seeds of (seed, step, engine) never collide in practice


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """What a run trains on and how it is scored, as a trainer passes it to `load_examples`,
    `split_examples`, `try_reward` and `credit_function`."""
    task: str = "repeat"              # TASKS, without a data file: repeat learns in minutes on 2 cores
    count_step: int = 1               # count's step mod 10
    data: str = None                  # a data file of examples; None: the built-in task's
    eval_data: str = None             # held-out examples; None: the task's, or a share of `data`
    prompt_key: str = DEFAULT_PROMPT_KEY
    answer_key: str = None            # None: the first of DEFAULT_ANSWER_KEYS a row has
    reward: str = None                # "FILE.py:FUNCTION" or MATH_REWARD; None: the task's credit, or exact match
    reward_timeout: float = REWARD_TIMEOUT_S


class InputError(ValueError):
    """Bad data, prompts or reward; the message names the offending value."""


def walk_weight(symbol):
    """How many times a walk start sits in the training pool: one per 1 / its answer's
    length, scaled so the longest answer's start sits there once (a long tail of lengths)."""
    longest = len(WALK_CHAIN) - 1
    return round(longest / (longest - WALK_CHAIN.index(symbol)))


def tail_length(item):
    """The tokens of tail's answer from start `item`: two an item after it, and EOS."""
    return 2 * (len(TAIL_CHAIN) - 1 - TAIL_CHAIN.index(item)) + 1


def tail_pool(starts):
    """tail's training pool: TAIL_POOL_SIZE lengths drawn from the lognormal (a fixed seed),
    each the start of `starts` whose answer length is nearest (the shorter on a tie)."""
    rng = random.Random(TAIL_POOL_SEED)
    by_length = sorted(starts, key=tail_length)
    lengths = [rng.lognormvariate(math.log(TAIL_MEDIAN), TAIL_SIGMA) for _ in range(TAIL_POOL_SIZE)]
    return [min(by_length, key=lambda item: abs(tail_length(item) - length)) for length in lengths]


def task_examples(task, symbols, count_step=1, weighted=False):
    """A built-in task's examples, one per symbol (repeat: a letter pair, count: a digit,
    walk: a chain symbol, tail: a chain item; `weighted`: the training pool, walk's each
    start `walk_weight` times, tail's `tail_pool`): [{prompt, answer}] strings."""
    length = TASKS[task]["length"]
    if task == "tail":
        return [{"prompt": f"tail:{item}", "answer": "".join(TAIL_CHAIN[TAIL_CHAIN.index(item) + 1:])}
                for item in (tail_pool(symbols) if weighted else symbols)]
    if task == "walk":
        return [{"prompt": f"walk:{symbol}", "answer": WALK_CHAIN[WALK_CHAIN.index(symbol) + 1:]}
                for symbol in symbols for _ in range(walk_weight(symbol) if weighted else 1)]
    if task == "repeat":
        return [{"prompt": f"repeat:{pair}", "answer": (pair * length)[:length]} for pair in symbols]
    return [{"prompt": f"count:{digit}",
             "answer": "".join(DIGITS[(int(digit) + k * count_step) % 10] for k in range(1, length + 1))}
            for digit in symbols]


def read_rows(path, flag="--data"):
    """[(row number, record)] of a .jsonl or .parquet file; numbers are 1-based (a JSONL
    file's line numbers: blank lines are skipped but counted). A JSONL row that is not UTF-8
    JSON is an InputError in place of its record: `load_examples` names every bad row."""
    if path.endswith(".parquet"):
        import pyarrow  # only a Parquet file needs it
        import pyarrow.parquet
        try:
            return list(enumerate(pyarrow.parquet.read_table(path).to_pylist(), 1))
        except (pyarrow.ArrowException, OSError) as error:
            raise InputError(f"{flag} {path}: not a Parquet file pyarrow can read ({error}); expected a .parquet "
                             "table (a JSON-lines file is read as .jsonl)") from None
    rows = []
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                rows.append((number, InputError(f"{flag} {path}: row {number} is not UTF-8 text (byte "
                                                f"{raw[error.start]:#04x} at column {error.start + 1}); expected UTF-8 "
                                                "JSON lines")))
                continue
            if number == 1:
                line = line.removeprefix(UTF8_BOM)  # an editor's "UTF-8 with BOM"
            if not line.strip():
                continue
            try:
                rows.append((number, json.loads(line)))
            except json.JSONDecodeError as error:
                rows.append((number, InputError(f"{flag} {path}: row {number} is not JSON ({error.msg})")))
    return rows


ABSENT = object()  # `lookup`'s answer for a key a record does not have (None is a JSON null)


def lookup(record, key):
    """`record`'s value under `key`, a column name or a dotted path into nested dicts
    ("reward_model.ground_truth"); ABSENT when there is none."""
    if key in record:
        return record[key]
    value = record
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return ABSENT
        value = value[part]
    return value


def is_chat(prompt):
    """Whether `prompt` is a list of chat messages ({role, content} dicts of strings)."""
    return isinstance(prompt, list) and len(prompt) > 0 and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in prompt)


def load_examples(path, prompt_key=DEFAULT_PROMPT_KEY, answer_key=None, flag="--data"):
    """[{prompt, answer, source, row}] from a .jsonl or .parquet file, in our layout ({"prompt",
    "answer"}) or verl's (prompt as chat messages, the answer under reward_model.ground_truth).

    prompt: a string, or a list of {role, content} messages (templated at tokenization);
    answer: a string (a NaN is refused); source ("FLAG FILE") and row (1-based) name the
    example in later messages. `answer_key` None tries DEFAULT_ANSWER_KEYS in order. Bad
    rows are one InputError naming each (up to MAX_BAD_ROWS_SHOWN, then how many more):
    `flag`, the file, its row number and the key.
    """
    answer_keys = DEFAULT_ANSWER_KEYS if answer_key is None else (answer_key,)
    examples, problems = [], []
    for number, record in read_rows(path, flag):
        try:
            if isinstance(record, InputError):
                raise record
            prompt, answer = _prompt_and_answer(record, f"{flag} {path}: row {number}", prompt_key, answer_keys)
            examples.append({"prompt": prompt, "answer": answer, "source": f"{flag} {path}", "row": number})
        except InputError as error:
            problems.append(str(error))
    if len(problems) > 1:
        shown = problems[:MAX_BAD_ROWS_SHOWN] + ([f"and {len(problems) - MAX_BAD_ROWS_SHOWN} more bad rows"]
                                                 if len(problems) > MAX_BAD_ROWS_SHOWN else [])
        raise InputError("\n  ".join([f"{flag} {path}: {len(problems)} bad rows:"] + shown))
    if problems:
        raise InputError(problems[0])
    if not examples:
        raise InputError(f"{flag} {path}: no examples")
    return examples


def _prompt_and_answer(record, where, prompt_key, answer_keys):
    # (prompt, answer as a string) of one row, or an InputError naming it (`where`: "FLAG FILE: row N").
    if not isinstance(record, dict):
        raise InputError(f"{where} is {type(record).__name__}, expected an object of named fields")
    prompt = lookup(record, prompt_key)
    if prompt is ABSENT:
        raise InputError(f"{where} has no key {prompt_key!r} (--prompt-key)")
    if not isinstance(prompt, str) and not is_chat(prompt):
        raise InputError(f"{where}: {prompt_key!r} is {str(prompt)[:80]!r}; expected a string or a list of "
                         "{role, content} chat messages")
    if not (prompt.strip() if isinstance(prompt, str) else any(m["content"].strip() for m in prompt)):
        raise InputError(f"{where}: {prompt_key!r} is empty; expected a prompt with some text")
    key, answer = next(((key, value) for key, value in ((key, lookup(record, key)) for key in answer_keys)
                        if value is not ABSENT), (None, ABSENT))
    if answer is ABSENT:
        raise InputError(f"{where} has no key {' nor '.join(map(repr, answer_keys))} (--answer-key)")
    if answer is None:
        raise InputError(f"{where}: {key!r} is null; expected a string or a number as the answer")
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        raise InputError(f"{where}: answer {str(answer)[:80]!r} is {type(answer).__name__}; expected a string "
                         "or a number")
    if isinstance(answer, float) and math.isnan(answer):
        raise InputError(f"{where}: {key!r} is NaN, which no response can equal; expected a string or a number")
    return prompt, str(answer)


def split_examples(examples, eval_examples, seed, task, count_step=1):
    """(training pool, held-out set). A built-in task (examples None) trains on its "train"
    symbols and holds out its "held_out" ones (TASKS); data without `eval_examples` holds
    out a fixed, seeded EVAL_HOLDOUT_FRACTION of its examples (at most EVAL_HOLDOUT_MAX),
    which training never samples."""
    if examples is None:
        return (task_examples(task, TASKS[task]["train"], count_step, weighted=True),
                task_examples(task, TASKS[task]["held_out"], count_step))
    if eval_examples is not None:
        _refuse_mixed_layouts(examples, eval_examples)
        return examples, eval_examples
    if len(examples) < 2:
        raise InputError(f"--data has {len(examples)} example; expected at least 2 to hold some out for "
                         "evaluation, or pass --eval-data")
    order = list(range(len(examples)))
    random.Random(seed).shuffle(order)
    held_out = max(1, min(EVAL_HOLDOUT_MAX, round(EVAL_HOLDOUT_FRACTION * len(examples))))
    return [examples[i] for i in sorted(order[held_out:])], [examples[i] for i in sorted(order[:held_out])]


def _refuse_mixed_layouts(examples, eval_examples):
    # Chat prompts are templated and string prompts are not: an eval set in the other
    # layout would measure the policy on prompts unlike those it trains on.
    layouts = [{is_chat(e["prompt"]) for e in pool} for pool in (examples, eval_examples)]
    if layouts[0].isdisjoint(layouts[1]):
        names = ["chat messages (templated)" if chat else "strings (not templated)" for (chat,) in layouts]
        raise InputError(f"{examples[0].get('source', '--data')} has prompts as {names[0]} but "
                         f"{eval_examples[0].get('source', '--eval-data')} as {names[1]}; expected both in one "
                         "layout (ours: \"prompt\" a string; verl's: a list of {role, content} messages)")


def step_seed(seed, step, sampling_round=0):
    """The seed of one step's draw (prompts here, sampling in rollout.seed_engine): round 0
    is a step's first, dynamic sampling's later rounds draw more."""
    first = seed * SEED_STRIDE + step
    return first * SEED_STRIDE + sampling_round if sampling_round else first


def sample_prompts(examples, step, count, seed, sampling_round=0):
    """`count` examples for `step`, drawn from the training pool by a generator seeded by
    (seed, step, sampling round) alone: the same on every rank, and the same after a resume."""
    step_rng = random.Random(step_seed(seed, step, sampling_round))
    return [step_rng.choice(examples) for _ in range(count)]


def prompt_token_ids(tokenizer, prompt):
    """The prompt's token ids, the one tokenization both the rollout engine and the trainer
    see: chat messages through the tokenizer's chat template (with the assistant header
    that opens the reply), a string as vLLM would encode it."""
    if isinstance(prompt, str):
        return tokenizer.encode(prompt)
    return list(tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True,
                                              return_dict=True)["input_ids"])


def check_prompts(examples, tokenizer, max_len, max_new_tokens):
    """Every prompt of a data set or built-in task, once, before any work: refuse chat prompts
    without a chat template, a prompt that encodes to no token (the rollout engine refuses
    it when it is first sampled, maybe hours in) or too long for the context with
    `max_new_tokens` (naming the first such row); warn once (rank 0, on stderr) about
    characters the tokenizer drops from prompts, or can never produce for an answer (exact
    match cannot score it), naming the first such row and the characters. Returns the
    longest prompt's token count."""
    if any(not isinstance(e["prompt"], str) for e in examples) and not tokenizer.chat_template:
        raise InputError(f"--data has chat-message prompts but {tokenizer.name_or_path}'s tokenizer has no chat "
                         "template; expected a checkpoint with one (tokenizer_config.json's chat_template)")
    too_long, dropped, unanswerable, longest = [], [], [], 0
    for example in examples:
        ids = prompt_token_ids(tokenizer, example["prompt"])
        longest = max(longest, len(ids))
        if not ids:
            raise InputError(f"{_named(example)}: the prompt {str(example['prompt'])[:80]!r} encodes to no token "
                             f"with {tokenizer.name_or_path}'s tokenizer; expected text in its vocabulary")
        if len(ids) + max_new_tokens > max_len:
            too_long.append((example, len(ids)))
        text = example["prompt"] if isinstance(example["prompt"], str) else "".join(
            message["content"] for message in example["prompt"])
        dropped.append((example, _lost_characters(tokenizer, text, ids)))
        unanswerable.append((example, _lost_characters(tokenizer, example["answer"])))
    _warn_lost(dropped, tokenizer, "prompt", "drops (the policy never sees them)")
    _warn_lost(unanswerable, tokenizer, "answer", "can never produce (no response can match them exactly)")
    if too_long:
        first, tokens = min(too_long, key=lambda pair: _order(pair[0]))
        raise InputError(f"{len(too_long)} prompt(s) do not fit the context of {max_len} tokens with "
                         f"{max_new_tokens} new tokens (--max-new-tokens); first: {_named(first)}, "
                         f"{str(first['prompt'])[:80]!r} ({tokens} tokens); expected prompts and --max-new-tokens "
                         f"that sum to at most {max_len}")
    return longest


def _lost_characters(tokenizer, text, ids=None):
    # The characters of `text` that its tokens do not decode back to. Whitespace is left
    # out: a byte-level tokenizer without a space token (the built-in one) drops it, which
    # the data format rules document.
    if ids is None:
        ids = tokenizer.encode(text, add_special_tokens=False)
    return "".join(sorted(set(text) - set(tokenizer.decode(ids)) - {c for c in text if c.isspace()}))


def _named(example):
    # "--data FILE: row N", where the example came from a data file.
    return f"{example['source']}: row {example['row']}" if "source" in example else "the built-in task's prompt"


def _order(example):
    # A data file's rows in file order (--data before --eval-data), whichever pool holds them.
    return example.get("source", ""), example.get("row", 0)


def _warn_lost(lost, tokenizer, what, consequence):
    lost = [(example, characters) for example, characters in lost if characters]
    if lost and int(os.environ.get("RANK", "0")) == 0:
        example, characters = min(lost, key=lambda pair: _order(pair[0]))
        print(f"train_grpo.py: warning: {len(lost)} {what}(s) hold characters that {tokenizer.name_or_path}'s "
              f"tokenizer {consequence}; first: {_named(example)}, {characters!r} in {str(example[what])[:80]!r}",
              file=sys.stderr, flush=True)


def token_credits(response_ids, answer_ids):
    """repeat: per-character credit, one per response token (1.0 where it equals the
    answer's token at its place)."""
    return [float(k < len(answer_ids) and token == answer_ids[k]) for k, token in enumerate(response_ids)]


@functools.lru_cache(maxsize=None)
def digit_successors(tokenizer, count_step):
    """{token id of digit d: token id of digit d + count_step mod 10}, each digit a single token.
    Cached: the same for every completion of a run (a tokenizer hashes by identity)."""
    ids = [tokenizer.encode(digit, add_special_tokens=False) for digit in DIGITS]
    if any(len(digit_ids) != 1 for digit_ids in ids):
        raise InputError(f"--task count needs each digit to be one token; {tokenizer.name_or_path}'s tokenizer "
                         f"encodes {DIGITS!r} as {ids}")
    return {ids[d][0]: ids[(d + count_step) % 10][0] for d in range(10)}


def count_credits(start_id, response_ids, successors):
    """count: 1.0 for each response token that is the digit after the token before it (the
    prompt's last token, its digit, before the first): a digit after a wrong one still
    earns its credit, so every position teaches the same rule."""
    previous = [start_id] + response_ids[:-1]
    return [float(successors.get(before) == token) for before, token in zip(previous, response_ids)]


@functools.lru_cache(maxsize=None)
def walk_successors(tokenizer):
    """{token id of a chain symbol (a letter in either case): the ids that earn credit after
    it}: the next symbol in either case, EOS after the last. Cached per tokenizer."""
    def ids(symbol):
        cases = {symbol, symbol.upper()}
        encoded = [tokenizer.encode(case, add_special_tokens=False) for case in sorted(cases)]
        if any(len(case_ids) != 1 for case_ids in encoded):
            raise InputError(f"--task walk needs each of {WALK_CHAIN!r} (and its upper case) to be one token; "
                             f"{tokenizer.name_or_path}'s tokenizer encodes {symbol!r} as {encoded}")
        return {case_ids[0] for case_ids in encoded}
    successors = {}
    for index, symbol in enumerate(WALK_CHAIN):
        after = ids(WALK_CHAIN[index + 1]) if index + 1 < len(WALK_CHAIN) else {tokenizer.eos_token_id}
        successors.update({token: after for token in ids(symbol)})
    return successors


def walk_credits(start_id, response_ids, successors):
    """walk: 1.0 for each response token that may follow the token before it (the prompt's
    last token, its start symbol, before the first); a token after a wrong one still earns
    its credit where it follows that one, as in count."""
    previous = [start_id] + response_ids[:-1]
    return [float(token in successors.get(before, ())) for before, token in zip(previous, response_ids)]


@functools.lru_cache(maxsize=None)
def tail_successors(tokenizer):
    """{(token id two back, token id one back): the ids that earn credit next} for tail's
    rule: a letter (either case) after (letter, digit), the same letter or after a 9 the
    next (EOS after "z9"); the digit after (digit, letter) counts up from it. Cached."""
    def ids(text):
        encoded = [tokenizer.encode(case, add_special_tokens=False) for case in sorted({text, text.upper()})]
        if any(len(case_ids) != 1 for case_ids in encoded):
            raise InputError(f"--task tail needs each of {TAIL_LETTERS + DIGITS!r} (and each letter's upper case) to "
                             f"be one token; {tokenizer.name_or_path}'s tokenizer encodes {text!r} as {encoded}")
        return {case_ids[0] for case_ids in encoded}
    successors = {}
    for index, letter in enumerate(TAIL_LETTERS):
        for digit in DIGITS:
            after_nine = TAIL_LETTERS[index + 1] if index + 1 < len(TAIL_LETTERS) else None
            letter_next = ids(letter) if digit != "9" else ids(after_nine) if after_nine else {tokenizer.eos_token_id}
            successors.update({(two_back, one_back): letter_next for two_back in ids(letter) for one_back in ids(digit)})
            counted = ids(DIGITS[(int(digit) + 1) % 10])
            successors.update({(two_back, one_back): counted for two_back in ids(digit) for one_back in ids(letter)})
    return successors


def tail_credits(prompt_ids, response_ids, successors):
    """tail: 1.0 for each response token that may follow the two tokens before it (the
    prompt's last two, its start item, before the first); a token after a wrong one earns
    its credit where it follows the two before it."""
    tokens = list(prompt_ids[-2:]) + list(response_ids)
    return [float(token in successors.get((tokens[k], tokens[k + 1]), ())) for k, token in enumerate(response_ids)]


def exact_match_reward(response, answer):
    """Data files: exact match, or numeric match when the answer is a number (equal
    infinities match; NaN matches nothing); 0.0 or 1.0."""
    response = response.strip()
    try:
        number, expected = float(response), float(answer)
        return float(number == expected or abs(number - expected) <= NUMERIC_TOLERANCE)
    except ValueError:
        return float(response == answer.strip())


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


def credit_function(tokenizer, task=None, count_step=1, reward_spec=None, timeout_s=REWARD_TIMEOUT_S,
                    interrupted=None):
    """The scorer of a run: credit(sample) -> [floats], one per response token (per-token
    credit) or a single one (a sequence reward).

    sample: {example: {prompt, answer}, prompt_ids, response_ids, text}. `reward_spec`
    (MATH_REWARD, or "FILE.py:FUNCTION"; load_reward_function) wins; else `task`
    ("repeat", "count", "walk", "tail") scores per token; else (a data file) exact match. A user's reward
    that raises (SystemExit included), runs past `timeout_s` seconds (0: no limit) or
    returns anything but finite floats is an InputError naming the prompt, the response
    and the value; `interrupted()` true while it runs (a stop signal) is RewardInterrupted.
    """
    if reward_spec is None:
        if task == "count":
            successors = digit_successors(tokenizer, count_step)
            return lambda sample: count_credits(sample["prompt_ids"][-1], sample["response_ids"], successors)
        if task == "tail":
            successors = tail_successors(tokenizer)
            return lambda sample: tail_credits(sample["prompt_ids"], sample["response_ids"], successors)
        if task == "walk":
            successors = walk_successors(tokenizer)
            return lambda sample: walk_credits(sample["prompt_ids"][-1], sample["response_ids"], successors)
        if task == "repeat":
            # Each answer encoded once, not once per completion (the task has a few dozen).
            answer_ids = functools.lru_cache(maxsize=None)(
                lambda answer: tokenizer.encode(answer, add_special_tokens=False))
            return lambda sample: token_credits(sample["response_ids"], answer_ids(sample["example"]["answer"]))
        return lambda sample: [exact_match_reward(sample["text"], sample["example"]["answer"])]
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
