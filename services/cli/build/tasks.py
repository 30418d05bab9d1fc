"""The tiny tasks' own datasets, written as JSON Lines splits: two-digit addition (``arith``), the calculator
transcripts of ``tool-arith``, the chat word problems of ``word-problems``, and ``long-tail``'s additions of which a
share ask for long answers (``rlpipe build-tiny --task``).
Reading any dataset is services/common/model/datasets.py's job; these only write the built-in ones."""

from __future__ import annotations

import json
import random
from pathlib import Path

from services.common.files import write_atomically

MAX_OPERAND = 99
SPLIT_NAMES = ("train", "dev", "eval")


def _addition_problem(a: int, b: int) -> dict:
    return {"id": f"add-{a:04d}-{b:04d}", "prompt": f"{a}+{b}=", "answer": str(a + b)}


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    """Write ``rows`` whole under ``path`` (write-then-rename): a reader of the same file, such as a test on another
    pytest worker while this one rebuilds the shared test data, sees the old content or the new, never a torn line."""
    data = "".join(json.dumps(row) + "\n" for row in rows).encode("utf-8")
    if path.is_file() and path.read_bytes() == data:
        return
    write_atomically(path, data)


def make_arithmetic_dataset(out_dir: Path, seed: int = 0, n_eval: int = 500, n_dev: int = 300) -> dict[str, Path]:
    """Write every addition a+b (0 <= a, b <= 99) as train/dev/eval JSONL splits.

    The 10,000 problems are shuffled with ``seed``, so the same seed always
    yields the same splits. ``eval`` is held out for measuring the trained
    policy, ``dev`` decides when the supervised warm start stops, and
    ``train`` holds the rest.

    Returns the path of each split file, keyed by split name.
    """
    n_problems = (MAX_OPERAND + 1) ** 2
    if n_eval < 0 or n_dev < 0 or n_eval + n_dev >= n_problems:
        raise ValueError(
            f"n_eval={n_eval} and n_dev={n_dev} must be non-negative and leave "
            f"training rows out of {n_problems} problems"
        )

    problems = [_addition_problem(a, b) for a in range(MAX_OPERAND + 1) for b in range(MAX_OPERAND + 1)]
    # A private Random keeps the split independent of global random state.
    random.Random(seed).shuffle(problems)
    return _write_splits(problems, n_eval, n_dev, out_dir)


def tool_transcript(a: int, b: int) -> str:
    """The answer to ``a*b=`` that uses the calculator tool: the call, the tool's result, then the answer."""
    return f"<calc>{a}*{b}</calc><result>{a * b}</result>{a * b}"


# The share of the tool task's warm-start transcripts that call the calculator. At 1.0 the warm-started model calls
# it greedily from the start (held-out 1.0 before any RL, nothing left to learn); at 0.1 it learns the call's format
# too poorly to get a result right; at 0.25 it calls it on 13% of held-out problems under greedy decoding and on a
# quarter of its samples, enough signal for GRPO to learn to call it (docs/agents.md, "A model that has to learn").
TOOL_SHARE = 0.25


def make_tool_arith_dataset(
    out_dir: Path,
    seed: int = 0,
    n_eval: int = 200,
    n_dev: int = 32,
    n_train: int = 4000,
    tool_share: float = TOOL_SHARE,
) -> dict[str, Path]:
    """Write 3-digit by 2-digit multiplications (``123*45=`` -> ``5535``) as train/dev/eval JSONL splits.

    Too hard for the tiny model to compute, easy with the calculator environment: each row also carries
    ``transcript``, the answer the tool model's warm start learns from. A share ``tool_share`` of the rows answer by
    calling the tool (``tool_transcript``); the others state the product outright, as a model that never learned
    the tool would, so a model warm-started on them seldom calls it and has to learn to (``TOOL_SHARE``).
    Distinct problems, drawn with ``seed``; the share does not change which problems or splits they are."""
    if not 0.0 <= tool_share <= 1.0:
        raise ValueError(f"tool_share must be within [0, 1], got {tool_share}")
    rng = random.Random(seed)
    pairs: set[tuple[int, int]] = set()
    while len(pairs) < n_eval + n_dev + n_train:
        pairs.add((rng.randint(100, 999), rng.randint(10, 99)))
    calls = random.Random(f"{seed}-tool-share")  # its own draws: the problems and splits stay the share-1 ones
    problems = [
        {
            "id": f"mul-{a}-{b}",
            "prompt": f"{a}*{b}=",
            "answer": str(a * b),
            "transcript": tool_transcript(a, b) if calls.random() < tool_share else str(a * b),
        }
        for a, b in sorted(pairs)
    ]
    rng.shuffle(problems)
    return _write_splits(problems, n_eval, n_dev, out_dir)


