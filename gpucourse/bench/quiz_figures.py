"""Three figures of the question bank: can it be gamed, and does it ask about situations rather than facts.

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

``quiz_best_heuristic_accuracy``: the best score of a battery of test-taking heuristics (:data:`HEURISTICS`) over
every single-choice question. Each heuristic reads only the stem and the choices, never the answer: the longest,
the shortest or the second-longest choice, the one closest to the mean length, the most punctuated, the only one
with a semicolon, a colon, a parenthesis or a "because", the most digits, the middle number, the hedged choice,
the one sharing most words with the stem or with the other choices, a fixed letter, and combinations of these. One
that has nothing to go on (no choice is the only one with a semicolon) falls back to the first choice, so every
heuristic is scored over all single-choice questions. Chance is 1/4; at most 0.35 leaves no heuristic much above
it. :data:`SET_HEURISTICS` do the same for select-all questions (the two longest, the most punctuated half, ...),
scored against a random pick of as many choices (:func:`set_scores`).

All three are counted, not timed: ``quick`` and ``full`` are the same.
"""

from __future__ import annotations

import math
import re
import statistics
from typing import Callable

from ..quiz.bank import load_bank
from ..course.readings import Reading, figure

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


# --- test-taking heuristics: what a learner who knows nothing could still exploit ------------------------------

# Words that carry no content when two texts are compared.
STOPWORDS = frozenset("""a an the of to in on at by for from with without into onto over under than then and or
but nor not no is are was were be been being it its this that these those there their them they he she we you
your our as so if when while each every all any some one same other such what which who whom how why where do
does did done has have had having can could may might must should will would shall per via up out off only just
also both either more most less very too own""".split())
ABSOLUTE = re.compile(r"\b(always|never|only|all|none|every|must|cannot|nothing|exactly)\b", re.IGNORECASE)
HEDGE = re.compile(r"\b(usually|often|can|may|might|about|roughly|mostly|likely|typically|generally|some)\b",
                   re.IGNORECASE)
BECAUSE = re.compile(r"\b(because|since|so that|which)\b", re.IGNORECASE)
NUMBER = re.compile(r"(?<![\w.])\d[\d,]*(?:\.\d+)?(?:/\d+(?:\.\d+)?)?")


def words(text: str) -> set[str]:
    """A text's content words, lower case."""
    return {w for w in re.findall(r"[a-z0-9]+(?:[-'][a-z0-9]+)*", text.lower()) if w not in STOPWORDS}


def punctuation(text: str) -> int:
    """How many commas, colons and semicolons a text has: its clauses."""
    return sum(text.count(ch) for ch in ",:;")


def first_number(text: str) -> float | None:
    """The first number a choice states ('3/16' is 0.1875, '1,024' is 1024), or None."""
    m = NUMBER.search(text)
    if not m:
        return None
    num, _, den = m.group(0).replace(",", "").partition("/")
    try:
        return float(num) / float(den) if den else float(num)
    except (ValueError, ZeroDivisionError):
        return None


def argmax(scores: list[float]) -> int:
    """The index of the largest score, the first one on a tie."""
    return max(range(len(scores)), key=lambda i: (scores[i], -i))


def unique(flags: list[bool]) -> int | None:
    """The one index whose flag is set, or None when none or several are."""
    hits = [i for i, f in enumerate(flags) if f]
    return hits[0] if len(hits) == 1 else None


def length_rank(choices: list[str]) -> list[int]:
    """Each choice's rank by length, 0 for the longest (ties in stored order)."""
    order = sorted(range(len(choices)), key=lambda i: (-len(choices[i]), i))
    return [order.index(i) for i in range(len(choices))]


def _second_longest(choices, stem):
    return length_rank(choices).index(1)


def _closest_to_mean(choices, stem):
    mean = statistics.fmean(map(len, choices))
    return min(range(len(choices)), key=lambda i: (abs(len(choices[i]) - mean), i))


