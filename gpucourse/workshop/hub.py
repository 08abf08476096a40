"""Starting and stopping a workshop's JupyterHub: the generated config, the processes, the hub's REST API.

``start`` checks everything first — the seats, the GPUs, the port, that JupyterHub
and its proxy are installed — and only then writes the workshop folder and
starts the hub. The hub starts the proxy (configurable-http-proxy, the one
process that listens on the public port), the class dashboard (a hub service),
and, asked by ``start`` through its REST API, every seat's JupyterLab, so that
the first learner to log in finds their server already running. ``start``
returns once every seat answers through the proxy.

The hub runs in a session of its own, so it outlives the ``gpucourse`` command
that started it; ``stop`` ends it and then makes sure nothing of the workshop
is left (see :mod:`gpucourse.workshop.processes`).
"""

from __future__ import annotations

import getpass
import importlib.util
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

from ..course import kernel_sockets, lab
from ..grading.spawn import isolation_problem
from . import accounts, processes, slurm_seats
from .errors import WorkshopError
from .folder import Workshop, copy_course, write_private
from .plan import INSTRUCTOR, Plan, kernel_folder, seat_account, seat_names, visible_gpu_ids

DEFAULT_PORT = 8000
START_TIMEOUT_S = 300.0   # for the hub and every seat to answer, on a busy machine
STOP_TIMEOUT_S = 60.0     # for the hub to stop its servers and its proxy
PROXY = "configurable-http-proxy"
INSTALL_HINT = "'make workshop-deps' installs JupyterHub (pip) and configurable-http-proxy (npm)"
DASHBOARD = "dashboard"   # the service's name: its page is /services/dashboard/
CONTROL = "gpucourse"     # the service the gpucourse commands act as, with the API token in secrets/
GRADER = "grader"         # the grading service seats with accounts of their own ask (gpucourse.workshop.grader)

_started: dict[int, subprocess.Popen] = {}  # hubs started by this process, by pid


# --- what must be installed ----------------------------------------------------------------------------------

def find_proxy() -> str | None:
    """configurable-http-proxy: ``$GPUCOURSE_PROXY``, else the one npm put in this environment, else on PATH."""
    named = os.environ.get("GPUCOURSE_PROXY")
    if named:
        return named if os.access(named, os.X_OK) else None
    local = Path(sys.prefix) / "node_modules" / ".bin" / PROXY  # where 'make workshop-deps' installs it
    if os.access(local, os.X_OK):
        return str(local)
    return shutil.which(PROXY)


def required_programs() -> str:
    """The proxy's path; a sentence naming what is missing and the make target that installs it."""
    if importlib.util.find_spec("jupyterhub") is None:
        raise WorkshopError(f"JupyterHub is not installed in this Python; {INSTALL_HINT}.")
    proxy = find_proxy()
    if proxy is None:
        raise WorkshopError(f"the hub's proxy, {PROXY}, was not found; {INSTALL_HINT}.")
    return proxy


# --- ports ---------------------------------------------------------------------------------------------------

