"""The question bank: load it, draw questions from it, grade an answer.

The bank is one JSON file shipped inside the package (``bank.json``). Each
question is a plain dict:

- ``id``: a stable name such as ``"par-bubble-gpipe"``;
- ``topic``: one of :data:`TOPICS`, the four parts of the exam's "GPU
  Acceleration and Optimization" section;
- ``notebook``: the course notebook that teaches it (one of :data:`NOTEBOOKS`);
- ``kind``: ``"single"`` (one choice is right), ``"multiple"`` (select all
  that apply) or ``"numeric"`` (type a number);
- ``question``, ``choices`` (for single and multiple), ``explanation``;
- ``answer``: the index of the right choice, the list of right indices, or
  the number; a numeric question also has ``tolerance`` (absolute) and ``unit``.

The bank stores each question's choices in one fixed order; a drawn quiz or
mock exam presents them in an order of its own (:func:`shuffled`), so that a
choice's letter says nothing about whether it is right.
"""

from __future__ import annotations

import copy
import functools
import json
import math
import random
import re
from importlib import resources

from ..files import write_atomic

TOPICS = {
    "distributed-setups": "multi-GPU and distributed setups: collectives, interconnects, launchers",
    "parallelism": "parallelism techniques: data, ZeRO/FSDP, pipeline, tensor, hybrids",
    "memory-batch": "memory and batch optimisation: mixed precision, loss scaling, checkpointing, accumulation",
    "profiling-troubleshooting": "profiling and troubleshooting: MFU, scaling, NCCL debugging, hangs, OOM, NaN",
}

NOTEBOOKS = ("01_collectives", "02_data_parallelism", "03_zero_fsdp", "04_pipeline_parallelism",
             "05_tensor_parallelism", "06_hybrid_planning", "07_memory_batch", "08_profiling",
             "09_troubleshooting", "10_accelerate_scaling", "12_sequence_context_parallel",
             "13_mixture_of_experts", "04b_pipeline_schedules", "14_serving",
             "15_inference_optimization")

KINDS = ("single", "multiple", "numeric")


class BankError(ValueError):
    """A question in the bank is malformed; the message names it."""


def _check(q: dict) -> None:
    """Raise BankError unless ``q`` is a well-formed question."""
    qid = q.get("id", "?")

    def bad(what):
        raise BankError(f"question {qid!r}: {what}.")

    for key in ("id", "topic", "notebook", "kind", "question", "explanation"):
        if not isinstance(q.get(key), str) or not q[key].strip():
            bad(f"{key} must be a non-empty string")
    if q["topic"] not in TOPICS:
        bad(f"topic {q['topic']!r} is not one of {', '.join(TOPICS)}")
    if q["notebook"] not in NOTEBOOKS:
        bad(f"notebook {q['notebook']!r} is not one of {', '.join(NOTEBOOKS)}")
    if q["kind"] not in KINDS:
        bad(f"kind {q['kind']!r} is not one of {', '.join(KINDS)}")
    answer = q.get("answer")
    if q["kind"] == "numeric":
        if not _is_number(answer):
            bad("a numeric answer must be a number")
        if not _is_number(q.get("tolerance")) or q["tolerance"] < 0:
            bad("a numeric question needs a tolerance of at least 0")
        return
    choices = q.get("choices")
    if not isinstance(choices, list) or len(choices) < 2 or not all(isinstance(c, str) and c for c in choices):
        bad("choices must be a list of at least two strings")
    if len(set(choices)) != len(choices):
        bad("two choices are the same")
    right = [answer] if q["kind"] == "single" else answer
    if q["kind"] == "multiple" and (not isinstance(answer, list) or not answer or len(set(answer)) != len(answer)):
        bad("a multiple-choice answer must be a non-empty list of distinct indices")
    if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < len(choices) for i in right):
        bad(f"answer {answer!r} does not index into its {len(choices)} choices")


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@functools.lru_cache(maxsize=1)
def _bank() -> tuple:
    data = json.loads(resources.files(__package__).joinpath("bank.json").read_text(encoding="utf-8"))
    questions = data["questions"]
    seen = set()
    for q in questions:
        _check(q)
        if q["id"] in seen:
            raise BankError(f"question id {q['id']!r} appears twice.")
        seen.add(q["id"])
    return tuple(questions)


