"""Probes: the code that drives a learner's functions through a scenario, inside the sandbox.

A probe module has the name of its exercise (``ex03_gradient_buckets.py``);
each function takes the learner's module first, then the inputs a check sent,
runs the learner's code and returns what it observed — tensors and plain data.
A probe holds no expected value and no reference implementation: a learner may
read it (it is the harness of the test, not the answer), and the verdict is
made from its observations by the checks, in the grader's own process.
"""

from __future__ import annotations

import pkgutil

NAMES = sorted(m.name for m in pkgutil.iter_modules(__path__) if m.name.startswith("ex"))