def _middle_number(choices, stem):
    values = [(v, i) for i, c in enumerate(choices) for v in [first_number(c)] if v is not None]
    if len(values) < 3 or len({v for v, _ in values}) < 3:
        return None
    return sorted(values)[(len(values) - 1) // 2][1]


def _hedged(choices, stem):
    calm = [i for i, c in enumerate(choices) if not ABSOLUTE.search(c)]
    hedges = [len(HEDGE.findall(choices[i])) for i in calm]
    return calm[argmax(hedges)] if calm and max(hedges) > 0 else None


def _not_absolute(choices, stem):
    calm = [i for i, c in enumerate(choices) if not ABSOLUTE.search(c)]
    return calm[0] if 0 < len(calm) < len(choices) else None


def _centroid_scores(choices):
    ws = [words(c) for c in choices]
    return [sum(len(ws[i] & ws[j]) for j in range(len(ws)) if j != i) for i in range(len(ws))]


def _punct_then_second_longest(choices, stem):
    rank = length_rank(choices)
    return min(range(len(choices)), key=lambda i: (-punctuation(choices[i]), abs(rank[i] - 1), i))


def _semicolon_else_second_longest(choices, stem):
    one = unique([";" in c for c in choices])
    return one if one is not None else _second_longest(choices, stem)


def _longest_of_most_punctuated(choices, stem):
    most = max(map(punctuation, choices))
    return min((i for i, c in enumerate(choices) if punctuation(c) == most), key=lambda i: (-len(choices[i]), i))


# Each heuristic: (choices, stem) -> the index it picks, or None when it has nothing to go on.
Heuristic = Callable[[list, str], "int | None"]
HEURISTICS: dict[str, Heuristic] = {
    "longest": lambda c, s: argmax([len(x) for x in c]),
    "shortest": lambda c, s: argmax([-len(x) for x in c]),
    "second_longest": _second_longest,
    "second_shortest": lambda c, s: length_rank(c).index(len(c) - 2),
    "closest_to_mean_length": _closest_to_mean,
    "most_punctuation": lambda c, s: argmax([punctuation(x) for x in c]),
    "least_punctuation": lambda c, s: argmax([-punctuation(x) for x in c]),
    "only_semicolon": lambda c, s: unique([";" in x for x in c]),
    "only_colon": lambda c, s: unique([":" in x for x in c]),
    "only_parenthesis": lambda c, s: unique(["(" in x for x in c]),
    "only_because_which": lambda c, s: unique([bool(BECAUSE.search(x)) for x in c]),
    "most_digits": lambda c, s: argmax([sum(ch.isdigit() for ch in x) for x in c]),
    "middle_number": _middle_number,
    "hedged": _hedged,
    "not_absolute": _not_absolute,
    "most_stem_words": lambda c, s: argmax([len(words(x) & words(s)) for x in c]),
    "centroid": lambda c, s: argmax(_centroid_scores(c)),
    "odd_one_out": lambda c, s: argmax([-x for x in _centroid_scores(c)]),
    "first": lambda c, s: 0,
    "second": lambda c, s: 1,
    "third": lambda c, s: 2,
    "last": lambda c, s: len(c) - 1,
    "punctuation_then_second_longest": _punct_then_second_longest,
    "semicolon_else_second_longest": _semicolon_else_second_longest,
    "longest_of_most_punctuated": _longest_of_most_punctuated,
}
# The heuristics whose picks are pooled by "vote": those that read the texts, not a position.
VOTERS = ("second_longest", "closest_to_mean_length", "most_punctuation", "only_semicolon", "only_colon",
          "only_parenthesis", "only_because_which", "most_digits", "middle_number", "hedged", "most_stem_words",
          "centroid")


def _vote(choices, stem):
    picks = [p for name in VOTERS for p in [HEURISTICS[name](choices, stem)] if p is not None]
    return argmax([picks.count(i) for i in range(len(choices))]) if picks else None


HEURISTICS["vote"] = _vote
FALLBACK = 0  # what a heuristic with nothing to go on picks: the first choice


def guess(name: str, q: dict) -> int:
    """The index heuristic ``name`` picks for single-choice question ``q``, never looking at its answer."""
    pick = HEURISTICS[name](list(q["choices"]), q["question"])
    return FALLBACK if pick is None else pick


def heuristic_accuracies(questions: list[dict]) -> dict[str, float]:
    """Each heuristic's share of right picks over the single-choice questions given."""
    singles = [q for q in questions if q["kind"] == "single"]
    return {name: sum(guess(name, q) == q["answer"] for q in singles) / len(singles) for name in HEURISTICS}


# --- the same for select-all questions: which choices, given how many -------------------------------------------

def _top(key: Callable[[int], tuple], n: int, k: int) -> set[int]:
    return set(sorted(range(n), key=key)[:max(1, min(k, n - 1))])


def _half(n: int) -> int:
    return (n + 1) // 2


def _by_length(c, k):
    return _top(lambda i: (-len(c[i]), i), len(c), k)


def _by_punct(c, k):
    rank = length_rank(c)
    return _top(lambda i: (-punctuation(c[i]), abs(rank[i] - 1), i), len(c), k)


SetHeuristic = Callable[[list, str], set]
SET_HEURISTICS: dict[str, SetHeuristic] = {
    "two_longest": lambda c, s: _by_length(c, 2),
    "three_longest": lambda c, s: _by_length(c, 3),
    "longest_half": lambda c, s: _by_length(c, _half(len(c))),
    "shortest_half": lambda c, s: _top(lambda i: (len(c[i]), i), len(c), _half(len(c))),
    "all_but_shortest": lambda c, s: _by_length(c, len(c) - 1),
    "most_punctuated_half": lambda c, s: _by_punct(c, _half(len(c))),
    "all_but_least_punctuated": lambda c, s: _by_punct(c, len(c) - 1),
    "most_stem_words_half": lambda c, s: _top(lambda i: (-len(words(c[i]) & words(s)), i), len(c), _half(len(c))),
    "centroid_half": lambda c, s: _top(lambda i: (-_centroid_scores(c)[i], i), len(c), _half(len(c))),
    "all_but_odd_one_out": lambda c, s: _top(lambda i: (-_centroid_scores(c)[i], i), len(c), len(c) - 1),
    "not_absolute": lambda c, s: ({i for i, x in enumerate(c) if not ABSOLUTE.search(x)}
                                  or _by_length(c, _half(len(c)))),
    "last_half": lambda c, s: set(range(len(c) // 2, len(c))),
}


def random_pick_scores(n: int, k: int, a: int) -> tuple[float, float]:
    """Expected exact-set hit and Jaccard of k choices drawn at random from n, when a of the n are right."""
    exact = (k == a) / math.comb(n, k)
    jaccard = sum(math.comb(a, i) * math.comb(n - a, k - i) / math.comb(n, k) * i / (k + a - i)
                  for i in range(max(0, k + a - n), min(k, a) + 1))
    return exact, jaccard


def set_scores(questions: list[dict]) -> dict[str, dict[str, float]]:
    """Each select-all heuristic's mean exact-set hit and Jaccard over the select-all questions given, with chance:
    the same means for a pick of as many choices, drawn at random, on each question."""
    multiple = [q for q in questions if q["kind"] == "multiple"]
    out = {}
    for name, pick_of in SET_HEURISTICS.items():
        got, chance = [0.0, 0.0], [0.0, 0.0]
        for q in multiple:
            pick, right, n = pick_of(list(q["choices"]), q["question"]), set(q["answer"]), len(q["choices"])
            got[0] += pick == right
            got[1] += len(pick & right) / len(pick | right)
            for j, v in enumerate(random_pick_scores(n, len(pick), len(right))):
                chance[j] += v
        out[name] = {"exact": got[0] / len(multiple), "exact_chance": chance[0] / len(multiple),
                     "jaccard": got[1] / len(multiple), "jaccard_chance": chance[1] / len(multiple)}
    return out


@figure("quiz_best_heuristic_accuracy", target="<= 0.35", quick={}, full={})
def quiz_best_heuristic_accuracy() -> Reading:
    """The best accuracy any test-taking heuristic reaches over the single-choice questions (chance: 0.25)."""
    bank = load_bank()
    scores = heuristic_accuracies(bank)
    best = max(scores, key=scores.get)
    return Reading(scores[best], {"single_choice": sum(q["kind"] == "single" for q in bank), "best": best,
                                  "accuracies": {k: round(v, 3) for k, v in scores.items()},
                                  "select_all": {k: {m: round(x, 3) for m, x in v.items()}
                                                 for k, v in set_scores(bank).items()}},
                   f"the best of {len(scores)} guessing heuristics, {best}, scores {scores[best]:.0%} "
                   f"on single-choice questions (chance 25%)")