def port_free(host: str, port: int) -> bool:
    """Whether a server could listen on ``host:port`` now."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A port on 127.0.0.1 that nobody listens on now (the system picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- the generated config ------------------------------------------------------------------------------------

class Expression(str):
    """A value written into the config as Python code, not as a string."""

    def __repr__(self) -> str:
        return str(self)


def config_values(ws: Workshop, settings: dict, *, port: int, public: bool, proxy: str, hub_port: int,
                  proxy_api_port: int, dashboard_port: int, as_root: bool, nodes: dict | None = None,
                  seat_users: bool = False) -> dict:
    """Every JupyterHub setting of this workshop, ``"Class.trait": value`` (what :func:`render_config` writes).

    With SLURM seats (``settings["slurm"]``), ``nodes`` maps the partition's node names to their addresses.
    ``seat_users``: every seat runs as a Unix user of its own (:mod:`.accounts`), and checks go to the workshop's
    grading service (:mod:`.grader`), which the hub starts too.
    """
    system = settings["login"] == "system"
    python = sys.executable
    values = {
        "JupyterHub.bind_url": f"http://{'0.0.0.0' if public else '127.0.0.1'}:{port}",
        "JupyterHub.hub_ip": "127.0.0.1",
        "JupyterHub.hub_port": hub_port,
        "JupyterHub.db_url": f"sqlite:///{ws.hub_dir / 'jupyterhub.sqlite'}",
        "JupyterHub.pid_file": str(ws.hub_dir / "jupyterhub.pid"),
        "JupyterHub.cookie_secret_file": str(ws.secrets / "cookie_secret"),
        "JupyterHub.cleanup_servers": True,   # stopping the hub stops every seat's server …
        "JupyterHub.cleanup_proxy": True,     # … and the proxy it started
        "JupyterHub.last_activity_interval": 60,
        "JupyterHub.default_url": Expression("landing_page"),
        "JupyterHub.authenticator_class": "pam" if system else "gpucourse.workshop.auth.SeatAuthenticator",
        "Authenticator.allowed_users": set(settings["seats"]),
        "Authenticator.admin_users": {settings["admin"]},
        "Spawner.cmd": [python, "-m", "jupyterhub.singleuser"],
        # Kernels over Unix sockets: seats' servers never race for the same TCP port (gpucourse.course.kernel_sockets).
        "Spawner.args": (["--allow-root"] if as_root and not (system or seat_users) else [])
        + kernel_sockets.SERVER_ARGS,
        "Spawner.default_url": "/lab",
        "Spawner.start_timeout": int(START_TIMEOUT_S),
        "Spawner.http_timeout": int(START_TIMEOUT_S),
        "ConfigurableHTTPProxy.command": [proxy],
        "ConfigurableHTTPProxy.api_url": f"http://127.0.0.1:{proxy_api_port}",
        "ConfigurableHTTPProxy.pid_file": str(ws.hub_dir / "proxy.pid"),
        "JupyterHub.services": [
            {"name": DASHBOARD, "url": f"http://127.0.0.1:{dashboard_port}", "display": True,
             "oauth_no_confirm": True, "command": [python, "-m", "gpucourse.workshop.dashboard", str(ws.root)],
             "environment": {**processes.marker_env(settings["id"]), **slurm_seats.slurm_environment()}},
            {"name": CONTROL, "api_token": Expression("api_token")},
            *([{"name": GRADER, "command": [python, "-m", "gpucourse.workshop.grader", str(ws.root)],
                "environment": processes.marker_env(settings["id"])}] if seat_users else []),
        ],
        "JupyterHub.load_roles": [
            {"name": "workshop-control", "services": [CONTROL],
             "scopes": ["admin:servers", "list:users", "read:users", "read:users:activity", "access:servers"]},
            {"name": "dashboard-reader", "services": [DASHBOARD],
             "scopes": ["list:users", "read:users:activity", "read:servers"]},
        ],
        "JupyterHub.template_vars": {"announcement_login": (
            "Log in with your account's name and password." if system else
            "Log in with your seat (seat01, seat02, …) and the code or password the instructor gave you.")},
    }
    if not system:
        values["SeatAuthenticator.codes_file"] = str(ws.secrets / "codes.json")
    if settings.get("slurm"):
        values.update(slurm_config(ws, settings, nodes or {}))
    else:
        values.update({"JupyterHub.spawner_class": "gpucourse.workshop.spawner.SeatSpawner",
                       "SeatSpawner.plan_file": str(ws.plan_file), "SeatSpawner.system_users": system,
                       "SeatSpawner.interrupt_timeout": 3, "SeatSpawner.term_timeout": 5})
    return values


def slurm_config(ws: Workshop, settings: dict, nodes: dict) -> dict:
    """What changes when every seat's server is a SLURM job (:mod:`.slurm_spawner`): the spawner and its request,
    and a hub that the compute nodes can reach (it listens on every interface; the jobs call it by this machine's
    name)."""
    job = settings["slurm"]
    bin_folder = Path(sys.executable).parent
    return {
        "JupyterHub.hub_ip": "0.0.0.0",
        "JupyterHub.hub_connect_ip": socket.gethostname(),
        "JupyterHub.spawner_class": slurm_seats.SPAWNER,
        "SlurmSeatSpawner.plan_file": str(ws.plan_file),
        "SlurmSeatSpawner.system_users": settings["login"] == "system",
        "SlurmSeatSpawner.req_partition": job["partition"],
        "SlurmSeatSpawner.req_gres": job["gres"],
        "SlurmSeatSpawner.req_runtime": job["time"],
        # Generated seats: each job is the hub's account's (as their servers are on one machine). Real accounts:
        # batchspawner's own default, each job submitted as its learner.
        "SlurmSeatSpawner.exec_prefix": "sudo -E -u {username}" if settings["login"] == "system" else "",
        "SlurmSeatSpawner.daemon_resolver": nodes,
        "SlurmSeatSpawner.batchspawner_singleuser_cmd": str(bin_folder / "batchspawner-singleuser"),
        # batchspawner-singleuser runs a script by its path: the server's own, not 'python -m'.
        "Spawner.cmd": [str(bin_folder / "jupyterhub-singleuser")],
    }


def render_config(values: dict, token_file: Path) -> str:
    """``jupyterhub_config.py`` for ``values``: one ``c.Class.trait = value`` line each, nothing else."""
    lines = ["# Generated by 'gpucourse workshop start' at every start: edit the workshop's options, not this file.",
             "from pathlib import Path",
             "",
             "from gpucourse.workshop.spawner import landing_page",
             *(["import batchspawner  # noqa: F401 (adds /hub/api/batchspawner, where a seat's job reports its port)"]
               if values.get("JupyterHub.spawner_class") == slurm_seats.SPAWNER else []),
             "",
             f"api_token = Path({str(token_file)!r}).read_text().strip()",
             "c = get_config()  # noqa: F821 (JupyterHub provides it)"]
    lines += [f"c.{key} = {value!r}" for key, value in values.items()]
    return "\n".join(lines) + "\n"


# --- the hub's REST API --------------------------------------------------------------------------------------

def request(url: str, token: str | None = None, method: str = "GET", timeout: float = 10.0):
    """``(status, decoded JSON or text)`` of one HTTP request; status 0 when nothing answered."""
    req = urllib.request.Request(url, method=method, data=b"" if method == "POST" else None)
    if token:
        req.add_header("Authorization", f"token {token}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, body = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, body = e.code, e.read()
    except (urllib.error.URLError, OSError):
        return 0, None
    try:
        return status, json.loads(body) if body else None
    except ValueError:
        return status, body.decode(errors="replace")


def local_url(running: dict) -> str:
    """Where this machine reaches the hub (127.0.0.1 even when it listens on every interface)."""
    return f"http://127.0.0.1:{running['port']}"


def hub_users(ws: Workshop, running: dict) -> dict[str, dict] | None:
    """The hub's user models by name (servers, last activity), or None when the hub does not answer."""
    status, users = request(f"{local_url(running)}/hub/api/users", token=api_token(ws))
    if status != 200 or not isinstance(users, list):
        return None
    return {u["name"]: u for u in users}


