"""Mutation testing of the checks: the mutator makes the same mutants on every run, each one a change of the code a
learner writes that parses, and the scoring tells a caught mutant, an equivalent one and a surviving one apart."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import wrong_answers
from gpucourse.grading import mutation
from gpucourse.grading.mutation import Mutant

REPO = Path(__file__).resolve().parent.parent
EX14 = (REPO / "solutions" / "ex14_paged_attention.py").read_text(encoding="utf-8")


def _changed_lines(source: str, mutant: str) -> set[int]:
    return {i for i, (a, b) in enumerate(zip(source.splitlines(), mutant.splitlines()), 1) if a != b}


def test_the_mutants_are_the_same_on_every_run_and_each_parses():
    first, second = mutation.exercise_mutants("ex14"), mutation.exercise_mutants("ex14")
    assert first == second and len(first) > 50
    assert [m.id for m in first] == [f"ex14-{i:03d}" for i in range(1, len(first) + 1)]
    solution = ast.dump(ast.parse(EX14))
    trees = set()
    for m in first:
        tree = ast.dump(ast.parse(m.source))
        assert tree != solution and tree not in trees, m.description
        trees.add(tree)
        assert m.description.startswith(f"solutions/ex14_paged_attention.py:{m.line}: {m.operator}: "), m.description
        assert m.operator in mutation.OPERATORS
    assert {m.operator for m in first} >= {"arithmetic", "comparison", "constant", "off-by-one", "statement",
                                           "arguments", "keyword", "removal", "dtype", "return"}


def test_only_what_the_learner_writes_is_mutated():
    stub = "def given(x):\n    return x + 1\n\n\ndef written(x, n):\n    raise NotImplementedError\n"
    solution = ("def given(x):\n    return x + 1\n\n\ndef written(x, n):\n    \"\"\"Doc.\"\"\"\n"
                "    y = x[1:n].clone()\n    return y.sum(dim=0) if n < 2 else None\n")
    found = mutation.mutants(solution, stub, name="s.py")
    assert found and all(m.line >= 6 for m in found), [m.description for m in found if m.line < 6]
    said = {m.description.split(": ", 1)[1] for m in found}
    assert {"statement: dropped `y = x[1:n].clone()`", "removal: x[1:n].clone() → x[1:n]",
            "off-by-one: x[1:n] → x[1:n + 1]", "dim: dim=0 → 1", "comparison: n < 2 → n <= 2",
            "keyword: y.sum(dim=0) → y.sum()", "constant: 1 → 2"} <= said, sorted(said)
    # Exercise 10's stub is whole code with one bug: its given functions stay as they are.
    ex10 = mutation.exercise_mutants("ex10")
    source = (REPO / "solutions" / "ex10_fix_deadlock.py").read_text(encoding="utf-8")
    train = next(n for n in ast.parse(source).body if getattr(n, "name", "") == "train")
    assert ex10 and all(train.lineno <= m.line <= train.end_lineno for m in ex10)


def test_a_sample_is_caught_a_no_op_is_equivalent_and_a_gap_survives():
    found = mutation.exercise_mutants("ex14")
    sample = found[::len(found) // 8][:8]
    # Two changes no check can catch: one makes no difference at all; the other adds half-precision scores up in
    # half precision (within the checks' tolerance for fp16 and bf16), which the differential test tells apart.
    no_op = EX14.replace("    table.clear()", "    del table[:]")
    half = EX14.replace("acc = torch.promote_types(q.dtype, torch.float32)", "acc = q.dtype")
    assert no_op != EX14 and half != EX14
    planted = [Mutant("ex14-no-op", 0, "statement", "table.clear() → del table[:]", no_op),
               Mutant("ex14-half-sums", 0, "statement", "scores summed in the inputs' own dtype", half)]
    r = mutation.score_mutants("ex14", sample + planted, compare_seeds=(11,))
    assert r["caught"] == 8 and r["not_graded"] == 0, r
    assert [e["id"] for e in r["equivalents"]] == ["ex14-no-op"], r
    assert [s["id"] for s in r["survivors"]] == ["ex14-half-sums"], r
    assert "paged_attention(...)" in r["survivors"][0]["difference"], r["survivors"][0]
    assert r["score"] == 8 / 9


def test_the_table_of_each_kind_of_mistake_names_only_what_exists():
    """docs/mutation.md's table of each kind of mistake cannot go stale: every wrong answer it names is kept and graded
    with its words (tests/test_grading.py's WRONG_ANSWERS), every cheat is a file a test grades, every test it names
    exists, and every kind is shown by at least one of them."""
    section = (REPO / "docs" / "mutation.md").read_text(encoding="utf-8").split(
        "## Each kind of mistake, and the check that catches it\n", 1)[1].split("\n## ", 1)[0]
    tests = dict(re.findall(r"^- ([a-z]): `([^`]+)`", section, flags=re.MULTILINE))
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in section.splitlines()
            if line.startswith("| ") and not line.startswith("| kind of mistake")]
    assert len(rows) >= 20 and tests
    graded = (REPO / "tests" / "test_grading.py").read_text(encoding="utf-8")
    test_files = [p.read_text(encoding="utf-8") for p in (REPO / "tests").glob("test_*.py")
                  if p.name != Path(__file__).name]
    for kind, shown, letters in rows:
        named = re.findall(r"`((?:ex\d\d_\w+|cheats)/\w+)`", shown)
        keys = [k.strip() for k in letters.split(",") if k.strip()]
        assert named or keys, f"{kind!r}: shown by nothing"
        assert all(k in tests for k in keys), (kind, keys)
        for name in named:
            folder, answer = name.split("/")
            if folder == "cheats":
                assert (wrong_answers.ROOT / "cheats" / f"{answer}.py").is_file(), name
                assert any(answer in text for text in test_files), f"{name}: no test grades it"
            else:
                kept = wrong_answers.ROOT / folder / f"{answer}.py"
                assert answer in wrong_answers.read(folder) or kept.is_file(), f"{name}: no such wrong answer"
                assert f'"{name}"' in graded, f"{name}: not graded in tests/test_grading.py"
    for key, name in tests.items():
        path, function = name.split("::")
        tree = ast.parse((REPO / path).read_text(encoding="utf-8"))
        assert function in {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}, f"{key}: {name}"
