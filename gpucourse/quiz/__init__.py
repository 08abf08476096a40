"""Exam-style questions on what the course teaches, checked with an explanation that cites the formula.

The NVIDIA-Certified Professional: Generative AI LLMs exam's "GPU Acceleration
and Optimization" section has four topics (:data:`TOPICS`); every question of
the bank belongs to one and names the notebook that teaches it::

    from gpucourse.quiz import ask, grade, quiz, mock_exam, score_exam
    quiz("parallelism")                       # in a notebook: 5 questions, checked as you go
    q = ask(count=1, seed=0)[0]
    grade(q, "b")                             # (False, "Not quite: the answer is ... because ...")
    exam = mock_exam(40, seed=1)              # 40 choice questions by the exam's topic weights, 60 minutes
    score_exam(exam, answers)                 # score, per topic, wrong ones, notebooks to revisit, time

From a terminal: ``gpucourse quiz [--topic T] [--count N] [--seed S]``,
``gpucourse quiz --exam``, ``gpucourse quiz --review`` (the questions you
missed, spaced over sessions: :mod:`gpucourse.quiz.review`) and ``gpucourse
quiz --export FILE``. Scores and each answer go to your progress file
(:mod:`gpucourse.course.progress`).
"""

from .bank import NOTEBOOKS, TOPICS, BankError, ask, export_bank, grade, load_bank, parse_response
from .exam import EXAM_WEIGHTS, SECONDS_PER_QUESTION, Exam, format_report, mock_exam, most_questions, score_exam
from .widget import exam, quiz

__all__ = ["EXAM_WEIGHTS", "NOTEBOOKS", "SECONDS_PER_QUESTION", "TOPICS", "BankError", "Exam", "ask", "exam",
           "export_bank", "format_report", "grade", "load_bank", "mock_exam", "most_questions", "parse_response",
           "quiz", "score_exam"]