def api_token(ws: Workshop) -> str:
    """The token the gpucourse commands use with the hub's REST API (made once, kept in secrets/)."""
    return (ws.secrets / "api_token").read_text().strip()


# --- state: is it running? -----------------------------------------------------------------------------------

def running(ws: Workshop) -> dict | None:
    """``{"pid", "identity", "port", "url", "public"}`` of the hub running from this folder, or None."""
    try:
        state = json.loads(ws.running_file.read_text())
    except (OSError, ValueError):
        return None
    return state if processes.alive(state.get("identity")) else None


# --- start ---------------------------------------------------------------------------------------------------

def _settings_for(ws: Workshop, *, seats: int | None, gpus_per_seat: int | None, password: bool,
                  users: list[str] | None, admin: str | None, new_codes: bool) -> tuple[dict, bool]:
    """The settings to start with: a new workshop's, or the saved ones with what may change; and whether new
    codes are to be made. What contradicts the workshop being resumed is refused."""
    asked = "system" if users else "password" if password else None
    if seats is not None and seats < 1:
        raise WorkshopError(f"--seats {seats} must be at least 1.")
    if admin and not users:
        raise WorkshopError(f"--admin names the instructor's account with --users; generated seats have "
                            f"'{INSTRUCTOR}'.")
    if users and seats is not None and seats != len(users):
        raise WorkshopError(f"--seats {seats} and --users name {len(users)} accounts; give one or the other.")
    if not ws.exists():
        if seats is None and not users:
            raise WorkshopError("a new workshop needs --seats N (or --users with real accounts).")
        names = list(users) if users else seat_names(seats)
        admin = admin or (os.environ.get("SUDO_USER") or getpass.getuser() if users else INSTRUCTOR)
        return Workshop.new_settings(secrets.token_hex(8), names, asked or "codes", gpus_per_seat, admin), True
    settings = ws.settings()
    count = len(settings["seats"])
    if seats is not None and seats != count:
        raise WorkshopError(f"the workshop in {ws.root} has {count} seats; start it again with --seats {count} "
                            f"(or without --seats), or use another --dir.")
    if users and sorted(users) != sorted(settings["seats"]):
        raise WorkshopError(f"the workshop in {ws.root} seats {', '.join(settings['seats'])}; use the same --users, "
                            f"or another --dir.")
    if asked and asked != settings["login"]:
        if "system" in (asked, settings["login"]) or not new_codes:
            raise WorkshopError(f"the workshop in {ws.root} logs in with {settings['login']}; "
                                + ("use another --dir for real accounts." if "system" in (asked, settings["login"])
                                   else "add --new-codes to change that."))
        settings = dict(settings, login=asked)
    if gpus_per_seat is not None:
        settings = dict(settings, gpus_per_seat=gpus_per_seat)
    return settings, new_codes or not (ws.secrets / "codes.json").exists()


