"""The grading process's first steps: ``python -m gpucourse.grading.start SPEC.json``.

Starting the sandbox is the slowest part of grading one exercise: a fresh
interpreter that imports torch. So this module, which imports nothing heavy,
starts it first (:mod:`.spawn`), and only then becomes the grading host
(:mod:`.host`), which imports torch and the checks while the sandbox imports
torch: the two starts overlap instead of following each other.
"""

from __future__ import annotations

import json
import os
import sys

from .spawn import become_subreaper, sandbox_user, spawn_sandbox


def main(argv: list[str]) -> int:
    with open(argv[0]) as f:
        spec = json.load(f)
    become_subreaper()
    os.umask(0o077)  # what this process writes (results, logs, the sandbox's output) is for root's eyes only
    private = os.path.join(spec["work"], "sandbox")
    os.makedirs(os.path.join(private, "tmp"), exist_ok=True)
    user = sandbox_user()
    if user is not None:
        os.chmod(spec["work"], 0o711)  # the sandbox user may pass through to its own folder, nothing else
        for folder in (private, os.path.join(private, "tmp")):
            os.chown(folder, user, user)
    first = spawn_sandbox(spec, private, os.path.join(spec["work"], "output.txt"), user)
    # Only now the checks and torch (the package's copy of the host: `except host.Stuck` in the checks matches it).
    if spec.get("host") == "equivalence":  # the differential test of mutants (gpucourse.grading.equivalence)
        from gpucourse.grading.equivalence import run
    else:
        from gpucourse.grading.host import run

    return run(spec, private, user, first)


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # the results are written and every process below is gone: skip unloading torch