def load_bank(topic: str | None = None, notebook: str | None = None) -> list[dict]:
    """Every question of the bank (or of one ``topic``, or one ``notebook``), as fresh dicts you may change freely."""
    if topic is not None and topic not in TOPICS:
        raise ValueError(f"no topic {topic!r}; the topics are {', '.join(TOPICS)}.")
    if notebook is not None and notebook not in NOTEBOOKS:
        raise ValueError(f"no notebook {notebook!r} has questions; those that do are {', '.join(NOTEBOOKS)}.")
    return [copy.deepcopy(q) for q in _bank()
            if (topic is None or q["topic"] == topic) and (notebook is None or q["notebook"] == notebook)]


def ask(topic: str | None = None, count: int = 10, seed: int | None = None, notebook: str | None = None) -> list[dict]:
    """``count`` questions drawn at random (all of them if the bank has fewer), from one topic or all.

    ``notebook`` ("03_zero_fsdp") keeps only the questions that notebook teaches.
    Each question's choices are shuffled (see :func:`shuffled`). The same
    ``seed`` draws the same questions in the same order, with the same choice
    orders, on any machine.
    """
    if count < 1:
        raise ValueError(f"count={count} must be at least 1.")
    pool = load_bank(topic, notebook)
    return [shuffled(q, seed) for q in random.Random(seed).sample(pool, min(count, len(pool)))]


def shuffled(question: dict, seed: int | str | None) -> dict:
    """A copy of ``question`` with its choices in an order drawn from ``seed`` and its id, the answer remapped.

    The order depends only on the seed and the question's id, so a question
    reads the same in every quiz or mock exam drawn with that seed, on any
    machine; ``seed=None`` gives a fresh random order. The answer still names
    the same choice texts. A numeric question has no choices: it comes back as
    a plain copy.
    """
    q = copy.deepcopy(question)
    if q["kind"] == "numeric":
        return q
    rng = random.Random(None if seed is None else f"{seed}:{q['id']}")
    order = rng.sample(range(len(q["choices"])), len(q["choices"]))
    position = {old: new for new, old in enumerate(order)}
    q["choices"] = [question["choices"][i] for i in order]
    q["answer"] = (position[q["answer"]] if q["kind"] == "single"
                   else sorted(position[i] for i in q["answer"]))
    return q


def letter(i: int) -> str:
    """The letter a choice is shown with: 0 → 'a'."""
    return chr(ord("a") + i)


def parse_response(question: dict, text: str):
    """Turn typed text into a response :func:`grade` takes; ValueError (one sentence) if it cannot.

    Choices are letters ("b"; "a, c" or "ac" for select-all); a number may be
    written ``0.2``, ``20%``, ``3/15``, ``1.5e9``, ``4,194,304`` or ``1.75 GB``
    (the unit is not checked).
    """
    text = text.strip().lower()
    if question["kind"] == "numeric":
        return _parse_number(text)
    n = len(question["choices"])
    letters = re.sub(r"[\s,;]+", "", text)
    if not letters or any(not ("a" <= c < letter(n)) for c in letters):
        raise ValueError(f"answer with {'a letter' if question['kind'] == 'single' else 'letters'} "
                         f"from a to {letter(n - 1)}.")
    picked = sorted({ord(c) - ord("a") for c in letters})
    if question["kind"] == "single":
        if len(picked) != 1:
            raise ValueError("this question has one answer: give a single letter.")
        return picked[0]
    return picked


_NUMBER = re.compile(r"([-+]?(?:\d+\.?\d*|\.\d+)(?:e[-+]?\d+)?)(?:/(\d+\.?\d*(?:e[-+]?\d+)?))?(%?)[a-z/]*")