def _with_spawner(settings: dict, *, spawner: str | None, partition: str | None, gres: str | None,
                  time_limit: str | None, gpus_per_seat: int | None) -> dict:
    """The settings with where the seats' servers run: on this machine (``"slurm": None``), or as SLURM jobs, with
    what each job asks for checked against the cluster. A workshop being resumed keeps its own unless told."""
    if spawner not in (None, "local", "slurm"):
        raise WorkshopError(f"--spawner {spawner!r} must be local (this machine) or slurm (a job per seat).")
    saved = settings.get("slurm")
    on_slurm = spawner == "slurm" or (spawner is None and saved is not None)
    asked = [flag for flag, value in (("--partition", partition), ("--gres", gres), ("--time", time_limit))
             if value is not None]
    if not on_slurm:
        if asked:
            raise WorkshopError(f"{asked[0]} is for seats that are SLURM jobs; add --spawner slurm.")
        return {**settings, "slurm": None}
    if gpus_per_seat is not None:
        raise WorkshopError("--gpus-per-seat shares this machine's GPUs; a seat that is a SLURM job asks for its own "
                            "with --gres (e.g. --gres gpu:1).")
    saved = saved or {"partition": None, "gres": "", "time": ""}
    request = slurm_seats.checked_request(saved["partition"] if partition is None else partition,
                                          saved["gres"] if gres is None else gres,
                                          saved["time"] if time_limit is None else time_limit)
    return {**settings, "slurm": request}


def _check_accounts(settings: dict) -> None:
    """With real accounts: this must be root (to start servers as them), and each account must exist."""
    import pwd

    if os.geteuid() != 0:
        raise WorkshopError("--users starts each server as its learner's account, which needs root; run it with "
                            "sudo.")
    for name in [*settings["seats"], settings["admin"]]:
        try:
            pwd.getpwnam(name)
        except KeyError:
            raise WorkshopError(f"there is no account named {name!r} on this machine.") from None


def _seat_accounts(ws: Workshop, settings: dict, plan: Plan) -> tuple[Plan, bool]:
    """The plan with each seat's Unix account (:mod:`.accounts`) where the seats get their own, and whether they
    do; the plan's notes say how seats are kept apart. A workshop whose seats had accounts cannot go on without."""
    own = accounts.wanted(settings)
    missing = accounts.missing_tools() if own else None
    if settings.get("seat_users") and not own:
        raise WorkshopError(f"the seats of the workshop in {ws.root} are Unix users of their own; start it as root "
                            f"(or hand their folders back with 'sudo {Path(sys.executable).parent}/"
                            f"{ws.command('remove-users')}').")
    if own and not missing:
        names = [accounts.account_name(settings["id"], seat.name) for seat in plan.seats]
        plan = Plan([replace(seat, account=name) for seat, name in zip(plan.seats, names)], plan.notes)
        plan.notes.append(f"each seat runs as a Unix user of its own ({names[0]}{', …' * (len(names) > 1)}), its "
                          f"folder 0700; '{ws.command('remove-users')}' (once stopped) removes them")
        return plan, True
    if settings["login"] != "system" and not settings.get("slurm"):
        plan.notes.append(accounts.SHARED_NOTE if missing is None else
                          f"seats share the hub's account: {missing}, so no seat has a Unix user of its own")
    return plan, False


def _make_codes(settings: dict) -> dict[str, str]:
    """New secrets to hand out: a code per seat and one for the instructor, or one password for every seat."""
    from .auth import new_code

    if settings["login"] == "password":
        return {"password": new_code(), settings["admin"]: new_code()}
    return {name: new_code() for name in [*settings["seats"], settings["admin"]]}