# The long-tail task: a quarter of its prompts ask for the sum written 2 to 16 times over, answers of up to 32
# characters where the median answer is 2: several times the median, as the long answers of reasoning tasks are.
LONG_SHARE = 0.25
LONG_REPEATS = (2, 16)


def make_long_tail_dataset(
    out_dir: Path, seed: int = 0, n_eval: int = 400, n_dev: int = 200, n_train: int = 3400
) -> dict[str, Path]:
    """Write additions whose answer lengths are heavy-tailed as train/dev/eval JSONL splits.

    Three in four rows are ``a+b=`` (``12+7=`` -> ``19``, 1 to 3 characters); the others ask for the sum repeated
    ``n`` times, ``12+7 r4=`` -> ``19191919``, with ``a+b`` at most 99 and ``n`` drawn from ``LONG_REPEATS``, so
    their answers run to 32 characters. A long answer is one number, so ``exact_match`` and the held-out accuracy
    judge both kinds alike. Distinct problems, drawn with ``seed``."""
    rng = random.Random(seed)
    total = n_eval + n_dev + n_train
    n_long = round(total * LONG_SHARE)
    short: dict[str, dict] = {}
    while len(short) < total - n_long:
        row = _addition_problem(rng.randint(0, MAX_OPERAND), rng.randint(0, MAX_OPERAND))
        short[row["id"]] = row
    long: dict[str, dict] = {}
    while len(long) < n_long:
        a = rng.randint(0, MAX_OPERAND)
        b = rng.randint(0, MAX_OPERAND - a)
        repeats = rng.randint(*LONG_REPEATS)
        row = {
            "id": f"rep-{a:02d}-{b:02d}-{repeats:02d}",
            "prompt": f"{a}+{b} r{repeats}=",
            "answer": str(a + b) * repeats,
        }
        long[row["id"]] = row
    problems = [*short.values(), *long.values()]
    rng.shuffle(problems)
    return _write_splits(problems, n_eval, n_dev, out_dir)


# Word problems: each template is (question, operation). Operands are drawn so answers stay
# whole and non-negative; every problem is unique across the three splits.
NAMES = ("Tom", "Anna", "Ben", "Maria", "Sam", "Lily", "Omar", "Grace", "Leo", "Nina")
ITEMS = ("apples", "pencils", "stickers", "marbles", "books", "cookies", "stamps", "shells")
WORD_TEMPLATES: tuple[tuple[str, str], ...] = (
    ("{name} has {a} {item} and buys {b} more. How many {item} does {name} have now?", "+"),
    ("{name} picked {a} {item} in the morning and {b} in the afternoon. How many {item} did {name} pick in all?", "+"),
    ("A box holds {a} {item}. {name} puts in {b} more. How many {item} are in the box now?", "+"),
    ("{name} had {a} {item} and gave {b} of them to a friend. How many {item} does {name} have left?", "-"),
    ("There are {a} {item} on the table. {name} takes away {b}. How many {item} are still on the table?", "-"),
    ("{name} buys {a} bags with {b} {item} in each bag. How many {item} does {name} buy?", "*"),
)
# Measured on SmolLM2-135M-Instruct with vLLM: greedy got 41% of 64 held-out problems right and sampling
# (T=0.7, 8 per prompt) 20%, with a right answer in 14 of 16 groups, which is what GRPO learns from.
# Operands up to 20-30 gave 23% greedy and a right answer in a quarter of the groups.
WORD_ADD_RANGE = (1, 10)
WORD_SUB_RANGE = (3, 15)  # the minuend; the subtrahend is below it
WORD_MUL_BAGS, WORD_MUL_EACH = (2, 4), (2, 5)
# Measured on SmolLM2-135M-Instruct (48 held-out problems, greedy, 40 new tokens): this system
# message gave 23% right against 17% for the bare question, with shorter replies, so more of
# them end inside a small max_new_tokens.
WORD_SYSTEM = (
    "You are a math tutor. Solve the word problem in one short sentence that ends with the answer as a number."
)


