"""Does every seat's kernel start? What a class does at 9:00, done by the instructor at 8:55.

:func:`check` opens a notebook in every seat at the same moment, as a room of
learners does, through the hub's proxy and each seat's own REST API and
websocket — the path a browser takes — and in each new kernel runs one cell.
A seat passes when its kernel answers without being restarted and the cell
prints what it should; the kernel is shut down afterwards, leaving the seat as
it was. ``gpucourse workshop check`` prints the result, and says
which seats failed with the last lines of their server's log.

:func:`seat_kernels` is what the class report shows of a seat's kernels, read
from its server's log (``hub/logs/<seat>.log``): a kernel that died and could
not be restarted, or a restart under way, with the log's last lines.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from datetime import datetime
from pathlib import Path

from .errors import WorkshopError
from .folder import Workshop

CELL = "print(6 * 7)"
ANSWER = "42"
KERNEL_TIMEOUT_S = 120.0   # for one seat's kernel to start and run the cell, on a machine every seat starts on
CHECK_NOTEBOOK = "notebooks/kernel-check.ipynb"  # the session's path: never written, it sets the kernel's folder

# What jupyter_server and jupyter_client write to a seat's log about its kernels (their own wording).
_STARTED = re.compile(r"^\[I (\S+ \S+) \w+\] Kernel started: ([0-9a-f-]{36})")
_DIED = re.compile(r"^\[W (\S+ \S+) \w+\] Kernel ([0-9a-f-]{36}) died, removing from map")
_RESTARTING = re.compile(r"^\[I (\S+ \S+) \w+\] \w*KernelRestarter: restarting kernel \((\d+)/(\d+)\)")
_RESTARTED = re.compile(r"^\[W (\S+ \S+) \w+\] kernel ([0-9a-f-]{36}) restarted")


def _message(msg_type: str, content: dict, session: str, channel: str = "shell") -> dict:
    """A Jupyter message as the kernel websocket's JSON protocol carries it."""
    return {"header": {"msg_id": uuid.uuid4().hex, "msg_type": msg_type, "username": "gpucourse", "session": session,
                       "date": datetime.now().astimezone().isoformat(), "version": "5.3"},
            "parent_header": {}, "metadata": {}, "content": content, "channel": channel, "buffers": []}


async def _talk(ws, request: dict, deadline: float, restarts: list[str]) -> tuple[dict, str]:
    """Send ``request`` and read until its reply and the kernel's idle after it: (reply content, printed text)."""
    ws.write_message(json.dumps(request))
    parent, reply, printed, idle = request["header"]["msg_id"], None, [], False
    while reply is None or not idle:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError
        raw = await asyncio.wait_for(ws.read_message(), remaining)
        if raw is None:
            raise ConnectionError("the server closed the kernel's websocket")
        msg = json.loads(raw)
        kind, content = msg.get("msg_type") or msg["header"]["msg_type"], msg.get("content", {})
        if kind == "status" and content.get("execution_state") in ("restarting", "autorestarting", "dead"):
            restarts.append(content["execution_state"])
            if content["execution_state"] == "dead":
                raise ConnectionError("the kernel died and its server gave it up")
        if msg.get("parent_header", {}).get("msg_id") != parent:
            continue
        if kind == f"{request['header']['msg_type'].rsplit('_', 1)[0]}_reply":
            reply = content
        elif kind == "stream":
            printed.append(content.get("text", ""))
        elif kind == "status" and content.get("execution_state") == "idle":
            idle = True
    return reply, "".join(printed)