def _hashes(settings: dict, codes: dict[str, str]) -> dict[str, str]:
    from .auth import hash_code

    if settings["login"] == "password":
        return {**{s: hash_code(codes["password"]) for s in settings["seats"]},
                settings["admin"]: hash_code(codes[settings["admin"]])}
    return {name: hash_code(code) for name, code in codes.items()}


def prepare(root=None, *, seats: int | None = None, gpus_per_seat: int | None = None, port: int | None = None,
            public: bool | None = None, password: bool = False, users: list[str] | None = None,
            admin: str | None = None, new_codes: bool = False, gpus: list[str] | None = None,
            spawner: str | None = None, partition: str | None = None, gres: str | None = None,
            time_limit: str | None = None, say=None) -> dict:
    """The first half of :func:`start`: check everything asked, then write the workshop folder. Starts nothing.

    Nothing is written unless everything checks out. A workshop that exists
    keeps its seats' folders and its codes (unless ``new_codes``), and its
    port and ``public`` unless they are given (a new one: :data:`DEFAULT_PORT`,
    127.0.0.1 only). Returns ``{"workshop", "settings", "plan", "codes" (the
    new ones, else empty), "resumed", "port", "public", "before"}``, where
    ``before`` is the ``(port, public)`` of the workshop's last start (None for
    a new one), and ``"shared"``, a line for each other workshop whose seats
    run on this machine too. ``gpus`` overrides the GPUs found here.
    ``spawner="slurm"`` makes each seat's server a SLURM job on ``partition``
    (default: the cluster's), with ``gres`` and ``time_limit``
    (:mod:`.slurm_seats`).
    """
    say = say or (lambda line: None)
    ws = Workshop(root)
    proxy = required_programs()
    state = running(ws) if ws.exists() else None
    if state:
        raise WorkshopError(f"the workshop in {ws.root} is already running at {state['url']}; stop it first with "
                            f"'{ws.command('stop')}'.")
    resumed = ws.exists()
    settings, make_codes = _settings_for(ws, seats=seats, gpus_per_seat=gpus_per_seat, password=password,
                                         users=users, admin=admin, new_codes=new_codes)
    settings = _with_spawner(settings, spawner=spawner, partition=partition, gres=gres, time_limit=time_limit,
                             gpus_per_seat=gpus_per_seat)
    # The last start's address, kept in the settings (none for a new workshop, or one saved before they kept it).
    before = (settings["port"], settings["public"]) if "port" in settings else None
    last_port, last_public = before or (DEFAULT_PORT, False)
    port = last_port if port is None else port
    public = last_public if public is None else public
    if not 1 <= port <= 65535:
        raise WorkshopError(f"--port {port} must be from 1 to 65535.")
    settings = dict(settings, port=port, public=public)
    if settings["login"] == "system":
        _check_accounts(settings)
    job = settings["slurm"]
    if job:
        plan = slurm_seats.make_seats(ws.seat_folders(settings), settings["id"], job)
        nodes = slurm_seats.node_addresses(job["partition"])
    else:
        plan, nodes = ws.plan(settings, visible_gpu_ids() if gpus is None else gpus), None
    system = settings["login"] == "system"
    plan, own_users = _seat_accounts(ws, settings, plan)
    for seat in plan.seats:
        account = seat_account(seat.name, system, seat.account)
        problem = kernel_sockets.unusable(kernel_folder(settings["id"], seat.name, system, account=seat.account),
                                          account[0] if account else None)
        if problem:
            raise WorkshopError(f"{seat.name}: {problem}")
    if not port_free("0.0.0.0" if public else "127.0.0.1", port):
        raise WorkshopError(f"port {port} is in use; choose another with --port.")
    walls = isolation_problem()  # the seats' learner code is graded here, by this machine's grader
    if walls:
        raise WorkshopError(f"the grader could not wall learner code in on this machine: {walls}.")

    codes = _make_codes(settings) if make_codes and settings["login"] != "system" else {}
    ws.hub_dir.mkdir(parents=True, exist_ok=True)
    if codes:
        write_private(ws.secrets / "codes.json", json.dumps(_hashes(settings, codes), indent=1))
    if not (ws.secrets / "api_token").exists():
        write_private(ws.secrets / "api_token", secrets.token_hex(32))
    for seat in plan.seats:
        owner = None
        if settings["login"] == "system":
            import pwd

            account = pwd.getpwnam(seat.name)
            owner = (account.pw_uid, account.pw_gid)
        if copy_course(seat.folder, owner):
            say(f"{seat.name}: a copy of the course in {seat.folder}")
    os.chmod(ws.hub_dir, 0o700)  # the hub's database, its config and every seat's log: the instructor's alone
    if own_users:
        os.chmod(ws.root / "seats", 0o755)  # each seat passes through to its own folder (0700, its account's)
        accounts.ensure(settings["id"], {seat.name: seat.folder for seat in plan.seats})
    settings = dict(settings, seat_users=own_users)
    hub_port = free_port()
    if job:
        plan.notes.append(f"the seats' jobs reach the hub at {socket.gethostname()}:{hub_port}, and the hub their "
                          f"servers on the nodes: both ways must be open")
    ws.save_plan(plan, processes.marker_env(settings["id"]))
    values = config_values(ws, settings, port=port, public=public, proxy=proxy, hub_port=hub_port,
                           proxy_api_port=free_port(), dashboard_port=free_port(), as_root=os.geteuid() == 0,
                           nodes=nodes, seat_users=own_users)
    write_private(ws.hub_dir / "jupyterhub_config.py", render_config(values, ws.secrets / "api_token"))
    ws.save_settings(settings)
    return {"workshop": ws, "settings": settings, "plan": plan, "codes": codes, "resumed": resumed, "port": port,
            "public": public, "before": before, "shared": [] if job else _shared_with(ws, plan)}


