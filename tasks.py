"""What the policy is trained on and how a run scores it: built-in tasks, data files, prompts.

    examples = load_examples("train.parquet")                 # or task_examples("repeat", ["ab", "ba"])
    train, held_out = split_examples(examples, None, seed=0, task=None)
    check_prompts(train + held_out, tokenizer, max_len=1024, max_new_tokens=64)   # once, before any work
    batch = sample_prompts(train, step=1, count=16, seed=0)   # the same on every rank
    credit = credit_function(tokenizer, task=None)            # exact match; or --reward (rewards.py)
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

The run's scorer (`credit_function`): a built-in task's per-token credit, else rewards.py's
exact match for data files, or the `--reward` it loads (`--reward math`, your FILE.py:FUNCTION).

Every refusal is rewards.py's `InputError` (a ValueError; `tasks.InputError` is the same
class) whose message names the file, row, key or value and what was expected. Imports the
standard library and rewards.py only (pyarrow for Parquet, when used); the tokenizer is
any Hugging Face tokenizer the caller passes.
"""

import dataclasses
import functools
import json
import math
import os
import random
import sys

import rewards
from rewards import InputError

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
# built-in model (tiny_model.BUILTIN_MODELS), learning rate, steps and prompts per step it
# runs with by default (the deep model's 16 thin layers learn the count rule in about 60 steps
# at 1e-3, hardly at 3e-4; tail's supervised start takes 1e-4: Adam's first steps at 3e-4
# undo it, and fewer prompts a step leave its long tail a larger share of the step, as a
# GPU's memory-bound decoding does at any batch), whether a response ends at its EOS token,
# whether RL starts from a supervised stage on its answers (warm_start.py: tail's long
# answers are out of reach of RL from random weights in minutes, as real RL starts from a
# supervised model), the MTP depths its head trains by default (None: one per MTP layer; vLLM
# drafts past the layers with the MTP layer again, on its own outputs, and trained there too
# its drafts are accepted more) and auto's deepest k (None: RolloutConfig's): tail's thin
# tail pays for a fourth draft token (docs/RESULTS.md). count holds out digits its training
# never shows.
TASKS = {
    "repeat": {"train": tuple(first + second for first in REPEAT_LETTERS for second in REPEAT_LETTERS
                              if first + second not in REPEAT_HELD_OUT),
               "held_out": REPEAT_HELD_OUT, "length": 3, "model": "tiny", "lr": 3e-4, "steps": 150,
               "prompts_per_step": 16, "eos": False, "warm_start": False, "mtp_train_depths": None,
               "max_draft_tokens": None},
    "count": {"train": "01234567", "held_out": "89", "length": 32, "model": "deep", "lr": 1e-3, "steps": 150,
              "prompts_per_step": 16, "eos": False, "warm_start": False, "mtp_train_depths": None,
               "max_draft_tokens": None},
    "walk": {"train": WALK_STARTS, "held_out": WALK_HELD_OUT, "length": 67, "model": "deep", "lr": 1e-3,
             "steps": 150, "prompts_per_step": 16, "eos": True, "warm_start": False, "mtp_train_depths": None,
               "max_draft_tokens": None},
    "tail": {"train": TAIL_STARTS, "held_out": TAIL_HELD_OUT, "length": 2 * len(TAIL_CHAIN) + 3, "model": "deep",
             "lr": 1e-4, "steps": 40, "prompts_per_step": 8, "eos": True, "warm_start": True,
             "mtp_train_depths": 4, "max_draft_tokens": 4},
}
MAX_COUNT_STEP = 9
DATA_FORMATS = (".jsonl", ".parquet")
# A --data run's defaults, as TASKS gives each built-in task's. A data file's default
# response limit is short answers (a number); reasoning needs --max-new-tokens.
DATA_LR = 3e-4
DATA_MAX_NEW_TOKENS = 3
DATA_STEPS = 150
DATA_PROMPTS_PER_STEP = 16
DEFAULT_PROMPT_KEY = "prompt"
# Where an example's answer lives when no answer key is given: our layout's "answer",
# then verl's (its example preprocessors write reward_model = {style, ground_truth}).
DEFAULT_ANSWER_KEYS = ("answer", "reward_model.ground_truth")
# A data file without a held-out file: this share of it (at most the cap) is held out.
EVAL_HOLDOUT_FRACTION = 0.1
EVAL_HOLDOUT_MAX = 256
UTF8_BOM = "\ufeff"
# A data file's bad rows named in its refusal; the rest are counted.
MAX_BAD_ROWS_SHOWN = 20
SEED_STRIDE = 1_000_003  # a prime: seeds of (seed, step, engine) never collide in practice


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """What a run trains on and how it is scored, as a trainer passes it to `load_examples`,
    `split_examples`, `rewards.try_reward` and `credit_function`."""
    task: str = "repeat"              # TASKS, without a data file: repeat learns in minutes on 2 cores
    count_step: int = 1               # count's step mod 10
    data: str = None                  # a data file of examples; None: the built-in task's
    eval_data: str = None             # held-out examples; None: the task's, or a share of `data`
    prompt_key: str = DEFAULT_PROMPT_KEY
    answer_key: str = None            # None: the first of DEFAULT_ANSWER_KEYS a row has
    reward: str = None                # "FILE.py:FUNCTION" or "math" (rewards.py); None: the task's credit, or exact match
    reward_timeout: float = rewards.REWARD_TIMEOUT_S


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


def either_case_ids(tokenizer, text, task, alphabet):
    """{the ids of `text` and of its upper case}, each one token; else an InputError saying
    that --task `task` needs each of `alphabet` to be one token."""
    encoded = [tokenizer.encode(case, add_special_tokens=False) for case in sorted({text, text.upper()})]
    if any(len(case_ids) != 1 for case_ids in encoded):
        raise InputError(f"--task {task} needs each of {alphabet!r} (and its upper case) to be one token; "
                         f"{tokenizer.name_or_path}'s tokenizer encodes {text!r} as {encoded}")
    return {case_ids[0] for case_ids in encoded}


@functools.lru_cache(maxsize=None)
def walk_successors(tokenizer):
    """{token id of a chain symbol (a letter in either case): the ids that earn credit after
    it}: the next symbol in either case, EOS after the last. Cached per tokenizer."""
    def ids(symbol):
        return either_case_ids(tokenizer, symbol, "walk", WALK_CHAIN)
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
        return either_case_ids(tokenizer, text, "tail", TAIL_LETTERS + DIGITS)
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


def credit_function(tokenizer, task=None, count_step=1, reward_spec=None, timeout_s=rewards.REWARD_TIMEOUT_S,
                    interrupted=None):
    """The scorer of a run: credit(sample) -> [floats], one per response token (per-token
    credit) or a single one (a sequence reward).

    sample: {example: {prompt, answer}, prompt_ids, response_ids, text}. `reward_spec`
    (rewards.MATH_REWARD, or "FILE.py:FUNCTION"; rewards.reward_credit) wins; else `task`
    ("repeat", "count", "walk", "tail") scores per token; else (a data file) exact match. A user's reward
    that raises (SystemExit included), runs past `timeout_s` seconds (0: no limit) or
    returns anything but finite floats is an InputError naming the prompt, the response
    and the value; `interrupted()` true while it runs (a stop signal) is rewards.RewardInterrupted.
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
        return lambda sample: [rewards.exact_match_reward(sample["text"], sample["example"]["answer"])]
    return rewards.reward_credit(reward_spec, timeout_s, interrupted)
