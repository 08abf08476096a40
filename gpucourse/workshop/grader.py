"""The workshop's grading service: a seat asks, the instructor's side grades.

Where every seat is a Unix user of its own (:mod:`.accounts`), the checks,
``solutions/`` and the workshop's state are out of a seat's reach, so
``check("ex03")`` in a seat's kernel cannot grade by itself: it asks this
service (:mod:`gpucourse.grading.remote`), which the hub starts with the
workshop and which runs as the hub's account. The service listens on a Unix
socket anyone may connect to; it knows which seat is asking from the
connection's peer credentials (the kernel's uid, set by the kernel, not by what
the kernel says), copies that seat's exercise files — only those the seat
could read itself (a link to a file only root may read stays unread) — and grades them with the
course's grader (:func:`gpucourse.grading.runner.grade`: learner code as
``nobody``, behind the sandbox's walls), with the workshop's folder hidden.
It answers with the result; the kernel shows it and records it in the seat's
progress file.

Run by the hub as ``python -m gpucourse.workshop.grader WORKSHOP_DIR``.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import struct
import sys
import tempfile
import threading
from pathlib import Path

from ..grading import catalog, remote, runner
from .folder import REPO, Workshop

REQUEST_LIMIT_BYTES = 64 << 10
MAX_TIMEOUT_S = 120.0  # the most a seat may ask of each check's budget
MAX_FILE_BYTES = 4 << 20  # of an exercise file, what is graded


def socket_path(ws: Workshop) -> Path:
    """Where the service listens: a folder of the workshop's own that every seat may pass through."""
    return ws.root / "grader" / "socket"


def seats_by_uid(ws: Workshop) -> dict[int, object]:
    """Each seat of the saved plan with an account of its own, by the account's uid."""
    from .plan import seat_account

    out = {}
    for seat in ws.saved_plan().seats:
        owner = seat_account(seat.name, False, seat.account)
        if owner is not None:
            out[owner[0]] = seat
    return out


def peer_uid(conn: socket.socket) -> int:
    """The uid of the process at the other end of a Unix socket, as the kernel recorded it at connect."""
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[1]


def read_request(conn: socket.socket) -> dict:
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(4096)
        if not chunk:
            break
        data += chunk
        if len(data) > REQUEST_LIMIT_BYTES:
            raise ValueError("the request is too long")
    request = json.loads(data)
    if not isinstance(request, dict):
        raise ValueError("a request is a JSON object")
    return request


def copy_as(uid: int, files: list[Path], into: Path) -> dict[str, str]:
    """Copy into ``into`` each of ``files`` that the seat of ``uid`` could read itself: its own, or one anyone may
    read (the service is root, and a seat's file could be a link to one only root may read; a link is not
    followed, and what the file is is asked of the file opened)."""
    copied = {}
    for path in files:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            continue
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if stat.S_ISREG(st.st_mode) and (st.st_uid == uid or st.st_mode & stat.S_IROTH):
                (into / path.name).write_bytes(f.read(MAX_FILE_BYTES))
                copied[path.name] = str(into / path.name)
    return copied


def grade_for(ws: Workshop, seat, request: dict) -> dict:
    """Grade what ``seat`` asked for; its result as :func:`runner.grade` makes it (messages name the seat's own
    files); ValueError with a sentence for a request the service does not take."""
    ids = [catalog.resolve(str(e))[0] for e in request.get("exercises") or []] or list(catalog.modules())
    which = request.get("folder", "exercises")
    if which not in remote.FOLDERS:
        raise ValueError(f"the service grades {' or '.join(remote.FOLDERS)}, not {which!r}")
    timeout = float(request.get("timeout", runner.DEFAULT_TIMEOUT_S))
    if not 0 < timeout <= MAX_TIMEOUT_S:
        raise ValueError(f"a check's budget must be more than 0 and at most {MAX_TIMEOUT_S:g} s")
    seed = request.get("seed")
    seed = None if seed is None else int(seed)
    if which == "solutions":
        return runner.grade(REPO / "solutions", ids, timeout=timeout, seed=seed, hidden_paths=(str(ws.root),))
    own = seat.folder / "exercises"
    work = Path(tempfile.mkdtemp(prefix="gpucourse-seat-"))
    try:
        from .plan import seat_account

        copy_as(seat_account(seat.name, False, seat.account)[0], sorted(own.glob("*.py")), work)  # every file: one may import another
        result = runner.grade(work, ids, timeout=timeout, seed=seed, hidden_paths=(str(ws.root),))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    # Messages name the seat's own folder, not the copy graded.
    return json.loads(json.dumps(result).replace(json.dumps(str(work))[1:-1], json.dumps(str(own))[1:-1]))


def answer(ws: Workshop, conn: socket.socket, seats: dict) -> None:
    """One request on ``conn``: graded, or refused in one sentence."""
    with conn:
        try:
            seat = seats.get(peer_uid(conn))
            if seat is None:
                reply = {"error": "only a seat of this workshop may ask its grading service for a grade"}
            else:
                reply = grade_for(ws, seat, read_request(conn))
        except (ValueError, KeyError) as e:
            reply = {"error": str(e.args[0] if e.args else e)}
        except Exception as e:  # noqa: BLE001 - the grader's failure is said to the seat, never left unanswered
            reply = {"error": f"the grading service failed: {type(e).__name__}: {e}"}
        try:
            conn.sendall(json.dumps(reply).encode())
        except OSError:
            pass  # the kernel gave up (interrupted): nothing to tell


def listen(ws: Workshop) -> socket.socket:
    """The service's socket, in a folder every seat may pass through, that every seat may connect to."""
    path = socket_path(ws)
    path.parent.mkdir(exist_ok=True)
    os.chmod(path.parent, 0o755)
    path.unlink(missing_ok=True)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    os.chmod(path, 0o666)
    server.listen(64)
    return server


def main(argv: list[str]) -> int:
    ws = Workshop(argv[0])
    seats = seats_by_uid(ws)
    server = listen(ws)
    while True:
        conn, _ = server.accept()
        threading.Thread(target=answer, args=(ws, conn, seats), daemon=True).start()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