def _word_problem(template: int, name: str, item: str, a: int, b: int) -> dict:
    question, op = WORD_TEMPLATES[template]
    answer = {"+": a + b, "-": a - b, "*": a * b}[op]
    return {
        "id": f"word-{template}-{name.lower()}-{item}-{a:03d}-{b:03d}",
        "messages": [
            {"role": "system", "content": WORD_SYSTEM},
            {"role": "user", "content": question.format(name=name, item=item, a=a, b=b)},
        ],
        "answer": str(answer),
    }


def make_word_problem_dataset(
    out_dir: Path, seed: int = 0, n_train: int = 4000, n_eval: int = 300, n_dev: int = 200
) -> dict[str, Path]:
    """Write chat-form word problems ("Tom has 17 apples and buys 25 more. ...") as train/dev/eval JSONL.

    Each row is a system message (``WORD_SYSTEM``) and the question. Additions use operands
    1-10, subtractions 3-15 minus a smaller number, products 2-4 bags of 2-5: small enough
    that a 135M model's errors are mostly in setting the sum up and saying the result, which
    RL can fix, rather than in arithmetic it cannot yet do. Problems are drawn
    with ``seed`` without repeats, so no question appears in two splits and the same seed
    always writes the same files.

    Returns the path of each split file, keyed by split name.
    """
    total = n_train + n_eval + n_dev
    if min(n_train, n_eval, n_dev) < 0 or n_train == 0:
        raise ValueError(f"n_train={n_train}, n_eval={n_eval}, n_dev={n_dev}: counts must be >= 0, n_train > 0")
    rng = random.Random(seed)
    seen: set[str] = set()
    problems: list[dict] = []
    # 6 templates x 10 names x 8 items x the operand pairs: tens of thousands of distinct problems.
    while len(problems) < total:
        template = rng.randrange(len(WORD_TEMPLATES))
        op = WORD_TEMPLATES[template][1]
        if op == "+":
            a, b = rng.randint(*WORD_ADD_RANGE), rng.randint(*WORD_ADD_RANGE)
        elif op == "-":
            a = rng.randint(*WORD_SUB_RANGE)
            b = rng.randint(1, a - 1)
        else:
            a, b = rng.randint(*WORD_MUL_BAGS), rng.randint(*WORD_MUL_EACH)
        row = _word_problem(template, rng.choice(NAMES), rng.choice(ITEMS), a, b)
        if row["id"] not in seen:
            seen.add(row["id"])
            problems.append(row)
    return _write_splits(problems, n_eval, n_dev, out_dir)


def _write_splits(problems: list[dict], n_eval: int, n_dev: int, out_dir: str | Path) -> dict[str, Path]:
    """Write the shuffled ``problems`` as eval, dev and train JSON Lines files (in that order of the list)."""
    splits = {
        "eval": problems[:n_eval],
        "dev": problems[n_eval : n_eval + n_dev],
        "train": problems[n_eval + n_dev :],
    }
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split in SPLIT_NAMES:
        paths[split] = out_dir / f"{split}.jsonl"
        _write_jsonl(paths[split], splits[split])
    return paths
