"""Grading asked of a service on the instructor's side: what ``check()`` does in a workshop seat of its own.

Where a seat runs as a Unix user of its own (:mod:`gpucourse.workshop.accounts`),
the checks and ``solutions/`` are hidden from it, so its kernel cannot grade
anything itself. ``$GPUCOURSE_GRADER`` names the workshop's grading service, a
Unix socket: the kernel sends one JSON line (the exercises, the seed, the
budget, and which folder: the seat's own ``exercises/`` or the course's
``solutions/``), and the service — which knows the seat by the kernel's user
(the socket's peer credentials, which a process cannot forge) — grades that
seat's files and answers with the same result :func:`.runner.grade` returns.
"""

from __future__ import annotations

import json
import os
import socket

ENV_VAR = "GPUCOURSE_GRADER"
FOLDERS = ("exercises", "solutions")  # what a seat may ask to have graded, by name
ANSWER_LIMIT_BYTES = 64 << 20


class ServiceError(RuntimeError):
    """The grading service could not be asked, or could not grade: one sentence, not the learner's doing."""


def service() -> str | None:
    """The grading service's socket when this process is in a workshop seat that has one, else None."""
    return os.environ.get(ENV_VAR) or None


def folder_name(folder, repository, seat_exercises) -> str:
    """Which folder a seat asks for: ``exercises`` (none named, or its own) or ``solutions`` (the course's);
    ValueError with one sentence for any other."""
    if folder is None:
        return "exercises"
    path = os.path.realpath(folder)
    if path == os.path.realpath(seat_exercises):
        return "exercises"
    if path == os.path.realpath(os.path.join(repository, "solutions")):
        return "solutions"
    raise ValueError(f"in a workshop seat the grader grades this seat's exercises/ (or the course's solutions/), "
                     f"not {folder}; copy the file into exercises/ and check it there")


def ask(path: str, request: dict, timeout: float) -> dict:
    """Send ``request`` to the service at ``path`` and return its result; ServiceError with a sentence when it
    does not answer or answers with a refusal."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(timeout)
            s.connect(path)
            s.sendall(json.dumps(request).encode() + b"\n")
            s.shutdown(socket.SHUT_WR)
            chunks, size = [], 0
            while chunk := s.recv(1 << 16):
                chunks.append(chunk)
                size += len(chunk)
                if size > ANSWER_LIMIT_BYTES:
                    raise ServiceError("the workshop's grading service answered with more than it may send")
    except socket.timeout:
        raise ServiceError(f"the workshop's grading service did not answer within {timeout:.0f} s") from None
    except OSError as e:
        raise ServiceError(f"the workshop's grading service ({path}) cannot be reached: {e.strerror or e}") from None
    try:
        answer = json.loads(b"".join(chunks))
    except ValueError:
        raise ServiceError("the workshop's grading service ended without an answer") from None
    if not isinstance(answer, dict) or "error" in answer:
        raise ServiceError(str(answer.get("error") if isinstance(answer, dict) else answer))
    return answer