def _parse_number(text: str) -> float:
    """A number from typed text; a trailing unit ("GB", "ms") is ignored."""
    m = _NUMBER.fullmatch(text.replace(",", "").replace("_", "").replace(" ", ""))
    if not m:
        raise ValueError(f"{text!r} is not a number (write e.g. 0.25, 25%, 1/4 or 1.5e9).")
    value = float(m.group(1))
    if m.group(2):
        if float(m.group(2)) == 0:
            raise ValueError(f"{text!r} divides by zero.")
        value /= float(m.group(2))
    if value in (float("inf"), float("-inf")):
        raise ValueError(f"{text!r} is too large.")
    return value * (0.01 if m.group(3) else 1.0)


def format_answer(question: dict) -> str:
    """The right answer, as a learner would read it."""
    if question["kind"] == "numeric":
        unit = question.get("unit") or ""
        value = f"{question['answer']:,}" if float(question["answer"]).is_integer() else f"{question['answer']:g}"
        tol = f" (±{question['tolerance']:g})" if question["tolerance"] else ""
        return f"{value}{' ' + unit if unit and unit != 'fraction' else ''}{tol}"
    right = [question["answer"]] if question["kind"] == "single" else question["answer"]
    return "; ".join(f"{letter(i)}) {question['choices'][i]}" for i in right)


def format_response(question: dict, response) -> str:
    """A learner's response, as they would read it back."""
    if response is None:
        return "no answer"
    if question["kind"] == "numeric" or isinstance(response, str):
        return str(response)
    picked = [response] if question["kind"] == "single" else sorted(response)
    return ", ".join(f"{letter(i)})" for i in picked)


def _normalise(question: dict, response):
    """``response`` as an index, a sorted list of indices or a float; ValueError if it is none of those."""
    if isinstance(response, str):
        return parse_response(question, response)
    kind = question["kind"]
    if kind == "numeric":
        if not _is_number(response):
            raise ValueError(f"{response!r} is not a number.")
        return float(response)
    n = len(question["choices"])

    def index(i):
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n:
            raise ValueError(f"{i!r} is not a choice index from 0 to {n - 1}.")
        return i

    if kind == "single":
        return index(response)
    if not isinstance(response, (list, tuple, set, frozenset)):
        raise ValueError("a select-all question takes a list of choice indices.")
    return sorted({index(i) for i in response})


def is_correct(question: dict, response) -> bool:
    """Whether ``response`` is right (an unreadable or missing response is not)."""
    if response is None:
        return False
    try:
        value = _normalise(question, response)
    except ValueError:
        return False
    if question["kind"] == "numeric":
        return abs(value - question["answer"]) <= question["tolerance"] + 1e-9 * abs(question["answer"])
    if question["kind"] == "single":
        return value == question["answer"]
    return value == sorted(question["answer"])


def grade(question: dict, response) -> tuple[bool, str]:
    """``(correct, explanation)`` for one response.

    ``response`` is a choice index (single), a list of indices (select all), a
    number (numeric), or the text a learner typed ("b", "a, c", "0.2", "20%").
    The explanation says why the answer is what it is, and gives it when the
    response was wrong.
    """
    if response is None:
        return False, f"No answer. The answer is {format_answer(question)}. {question['explanation']}"
    try:
        _normalise(question, response)
    except ValueError as e:
        return False, (f"Could not read that answer: {e} The answer is {format_answer(question)}. "
                       f"{question['explanation']}")
    if is_correct(question, response):
        return True, f"Correct. {question['explanation']}"
    return False, f"Not quite: the answer is {format_answer(question)}. {question['explanation']}"


def export_bank(path, topic: str | None = None) -> int:
    """Write the whole bank (or one ``topic``) to ``path`` as JSON, atomically; return how many questions."""
    questions = load_bank(topic)
    write_atomic(path, json.dumps({"format": 1, "topics": TOPICS, "questions": questions},
                                  indent=1, ensure_ascii=False) + "\n")
    return len(questions)
