"""Two figures of the question bank: can it be gamed, and does it ask about situations rather than facts.

``quiz_longest_choice_share``: of the single-choice questions, the share whose right choice is strictly the
longest. A learner who always picks the longest choice scores about this much; at most 0.30 keeps that tell weak.

``quiz_scenario_share``: the share of questions that are scenario-based, by a rule a reader can check by eye
(:func:`scenario_detail`): the stem first *states a situation* — at least one sentence or clause, ended by
``.``, ``:``, ``;``, ``!`` or ``?``, before the part that asks — and that situation carries concrete material to
work from: a number (``p=4``, ``8 GPUs``, ``70 GB``; not the digits inside a word such as fp16 or H100), or a
fragment of a log, a setting or code (an environment variable such as ``NCCL_DEBUG``, a ``--flag``,
``name=value``, a quoted message, a call ``f(...)``, code in backticks). "What does ZeRO stage 1 partition?" is
recall; "A job runs on 4 servers with 8 GPUs each. What is WORLD_SIZE?" is a scenario. The exam asks mostly
scenarios, hence the target of 0.60.

Both are counted, not timed: ``quick`` and ``full`` are the same.
"""

from __future__ import annotations

import re

from ..quiz.bank import load_bank
from ..readings import Reading, figure

# Where the situation ends and the asking begins: after ., :, ;, ! or ? followed by a space.
CLAUSE_END = re.compile(r"(?<=[.:;!?])\s+")
# Concrete material: a number standing alone, or a fragment of a log, a setting or code.
DETAIL = re.compile(r"(?<!\w)\d"                       # 8 GPUs, p=4, 65504 (not fp16, H100)
                    r"|`[^`]+`"                        # `if rank == 0: dist.all_reduce(loss)`
                    r"|\b[A-Z][A-Z0-9]*_[A-Z0-9_]+\b"  # CUDA_VISIBLE_DEVICES, TORCH_DISTRIBUTED_DEBUG
                    r"|(?<!\S)--[a-z][a-z-]*"          # --max-restarts
                    r"|\b[a-z_]+=\S"                   # grad_accum=4
                    r"|(?<!\w)['\"][^'\"]+['\"](?!\w)"  # 'reserved but unallocated'
                    r"|\b[a-z_.]+\([^)]*\)")           # time.perf_counter()


def scenario_detail(question: str) -> str | None:
    """The concrete detail that makes ``question`` a scenario (see the module docstring), or None for recall."""
    parts = CLAUSE_END.split(question.strip())
    found = DETAIL.search(" ".join(parts[:-1])) if len(parts) > 1 else None
    return found.group(0) if found else None


def right_is_longest(q: dict) -> bool:
    """Whether a single-choice question's right choice is longer than every other choice."""
    right = len(q["choices"][q["answer"]])
    return all(right > len(c) for i, c in enumerate(q["choices"]) if i != q["answer"])


@figure("quiz_longest_choice_share", target="<= 0.30", quick={}, full={})
def quiz_longest_choice_share() -> Reading:
    """Share of single-choice questions whose right choice is strictly the longest: picking it would score that."""
    singles = [q for q in load_bank() if q["kind"] == "single"]
    longest = [q["id"] for q in singles if right_is_longest(q)]
    share = len(longest) / len(singles)
    return Reading(share, {"single_choice": len(singles), "right_is_longest": longest},
                   f"{len(longest)} of {len(singles)} single-choice questions have the right choice longest")


@figure("quiz_scenario_share", target=">= 0.60", quick={}, full={})
def quiz_scenario_share() -> Reading:
    """Share of questions whose stem states a situation with a number, a log line, a setting or code first."""
    bank = load_bank()
    details = {q["id"]: scenario_detail(q["question"]) for q in bank}
    recall = sorted(qid for qid, detail in details.items() if detail is None)
    share = 1 - len(recall) / len(bank)
    by_topic = {}
    for q in bank:
        t = by_topic.setdefault(q["topic"], [0, 0])
        t[0] += details[q["id"]] is not None
        t[1] += 1
    return Reading(share, {"questions": len(bank), "recall": recall,
                           "by_topic": {t: round(n / total, 3) for t, (n, total) in by_topic.items()}},
                   f"{len(bank) - len(recall)} of {len(bank)} questions are scenarios")
