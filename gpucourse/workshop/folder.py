"""A workshop on disk: one folder holds its settings, its secrets, the hub's files and every seat.

::

    workshop/                     (--dir; default ~/.gpucourse/workshop, or $GPUCOURSE_WORKSHOP)
      workshop.json               seats, login, GPUs per seat: what 'start' resumes
      secrets/                    readable by its owner only
        codes.json                a salted hash of each seat's code (never the code)
        api_token                 how the gpucourse commands talk to the hub
        cookie_secret             kept, so that logins survive a restart
      hub/
        jupyterhub_config.py      generated at every start (see hub.py)
        seats.json                the plan the hub's spawner reads: folder, GPUs, threads (or SLURM job) per seat
        jupyterhub.sqlite, hub.log, running.json (while it runs)
        logs/seat01.log           what each seat's server and its kernels say (the report reads it)
      seats/seat01/               one learner's copy of the course: notebooks/, exercises/,
                                  .gpucourse/progress.json — kept by 'stop', resumed by 'start'

Nothing here starts a process; :mod:`gpucourse.workshop.hub` does.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
from datetime import datetime
from pathlib import Path

from ..files import write_atomic
from .errors import WorkshopError
from .plan import Plan, Seat, make_plan

REPO = Path(__file__).resolve().parents[2]
COURSE = ("notebooks", "exercises")  # what each seat gets a copy of
FORMAT = 1
ENV_VAR = "GPUCOURSE_WORKSHOP"
SYSTEM_COURSE_FOLDER = "gpucourse-workshop"  # in each real account's home, with --users
# A Jupyter server's line for one HTTP request it answered ("[I 2026-12-04 09:00:01.123 ServerApp] 200 GET /…").
_ACCESS_LINE = re.compile(r"^\[\w \S+ \S+ \w+\] (\d{3} [A-Z]+ /|wrote error: )")


def default_dir() -> Path:
    """``$GPUCOURSE_WORKSHOP``, else ``~/.gpucourse/workshop`` (beside the progress file)."""
    return Path(os.environ.get(ENV_VAR) or Path.home() / ".gpucourse" / "workshop").expanduser()


class Workshop:
    """The folder of one workshop and what it holds; ``settings`` is ``workshop.json`` once it exists."""

    def __init__(self, root: str | os.PathLike | None = None):
        self.root = Path(root).expanduser().resolve() if root is not None else default_dir().resolve()
        self.named = root is not None  # its folder was named (--dir): a command it suggests names it too

    def command(self, action: str) -> str:
        """``gpucourse workshop ACTION`` for this workshop, with ``--dir`` when its folder was named."""
        return f"gpucourse workshop {action}" + (f" --dir {shlex.quote(str(self.root))}" if self.named else "")

    # --- where things are ---------------------------------------------------------------------------------

    @property
    def settings_file(self) -> Path:
        return self.root / "workshop.json"

    @property
    def secrets(self) -> Path:
        return self.root / "secrets"

    @property
    def hub_dir(self) -> Path:
        return self.root / "hub"

    @property
    def running_file(self) -> Path:
        return self.hub_dir / "running.json"

    @property
    def plan_file(self) -> Path:
        return self.hub_dir / "seats.json"

    @property
    def log_file(self) -> Path:
        return self.hub_dir / "hub.log"

    def seat_log(self, seat: str) -> Path:
        """Where ``seat``'s JupyterLab (and the kernels it starts) write."""
        return self.hub_dir / "logs" / f"{seat}.log"

    def seat_log_tail(self, seat: str, lines: int = 12) -> str:
        """The last lines of a seat's server log, without its requests' access lines (they push out what
        matters)."""
        try:
            text = self.seat_log(seat).read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join([line for line in text.splitlines() if not _ACCESS_LINE.match(line)][-lines:])

    def exists(self) -> bool:
        return self.settings_file.is_file()

    # --- settings -----------------------------------------------------------------------------------------

    def settings(self) -> dict:
        """``workshop.json``; a sentence saying how to make one if there is none."""
        try:
            return json.loads(self.settings_file.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise WorkshopError(f"no workshop in {self.root}; start one with 'gpucourse workshop start --seats N' "
                                f"(or name its folder with --dir).") from None
        except ValueError as e:
            raise WorkshopError(f"{self.settings_file} is not valid JSON ({e}); fix or remove it.") from None

    def save_settings(self, settings: dict) -> None:
        write_atomic(self.settings_file, json.dumps(settings, indent=1) + "\n")

    @staticmethod
    def new_settings(workshop_id: str, seats: list[str], login: str, gpus_per_seat: int | None, admin: str) -> dict:
        return {"format": FORMAT, "id": workshop_id, "seats": seats, "login": login, "gpus_per_seat": gpus_per_seat,
                "admin": admin, "created": datetime.now().astimezone().isoformat(timespec="seconds")}

    # --- seats --------------------------------------------------------------------------------------------

    def seat_folders(self, settings: dict) -> dict[str, Path]:
        """Seat name -> its course folder, in seat order."""
        if settings["login"] == "system":
            import pwd

            return {name: Path(pwd.getpwnam(name).pw_dir) / SYSTEM_COURSE_FOLDER for name in settings["seats"]}
        return {name: self.root / "seats" / name for name in settings["seats"]}

    def plan(self, settings: dict, gpus: list[str], cores: int | None = None) -> Plan:
        """The seats of this workshop on a machine with ``gpus`` (see :func:`plan.make_plan`)."""
        return make_plan(self.seat_folders(settings), gpus, settings["gpus_per_seat"], cores)

    def saved_plan(self) -> Plan:
        """The plan the last start handed to the hub."""
        data = json.loads(self.plan_file.read_text(encoding="utf-8"))
        return Plan([seat_from(s) for s in data["seats"]], data["notes"])

    def save_plan(self, plan: Plan, marker: dict[str, str]) -> None:
        seats = [{"name": s.name, "folder": str(s.folder), "gpus": list(s.gpus), "threads": s.threads, "job": s.job,
                  "gres": s.gres, "account": s.account} for s in plan.seats]
        write_atomic(self.plan_file, json.dumps({"seats": seats, "notes": plan.notes, "marker": marker}, indent=1))


def seat_from(saved: dict) -> Seat:
    """A seat as ``hub/seats.json`` holds it (written before SLURM seats: no job; before seat accounts: none)."""
    return Seat(saved["name"], Path(saved["folder"]), tuple(saved["gpus"]), saved["threads"], saved.get("job", ""),
                saved.get("gres", ""), saved.get("account", ""))


def copy_course(folder: Path, owner: tuple[int, int] | None = None) -> bool:
    """Give a seat its own copy of notebooks/ and exercises/; a seat that has one keeps it. True if copied.

    The copy is made beside the seat and renamed into place, so a seat folder is
    either whole or absent. ``owner`` (uid, gid) hands the copy to a real account.
    """
    if folder.exists():
        return False
    folder.parent.mkdir(parents=True, exist_ok=True)
    partial = folder.with_name(f".{folder.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    for part in COURSE:
        shutil.copytree(REPO / part, partial / part,
                        ignore=shutil.ignore_patterns(".ipynb_checkpoints", "__pycache__"))
    (partial / ".gpucourse").mkdir()
    if owner is not None:
        for path in [partial, *partial.rglob("*")]:
            os.chown(path, *owner)
    partial.rename(folder)
    return True


def write_private(path: Path, text: str) -> None:
    """Write a secret: its folder and the file are readable by their owner only."""
    path.parent.mkdir(parents=True, exist_ok=True)
    os.chmod(path.parent, 0o700)
    write_atomic(path, text)  # a fresh temporary file is created 0600
    os.chmod(path, 0o600)
