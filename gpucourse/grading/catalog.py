"""Which exercises there are, read from the names of their checks' files: nothing is imported.

``check("ex01")`` in a notebook resolves the exercise and starts the grader from here, so a kernel that has not
imported torch yet does not import it (and every check of the course) just to ask for a grade: the grading
process imports them, while its sandbox starts.
"""

from __future__ import annotations

import os
import re

CHECKS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "checks")
MAX_CHECKS = 24  # no exercise has more checks (a test holds them to it): the runner's deadline counts on it
POINTS = 10      # what each exercise is worth in all (a test holds every one to it)


def modules() -> dict[str, str]:
    """Every exercise's module name by id ("ex01": "ex01_ring_allreduce"), in course order."""
    names = sorted(f[:-3] for f in os.listdir(CHECKS) if re.fullmatch(r"ex\d\d_\w+\.py", f))
    return {name[:4]: name for name in names}


def resolve(key: str) -> tuple[str, str]:
    """The exercise named by ``key`` ("ex03", "3", "03" or "ex03_gradient_buckets") as (id, module); KeyError with
    one sentence if there is none."""
    known = modules()
    k = str(key).strip().lower().removesuffix(".py")
    if k.isdigit():
        k = f"ex{int(k):02d}"
    for ex_id, module in known.items():
        if k in (ex_id, module):
            return ex_id, module
    raise KeyError(f"no exercise called {key!r}; there are {', '.join(known)}")
