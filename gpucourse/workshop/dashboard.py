"""The class dashboard: a page for the instructor, served by JupyterHub as a service, behind the hub's login.

The hub starts this process with the workshop (``/services/dashboard/``). Whoever
opens the page is sent through the hub's OAuth login (``HubOAuth``); the hub
grants access to a service only to users allowed ``access:services`` — the
admin, that is the instructor — so a learner who logs in with a seat's code is
refused. The page redraws itself every few seconds from the same
:func:`gpucourse.workshop.report.class_report` that ``gpucourse workshop
status`` prints; ``api/report`` gives it as JSON.

Run by the hub as ``python -m gpucourse.workshop.dashboard WORKSHOP_DIR``.
"""

from __future__ import annotations

import html
import json
import os
import sys
from urllib.parse import urlparse

from jupyterhub.services.auth import HubOAuthCallbackHandler, HubOAuthenticated
from jupyterhub.utils import url_path_join
from tornado import ioloop, web

from .folder import Workshop
from .hub import request
from .report import ago, class_report, rung, tries

REFRESH_S = 10
STYLE = """
body { font-family: system-ui, sans-serif; margin: 1.5em; color: #222; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em; }
th, td { border-bottom: 1px solid #ddd; padding: 4px 10px; text-align: left; vertical-align: top; }
th { background: #f4f4f4; }
.ex { display: inline-block; margin: 1px 2px; padding: 0 4px; border-radius: 3px; font-size: 85%; }
.passed { background: #d6f5dd; color: #1a7f37; } .tried { background: #fde9cf; color: #8a4b00; }
.untried { background: #eee; color: #999; } .broken { background: #fde2e1; color: #b42318; }
.hint { color: #555; font-size: 90%; } .note { color: #555; }
.trouble { color: #b42318; font-weight: bold; } pre { font-size: 80%; max-width: 60em; overflow-x: auto; }
"""


def _e(value) -> str:
    return html.escape(str(value))


def _exercise_chips(seat: dict, modules: list[str]) -> str:
    chips = []
    for module in modules:
        e = seat["exercises"].get(module)
        short = module.split("_", 1)[0]
        if module in seat.get("grading_broken", {}):
            chips.append(f'<span class="ex broken" title="{_e(module)}: the grader could not run">'
                         f'{_e(short)} ⚠</span>')
        elif e is None:
            chips.append(f'<span class="ex untried" title="{_e(module)}: not graded yet">{_e(short)}</span>')
        elif e.get("passed"):
            chips.append(f'<span class="ex passed" title="{_e(module)}: passed">{_e(short)} ✔</span>')
        else:
            chips.append(f'<span class="ex tried" title="{_e(module)}: best {e.get("best", 0):g}/'
                         f'{e.get("max_score", 0):g} in {tries(e.get("attempts", 0))}">{_e(short)} '
                         f'{e.get("best", 0):g}/{e.get("max_score", 0):g}</span>')
    return "".join(chips)


def _kernels(kernels: dict) -> str:
    """A seat's kernels: their state, and for one in trouble what happened and the end of the server's log."""
    if not kernels["problem"]:
        return _e(kernels["state"])
    return (f'<span class="trouble">{_e(kernels["state"])}</span><div class="hint">{_e(kernels["problem"])}</div>'
            f'<details><summary>server log</summary><pre>{_e(kernels["log"])}</pre></details>')


