"""The wrong answers are kept as edits of their solutions (tests/wrong_answers.py): each edit must still apply, once,
to the solution as it is now, and none is also kept whole."""

from __future__ import annotations

import pytest

import wrong_answers


def test_every_edit_applies_once_to_its_solution_as_it_is_now(tmp_path):
    made = wrong_answers.materialise(tmp_path)
    edited = {f"{ex}/{name}" for ex in wrong_answers.exercises() for name in wrong_answers.read(ex)}
    assert len(edited) >= 120 and edited <= set(made)
    for key in edited:  # each made module is Python, differs from its solution, and says what it teaches first
        text = made[key].read_text()
        compile(text, str(made[key]), "exec")
        solution = (wrong_answers.SOLUTIONS / f"{key.split('/')[0]}.py").read_text()
        assert text != solution and text.lstrip().startswith('"""'), key


def test_an_edit_the_solution_no_longer_holds_is_refused_naming_it(tmp_path):
    (tmp_path / "solutions").mkdir()
    (tmp_path / "mutants").mkdir()
    (tmp_path / "solutions" / "ex99_demo.py").write_text('"""Solved."""\n\ndef f(x):\n    return x + 1\n')
    (tmp_path / "mutants" / "ex99_demo.edits").write_text(repr(
        {"off_by_two": {"teaches": '"""Adds two."""\n', "replace": [("return x + 1", "return x + 2")]},
         "stale": {"teaches": '"""Gone."""\n', "replace": [("return x - 1", "return x")]}}))
    with pytest.raises(wrong_answers.EditError, match=r"ex99_demo/stale: edit 1 .* found 0 times"):
        wrong_answers.materialise(tmp_path / "out", root=tmp_path / "mutants", solutions=tmp_path / "solutions")
    assert (tmp_path / "out" / "ex99_demo" / "off_by_two.py").read_text() == '"""Adds two."""\n\ndef f(x):\n' \
                                                                            '    return x + 2\n'


def test_no_wrong_answer_is_kept_both_as_edits_and_whole():
    for exercise in wrong_answers.exercises():
        folder = wrong_answers.ROOT / exercise
        whole = {p.stem for p in folder.glob("*.py")} if folder.is_dir() else set()
        assert not whole & set(wrong_answers.read(exercise)), exercise