async def _one_server(seat: str, api: str, token: str, code: str, expect: str | None, timeout: float,
                      kernel: str) -> dict:
    """Open a notebook session on the Jupyter server whose REST API is at ``api`` (``seat``'s), wait for its
    kernel, run ``code``, shut the kernel down."""
    from tornado.httpclient import AsyncHTTPClient, HTTPClientError, HTTPRequest
    from tornado.websocket import websocket_connect

    t0 = time.monotonic()
    deadline = t0 + timeout
    left = lambda: max(1.0, deadline - time.monotonic())  # noqa: E731
    headers = {"Authorization": f"token {token}"}
    client = AsyncHTTPClient(force_instance=True)
    result = {"seat": seat, "ok": False, "seconds": None, "ready_s": None, "output": "", "restarts": 0,
              "problem": None}
    restarts: list[str] = []
    session, stage = None, "starting a kernel"
    try:
        body = json.dumps({"path": CHECK_NOTEBOOK, "name": Path(CHECK_NOTEBOOK).name, "type": "notebook",
                           "kernel": {"name": kernel}})
        response = await client.fetch(HTTPRequest(f"{api}/sessions", "POST", headers=headers, body=body,
                                                  request_timeout=left()))
        session = json.loads(response.body)
        kernel_id, channel_session = session["kernel"]["id"], uuid.uuid4().hex
        stage = "connecting to the kernel"
        url = f"{api}/kernels/{kernel_id}/channels?session_id={channel_session}".replace("http", "ws", 1)
        connecting = asyncio.ensure_future(websocket_connect(HTTPRequest(url, headers=headers,
                                                                         connect_timeout=left(),
                                                                         request_timeout=left())))
        # The server answers the websocket only once the kernel does; a kernel that keeps dying is given up
        # (removed) by its server after five restarts, and the websocket then never answers: ask meanwhile.
        while not connecting.done():
            await asyncio.wait([connecting], timeout=1.0)
            if not connecting.done():
                alive = await client.fetch(HTTPRequest(f"{api}/kernels/{kernel_id}", headers=headers,
                                                       request_timeout=left()), raise_error=False)
                if alive.code == 404:
                    connecting.cancel()
                    raise ConnectionError("the kernel kept dying, and its server gave it up after restarting it")
        ws = connecting.result()
        try:
            stage = "waiting for the kernel to answer"
            await _talk(ws, _message("kernel_info_request", {}, channel_session), deadline, restarts)
            result["ready_s"] = time.monotonic() - t0
            stage = "running the cell"
            reply, printed = await _talk(ws, _message("execute_request", {
                "code": code, "silent": False, "store_history": False, "user_expressions": {},
                "allow_stdin": False, "stop_on_error": True}, channel_session), deadline, restarts)
        finally:
            ws.close()
        result["output"] = printed.strip()
        if reply.get("status") != "ok":
            result["problem"] = f"the cell failed: {reply.get('ename')}: {reply.get('evalue')}"
        elif restarts:
            result["problem"] = f"the kernel was restarted {len(restarts)} time(s) before it answered"
        elif expect is not None and result["output"] != expect:
            result["problem"] = f"the cell printed {result['output']!r}, not {expect!r}"
        else:
            result["ok"] = True
    except TimeoutError:
        result["problem"] = f"{stage}: no answer within {timeout:g} s"
    except HTTPClientError as e:
        result["problem"] = f"{stage}: " + (f"no answer within {timeout:g} s" if e.code == 599 else
                                            f"HTTP {e.code} ({e.message})")
    except (ConnectionError, OSError) as e:
        result["problem"] = f"{stage}: {e or type(e).__name__}"
    finally:
        if session is not None:
            try:
                await client.fetch(HTTPRequest(f"{api}/sessions/{session['id']}", "DELETE", headers=headers,
                                               request_timeout=30))
            except (HTTPClientError, OSError):
                pass  # a kernel its server already gave up is gone, and its session with it
        client.close()
    result["restarts"] = len(restarts)
    result["seconds"] = time.monotonic() - t0
    return result


def open_all_at_once(servers: dict[str, str], token: str, code: str = CELL, expect: str | None = ANSWER,
                     timeout: float = KERNEL_TIMEOUT_S, kernel: str = "python3") -> list[dict]:
    """One kernel on each Jupyter server, all asked for in the same moment; each runs ``code``. One dict per
    server, in order: ``{"seat", "ok", "seconds", "ready_s" (until the kernel answered), "output", "restarts",
    "problem"}``.

    ``servers``: a name for each server (a seat) and its REST API's address
    (through a hub: its address, then ``/user/<seat>/api``);
    ``token``: one every server accepts (a hub's with ``access:servers``);
    ``expect``, when given, is what the cell must print.
    """
    async def every_seat():
        return await asyncio.gather(*(_one_server(name, api, token, code, expect, timeout, kernel)
                                      for name, api in servers.items()))

    return asyncio.run(every_seat())