def render(report: dict, modules: list[str]) -> str:
    """The dashboard page for a class report (plain HTML that reloads itself)."""
    on_slurm = any(s.get("job") for s in report["seats"])
    parts = [f'<!doctype html><html><head><meta charset="utf-8"><meta http-equiv="refresh" content="{REFRESH_S}">'
             f'<title>gpucourse workshop</title><style>{STYLE}</style></head><body>',
             f'<h2>gpucourse workshop — {len(report["seats"])} seats</h2>',
             '<p class="note">' + "<br>".join(_e(n) for n in report["notes"]) + "</p>"]
    if report["grading_broken"]:
        parts.append('<h3 class="trouble">Grading broken: see to it</h3><p class="note">The grader could not run '
                     "for these seats: not the learners' code. Once it runs again, they check again.</p><ul>"
                     + "".join(f'<li class="trouble">{_e(line)}</li>' for line in report["grading_broken"]) + "</ul>")
    parts.append("<h3>Seats</h3><table><tr><th>seat</th><th>resources</th>" + ("<th>SLURM job</th>" if on_slurm else "")
                 + "<th>server</th><th>kernels</th>"
                 "<th>last activity</th>"
                 "<th>exercises</th><th>score (of the whole course)</th>"
                 "<th>quiz by topic</th><th>stuck on</th></tr>")
    for s in report["seats"]:
        quiz = "<br>".join(f"{_e(t)} {c}/{n}" for t, (c, n) in sorted(s["quiz"].items())) or "—"
        score = "—" if s["problem"] else f'{s["score"]:g}/{s["max_score"]:g}'
        if s["problem"]:
            stuck = f"progress file unreadable: {_e(s['problem'])}"
        elif s["grading_broken"]:
            stuck = f'<span class="trouble">grading broken: {_e(", ".join(s["grading_broken"]))}</span> (see above)'
        elif s["stuck"]:
            st = s["stuck"]
            stuck = (f"<b>{_e(st['exercise'])}</b>" + (f": {_e(st['check'])}" if st["check"] else "")
                     + f" ({tries(st['attempts'])}; {rung(st['attempts'])})" + (f'<div class="hint">hint: {_e(st["hint"])}</div>'
                                                       if st["hint"] else ""))
        else:
            stuck = "—"
        job = f'<td class="job">{_e(s["job"])}</td>' if on_slurm else ""
        parts.append(f'<tr id="seat-{_e(s["name"])}"><td><b>{_e(s["name"])}</b></td><td>{_e(s["resources"])}</td>{job}'
                     f'<td>{_e(s["server"])}</td><td>{_kernels(s["kernels"])}</td>'
                     f'<td>{_e(ago(s["last_activity"]))}</td>'
                     f'<td>{s["passed"]}/{s["exercises_total"]} passed<br>{_exercise_chips(s, modules)}</td>'
                     f'<td>{score}</td><td>{quiz}</td><td>{stuck}</td></tr>')
    parts.append("</table><h3>What to explain next</h3>")
    if report["common_failures"]:
        parts.append("<table><tr><th>seats</th><th>exercise: check</th><th>hint</th></tr>")
        for f in report["common_failures"]:
            parts.append(f'<tr><td>{f["count"]} ({_e(", ".join(f["seats"]))})</td>'
                         f'<td>{_e(f["exercise"])}: {_e(f["check"])}</td><td class="hint">{_e(f["hint"])}</td></tr>')
        parts.append("</table>")
    else:
        parts.append('<p class="note">No failing check recorded yet.</p>')
    gpu = report["gpu"]
    parts.append(f'<h3>GPU use</h3><p class="note">{_e(gpu["note"])}</p>')
    rows = [(name, g) for name, gs in gpu["seats"].items() for g in gs]
    if rows:
        parts.append("<table><tr><th>seat</th><th>GPU</th><th>busy</th><th>memory</th></tr>")
        for name, g in rows:
            if "error" in g:
                parts.append(f"<tr><td>{_e(name)}</td><td>{_e(g['gpu'])}</td><td colspan=2>{_e(g['error'])}</td></tr>")
            else:
                parts.append(f"<tr><td>{_e(name)}</td><td>{_e(g['gpu'])} {_e(g['name'])}</td>"
                             f"<td>{g['utilization']}%</td><td>{g['memory_used'] / 2**30:.1f} / "
                             f"{g['memory_total'] / 2**30:.1f} GiB</td></tr>")
        parts.append("</table>")
    parts.append(f'<p class="note">{_e(gpu["hint"])}.</p>')
    parts.append(f'<p class="note">Redrawn every {REFRESH_S} s; as JSON: <a href="api/report">api/report</a>.</p>'
                 "</body></html>")
    return "".join(parts)


def current_report(ws: Workshop) -> dict:
    """The class report now, with the hub's view of each seat's server (asked with this service's own token)."""
    status, users = request(url_path_join(os.environ["JUPYTERHUB_API_URL"], "users"),
                            token=os.environ["JUPYTERHUB_API_TOKEN"])
    by_name = {u["name"]: u for u in users} if status == 200 and isinstance(users, list) else None
    return class_report(ws, by_name, running=True)


class Page(HubOAuthenticated, web.RequestHandler):
    """The dashboard itself; HubOAuthenticated sends strangers to the hub's login and refuses non-admins (403)."""

    def initialize(self, workshop: Workshop, modules: list[str]):
        self.workshop, self.modules = workshop, modules

    @web.authenticated
    def get(self):
        self.set_header("Cache-Control", "no-store")
        self.write(render(current_report(self.workshop), self.modules))


class ReportData(Page):
    """The same report as JSON."""

    @web.authenticated
    def get(self):
        self.set_header("Cache-Control", "no-store")
        self.set_header("Content-Type", "application/json")
        self.write(json.dumps(current_report(self.workshop), indent=1))


def main(argv: list[str] | None = None) -> None:
    """Serve the dashboard where the hub said (``JUPYTERHUB_SERVICE_URL``) until the hub stops it."""
    from .report import course_exercises

    workshop = Workshop((argv or sys.argv[1:])[0])
    prefix = os.environ["JUPYTERHUB_SERVICE_PREFIX"]
    where = urlparse(os.environ["JUPYTERHUB_SERVICE_URL"])
    options = {"workshop": workshop, "modules": course_exercises()}
    app = web.Application([
        (prefix, Page, options),
        (url_path_join(prefix, "api/report"), ReportData, options),
        (url_path_join(prefix, "oauth_callback"), HubOAuthCallbackHandler),
    ], cookie_secret=os.urandom(32))
    app.listen(where.port, where.hostname)
    try:
        ioloop.IOLoop.current().start()
    except KeyboardInterrupt:  # how the hub stops its services
        pass


if __name__ == "__main__":
    main()