def _shared_with(ws: Workshop, plan: Plan) -> list[str]:
    """A line for each other workshop whose hub runs on this machine with its seats here too: its folder, and what
    its seats and this one's share (the seats' thread budgets each count the machine's cores as theirs)."""
    ours = {gpu for seat in plan.seats for gpu in seat.gpus}
    lines = []
    for folder in sorted(set(processes.hubs()) - {str(ws.root)}):
        other = Workshop(folder)
        try:
            if other.settings().get("slurm"):
                continue
            both = sorted(ours & {gpu for seat in other.saved_plan().seats for gpu in seat.gpus})
        except (WorkshopError, OSError, ValueError, KeyError):
            both = []
        lines.append(f"the workshop in {other.root} runs on this machine too: its seats and these share its "
                     f"{os.cpu_count()} cores" + (f" and GPUs {','.join(both)}" if both else ""))
    return lines


def start(root=None, *, timeout: float = START_TIMEOUT_S, say=None, **asked) -> dict:
    """Start (or resume) the workshop in ``root``; return once every seat's server answers.

    ``asked`` are :func:`prepare`'s options (seats, gpus_per_seat, port,
    public, password, users, admin, new_codes, gpus, spawner, partition,
    gres, time_limit). Returns what
    :func:`prepare` does plus ``"url"``, ``"dashboard"``, ``"admin"``,
    ``"login"`` and ``"seconds"``; ``say(line)`` is told what is happening.
    If the hub or a seat does not come up, everything started is stopped.
    """
    t0 = time.monotonic()
    say = say or (lambda line: None)
    prepared = prepare(root, say=say, **asked)
    ws, settings, port, public = prepared["workshop"], prepared["settings"], prepared["port"], prepared["public"]
    _end_leftovers(ws, settings, say)
    lab.install_course_defaults()  # the seats' servers run this Python's JupyterLab: no news pop-up over notebook 00
    url = address(port, public)
    state = _launch(ws, processes.marker_env(settings["id"]), port, url, public)
    try:
        _wait_until_serving(ws, state, prepared["plan"], t0 + timeout, say)
    except BaseException:
        stop(ws.root)
        raise
    return {**prepared, "url": url, "dashboard": f"{url}/services/{DASHBOARD}/", "admin": settings["admin"],
            "login": settings["login"], "seconds": time.monotonic() - t0}


def address(port: int, public: bool) -> str:
    """The hub's address as ``start`` prints it: this machine's name when the hub listens on every interface."""
    return f"http://{socket.gethostname() if public else '127.0.0.1'}:{port}"