def check(root=None, seats: list[str] | None = None, rounds: int = 1, timeout: float | None = None,
          code: str = CELL, expect: str | None = ANSWER) -> dict:
    """Open a notebook in every seat (or ``seats``) at once and run a cell in each, ``rounds`` times.

    The cell is ``code``; a seat passes a round when its kernel answers without
    being restarted and the cell prints ``expect`` (anything, when None).

    Returns ``{"rounds": [[seat result, ...], ...], "failed": {seat: [problem, ...]}, "logs": {seat: tail}}``.
    The workshop must be running.
    """
    from . import hub

    if rounds < 1:
        raise WorkshopError(f"--rounds {rounds} must be at least 1.")
    if timeout is not None and timeout <= 0:
        raise WorkshopError(f"--timeout {timeout:g} must be more than 0.")
    ws = Workshop(root)
    settings = ws.settings()
    names = list(seats or settings["seats"])
    unknown = [s for s in names if s not in settings["seats"]]
    if unknown:
        raise WorkshopError(f"no seat named {', '.join(unknown)} in this workshop (it has "
                            f"{', '.join(settings['seats'])}).")
    state = hub.running(ws)
    if state is None:
        raise WorkshopError(f"the workshop in {ws.root} is not running; start it with '{ws.command('start')}'.")
    base = hub.local_url(state)
    every_round, failed = [], {}
    for _ in range(rounds):
        results = open_all_at_once({s: f"{base}/user/{s}/api" for s in names}, hub.api_token(ws), code, expect,
                                   timeout or KERNEL_TIMEOUT_S)
        every_round.append(results)
        for r in results:
            if not r["ok"]:
                failed.setdefault(r["seat"], []).append(r["problem"])
    return {"rounds": every_round, "failed": failed, "logs": {s: ws.seat_log_tail(s) for s in failed}}


def format_check(found: dict) -> str:
    """What ``gpucourse workshop check`` prints: one line a round, then each failing seat with its log's end."""
    lines = []
    for i, results in enumerate(found["rounds"], 1):
        ok = [r for r in results if r["ok"]]
        slowest = max((r["ready_s"] for r in ok), default=0.0)
        lines.append(f"round {i}: {len(ok)}/{len(results)} seats' kernels started and ran a cell"
                     + (f" (the slowest ready in {slowest:.1f} s)" if ok else ""))
        lines += [f"  {r['seat']}: {r['problem']}" for r in results if not r["ok"]]
    if not found["failed"]:
        lines.append("every seat's kernel works.")
    for seat, tail in found["logs"].items():
        lines.append(f"\n{seat}'s server log ends with:\n{tail}")
    return "\n".join(lines)


# --- what a seat's server says about its kernels ------------------------------------------------------------

def kernel_history(log_text: str) -> dict:
    """What a seat's log says of its kernels: ``{"started": time of the last start, "died": [(time, kernel id),
    ...] (kernels its server gave up), "restarts": n (kernels its server restarted), "restarting": "n/m" while
    a restart is under way, else None}``. Times are the log's own ("2026-12-04 09:01:12.345")."""
    started, died, restarts, restarting = None, [], 0, None
    for line in log_text.splitlines():
        if m := _STARTED.match(line):
            started, restarting = m.group(1), None
        elif m := _DIED.match(line):
            died.append((m.group(1), m.group(2)))
            restarting = None
        elif m := _RESTARTING.match(line):
            restarts += 1
            restarting = f"{m.group(2)}/{m.group(3)}"
        elif _RESTARTED.match(line):
            restarting = None
    return {"started": started, "died": died, "restarts": restarts, "restarting": restarting}


def seat_kernels(ws: Workshop, seat: str) -> dict:
    """What the class report shows of a seat's kernels, from its server's log.

    ``{"state": "ok" (or "ok, n died before") | "died" | "restarting" | "none", "died": n, "restarts": n,
    "problem": a sentence or None, "log": the log's last lines when there is a
    problem}``. A kernel that died and that its server could not bring back is a
    problem until a kernel starts in that seat again; so is a restart under way.
    """
    try:
        text = ws.seat_log(seat).read_text(errors="replace")
    except OSError:
        text = ""
    history = kernel_history(text)
    last_death = history["died"][-1][0] if history["died"] else None
    state, problem = ("ok" if history["started"] else "none"), None
    if history["died"]:
        state = f"ok, {len(history['died'])} died before"
    if history["restarting"]:
        state, problem = "restarting", (f"its server is restarting a kernel that stopped ({history['restarting']} "
                                        f"tries)")
    elif last_death and (history["started"] is None or last_death >= history["started"]):
        state = "died"
        problem = (f"a kernel died at {last_death[:19]} and could not be restarted, and none has started since: "
                   f"the learner's notebook has no kernel (Kernel → Restart Kernel starts a new one)")
    return {"state": state, "died": len(history["died"]), "restarts": history["restarts"], "problem": problem,
            "log": ws.seat_log_tail(seat) if problem else None}