def _launch(ws: Workshop, marker: dict, port: int, url: str, public: bool) -> dict:
    """Start the hub in a session of its own (it outlives this command); record how to find it again."""
    env = dict(os.environ, **marker)
    with open(ws.log_file, "ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "jupyterhub", "-f", str(ws.hub_dir / "jupyterhub_config.py")],
                                cwd=ws.hub_dir, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    _started[proc.pid] = proc  # a hub this process started is its child: 'stop' waits for it
    state = {"pid": proc.pid, "identity": processes.identity(proc.pid), "port": port, "url": url, "public": public,
             "started": time.time()}
    ws.running_file.write_text(json.dumps(state, indent=1))
    return state


def _wait_until_serving(ws: Workshop, state: dict, plan: Plan, deadline: float, say) -> None:
    """Wait for the hub, ask it to start every seat's server, and wait until each answers through the proxy."""
    base, token = local_url(state), api_token(ws)

    def check(what: str, condition, seat: str | None = None) -> None:
        while not condition():
            if not processes.alive(state["identity"]):
                raise WorkshopError(f"the hub stopped while {what}; its log, {ws.log_file}, ends with:\n"
                                    + log_tail(ws))
            if time.monotonic() > deadline:
                log, tail = ((ws.log_file, log_tail(ws)) if seat is None
                             else (ws.seat_log(seat), ws.seat_log_tail(seat)))
                raise WorkshopError(f"gave up {what}: the deadline passed{_job_now(plan, seat)}; see {log}:\n{tail}")
            time.sleep(0.2)

    check("starting", lambda: request(f"{base}/hub/api", timeout=2)[0] == 200)
    say(f"hub up at {state['url']}; starting {len(plan.seats)} seat servers")
    # All at once: the hub answers each request when that server is up (or after 10 s), and the servers
    # start side by side.
    with ThreadPoolExecutor(max_workers=len(plan.seats)) as pool:
        asked = pool.map(lambda s: request(f"{base}/hub/api/users/{s.name}/server", token, "POST", timeout=60),
                         plan.seats)
        for seat, (status, body) in zip(plan.seats, asked):
            if status not in (201, 202, 400):  # 400: already running
                raise WorkshopError(f"the hub did not start {seat.name}'s server (HTTP {status}: {body}).")
    for seat in plan.seats:
        check(f"waiting for {seat.name}'s server",
              lambda s=seat: request(f"{base}/user/{s.name}/api/status", token, timeout=5)[0] == 200, seat.name)
        say(f"{seat.name} answers ({seat.describe()})")


def _job_now(plan: Plan, seat: str | None) -> str:
    """``" (its SLURM job: pending: Resources (job 12))"`` for a SLURM seat, else nothing."""
    if seat is None or not any(s.job for s in plan.seats):
        return ""
    try:
        return f" (its SLURM job: {slurm_seats.describe_job(slurm_seats.seat_jobs(plan).get(seat))})"
    except WorkshopError as e:
        return f" ({e})"


def log_tail(ws: Workshop, lines: int = 15) -> str:
    """The last lines of the hub's log (where the hub and its proxy write; each seat's server has its own)."""
    try:
        return "\n".join(ws.log_file.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


# --- stop ----------------------------------------------------------------------------------------------------


def _end_leftovers(ws: Workshop, settings: dict, say) -> None:
    """End processes (and SLURM jobs) of this workshop that outlived an earlier hub (one killed, or a machine's
    crash)."""
    if settings["slurm"]:
        plan = ws.saved_plan()
        jobs = slurm_seats.queued_jobs(plan)
        if jobs:
            say(f"cancelling {len(jobs)} SLURM job(s) an earlier run of this workshop left behind")
            slurm_seats.cancel_jobs(plan)
    left = processes.marked(settings["id"])
    if left:
        say(f"ending {len(left)} process(es) an earlier run of this workshop left behind")
        processes.end(left)


def stop(root=None) -> dict:
    """Stop the hub, the proxy, every seat's server and whatever they started; keep every seat's work.

    Returns ``{"was_running", "ended": [pids found still running after the
    hub stopped], "seats": [...]}``. Raises if any process of the workshop
    could not be ended, or, with SLURM seats, if a seat's job is still in
    SLURM's queue (or SLURM did not answer).
    """
    ws = Workshop(root)
    settings = ws.settings()
    state = running(ws)
    if state is not None:
        processes.end([state["pid"]], grace=STOP_TIMEOUT_S)  # SIGTERM: the hub stops its servers and proxy
        if state["pid"] in _started:
            _started.pop(state["pid"]).wait(STOP_TIMEOUT_S)
    problem = None
    if settings.get("slurm"):  # the hub cancels its seats' jobs; any it could not are cancelled here
        try:
            queued = slurm_seats.cancel_jobs(ws.saved_plan())
        except WorkshopError as e:
            queued, problem = [], f"the seats' SLURM jobs could not be checked: {e}"
        if queued:
            problem = (f"SLURM job(s) {', '.join(queued)} of the workshop are still in the queue after "
                       f"{slurm_seats.CANCEL_S:g} s; end them with scancel.")
    left = processes.marked(settings["id"])
    still = processes.end(left) if left else []
    if still:
        raise WorkshopError(f"processes {', '.join(map(str, still))} of the workshop could not be ended.")
    if problem:
        raise WorkshopError(problem)
    accounts_of = {seat.name: seat.account for seat in ws.saved_plan().seats} if ws.plan_file.exists() else {}
    for seat in settings["seats"]:  # what a killed kernel left there: nothing of a learner's work
        shutil.rmtree(kernel_folder(settings["id"], seat, settings["login"] == "system",
                                    account=accounts_of.get(seat, "")), ignore_errors=True)
    ws.running_file.unlink(missing_ok=True)
    return {"was_running": state is not None, "ended": left, "seats": settings["seats"]}


def remove_users(root=None) -> list[str]:
    """Remove the Unix users of a stopped workshop's seats (:mod:`.accounts`); their folders, every file kept, go
    back to the instructor, and the next start gives the seats new ones. The accounts removed."""
    ws = Workshop(root)
    settings = ws.settings()
    state = running(ws)
    if state is not None:
        raise WorkshopError(f"the workshop in {ws.root} is running at {state['url']}; stop it first with "
                            f"'{ws.command('stop')}'.")
    if settings["login"] == "system":
        raise WorkshopError("this workshop's seats are real accounts (--users): they are not the workshop's to "
                            "remove.")
    removed = accounts.remove(settings["id"], ws.seat_folders(settings))
    ws.save_settings(dict(settings, seat_users=False))
    return removed


# --- what the instructor is told -----------------------------------------------------------------------------

PUBLIC_WARNING = ("--public: the hub listens on every network interface, without TLS; anyone who can reach this "
                  "machine sees its login page. Hand out the codes in person, keep a firewall in front, and put "
                  "TLS (a reverse proxy) before it on an untrusted network.")


def format_started(started: dict) -> str:
    """What ``gpucourse workshop start`` prints: where to go, who sits where, and the codes (once)."""
    plan, url = started["plan"], started["url"]
    port = url.rsplit(":", 1)[1]
    seconds = f"{started['seconds']:.0f} s"
    if not started["resumed"]:
        head = f"workshop started in {seconds}"
    elif started["before"] is None:
        head = f"workshop resumed in {seconds}"
    elif address(*started["before"]) == url:
        head = f"workshop resumed in {seconds}, on the same address as before"
    else:
        head = f"workshop resumed in {seconds}, on a new address (it was {address(*started['before'])})"
    lines = [f"{head}: {url}",
             f"  class dashboard: {started['dashboard']} (log in as {started['admin']})"]
    lines += [f"  {n}" for n in [*plan.notes, *started["shared"]]]
    if not started["public"]:
        lines.append(f"  from another machine: ssh -L {port}:127.0.0.1:{port} <this server>, then open {url}")
    lines.append("")
    codes = started["codes"]
    for seat in plan.seats:
        code = codes.get(seat.name, "")
        lines.append(f"  {seat.name:<10} {code:<16} {seat.describe():<18} {seat.folder}")
    if started["login"] == "system":
        lines.append("\nlearners log in with their own account's name and password.")
    elif codes:
        if "password" in codes:
            lines.append(f"\nworkshop password (every seat): {codes['password']}")
        lines.append(f"instructor ({started['admin']}): {codes[started['admin']]}")
        lines.append("These codes are shown only now: the workshop keeps only their hashes. They stay the same when "
                     "the workshop is started again ('start --new-codes' makes new ones).")
    else:
        lines.append("\nthe codes are those printed when the workshop was first started ('start --new-codes' makes "
                     "new ones).")
    return "\n".join(lines)


def format_stopped(stopped: dict, root) -> str:
    """What ``gpucourse workshop stop`` prints."""
    ws = Workshop(root)
    head = "workshop stopped" if stopped["was_running"] else "the workshop was not running"
    extra = f"; {len(stopped['ended'])} leftover process(es) ended" if stopped["ended"] else ""
    return (f"{head}{extra}; no process of it is left. Every seat's work is kept in {ws.root}; "
            f"'{ws.command('start')}' resumes the same seats.")
