"""JupyterLab for the course: the server ``make lab`` starts, and a browser that works through a notebook.

``gpucourse lab`` (what ``make lab`` runs) serves ``notebooks/`` on 127.0.0.1
behind a token. :class:`LabServer` starts the same server from Python, on a
free port with a token it chooses, so that a test, a benchmark or an
instructor checking a workshop machine can drive the course in a real browser
exactly as a learner sees it::

    with LabServer(copy_of_notebooks, env={"GPUCOURSE_SMOKE": "1"}) as lab, Browser() as browser:
        page = browser.open(lab, "04_pipeline_parallelism.ipynb")
        report = page.run_all(timeout=600)     # cells run, errors, figures and widgets drawn

The browser is headless Chromium driven by Playwright (the ``dev`` extra);
neither is imported until a browser is opened.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from ..files import write_atomic
from . import kernel_sockets

REPO = Path(__file__).resolve().parents[2]
NOTEBOOKS = REPO / "notebooks"

# The server says where it listens in one log line; the token in it is masked.
_RUNNING = re.compile(r"https?://127\.0\.0\.1:(\d+)/lab")
# Flags for Chromium in a container with no display and no network of its own.
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--no-first-run"]
# JupyterLab settings for a driven browser: every cell kept in the page (not only those scrolled into
# view), and no news pop-up over the notebook. A learner's own settings are left alone.
DRIVEN_SETTINGS = {
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {"fetchNews": "false",
                                                                       "checkForUpdates": False},
}


# What `make lab` and `gpucourse workshop start` set as the defaults of the course's own JupyterLab (plugin id ->
# setting -> value): no news pop-up over the first notebook, no update check. Written as the application's
# overrides, so that a learner who wants them back changes them in Settings as usual.
COURSE_DEFAULTS = {"@jupyterlab/apputils-extension:notification": {"fetchNews": "false", "checkForUpdates": False}}


def install_course_defaults(prefix: str | os.PathLike = sys.prefix) -> Path | None:
    """Merge :data:`COURSE_DEFAULTS` into ``prefix``'s ``share/jupyter/lab/settings/overrides.json`` (JupyterLab's
    application-wide defaults), keeping every value already there. Returns the file, or None when it cannot be
    written (a read-only Python: the server starts anyway, with JupyterLab's own defaults)."""
    path = Path(prefix) / "share" / "jupyter" / "lab" / "settings" / "overrides.json"
    try:
        current = json.loads(path.read_text()) if path.exists() else {}
        if not isinstance(current, dict):
            return None
        merged = {plugin: {**values, **current.get(plugin, {})} for plugin, values in COURSE_DEFAULTS.items()}
        if any(current.get(plugin) != values for plugin, values in merged.items()):
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(path, json.dumps({**current, **merged}, indent=1))
        os.chmod(path, 0o644)  # every server this Python runs reads it: a seat's, under a Unix user of its own
    except (OSError, ValueError):
        return None
    return path


class LabError(RuntimeError):
    """The server or the browser could not do what was asked; the message says what and where to look."""


def server_argv(root: str | os.PathLike = NOTEBOOKS, port: int = 8888, token: str | None = None,
                open_browser: bool | None = None) -> list[str]:
    """The command that serves ``root``: 127.0.0.1 only, a token always (made up by Jupyter unless given), and
    kernels reached over Unix sockets, which no other server on this machine can take (see
    :mod:`gpucourse.course.kernel_sockets`)."""
    argv = [sys.executable, "-m", "jupyterlab", f"--ServerApp.root_dir={root}", "--ServerApp.ip=127.0.0.1",
            f"--ServerApp.port={port}", *kernel_sockets.SERVER_ARGS]
    if token is not None:
        argv.append(f"--IdentityProvider.token={token}")
    if hasattr(os, "getuid") and os.getuid() == 0:
        argv.append("--allow-root")
    if open_browser is None:  # with no display there is no browser to open
        open_browser = bool(os.environ.get("DISPLAY")) or sys.platform in ("darwin", "win32")
    if not open_browser:
        argv.append("--no-browser")
    return argv


def kernels_runtime_folder() -> Path | None:
    """A runtime folder for ``gpucourse lab`` when Jupyter's own is too long a path for its kernels' Unix sockets
    (a deep home folder); None when Jupyter's own will do."""
    from jupyter_core.paths import jupyter_runtime_dir

    return kernel_sockets.runtime_folder(jupyter_runtime_dir(), "lab")


def find_chromium() -> str | None:
    """Chromium's executable: ``$GPUCOURSE_CHROMIUM``, else the first of chromium, chromium-browser, google-chrome on PATH."""
    named = os.environ.get("GPUCOURSE_CHROMIUM")
    if named:
        return named if os.access(named, os.X_OK) else None
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    return None


class LabServer:
    """A JupyterLab server on a free port with its own token, settings and workspace; stopped on exit.

    ``up_at`` is the ``time.monotonic()`` at which the server said it was
    running. ``env`` is added to this process's environment for the server and
    the kernels it starts.
    """

    def __init__(self, root: str | os.PathLike, env: dict | None = None, startup_timeout: float = 120.0):
        self.root = Path(root)
        self.token = secrets.token_hex(16)
        self.extra_env = dict(env or {})
        self.startup_timeout = startup_timeout
        self.port: int | None = None
        self.up_at: float | None = None
        self.log: list[str] = []
        self._proc: subprocess.Popen | None = None
        self._state = tempfile.TemporaryDirectory(prefix="gpucourse-lab-")

    def url(self, notebook: str, workspace: str | None = None) -> str:
        """The page of ``notebook`` in a fresh workspace (nothing restored from another page)."""
        space = workspace or re.sub(r"\W", "-", Path(notebook).stem)
        return f"http://127.0.0.1:{self.port}/lab/workspaces/{space}/tree/{notebook}?reset&token={self.token}"

    def _environment(self) -> dict:
        state = Path(self._state.name)
        for name, values in DRIVEN_SETTINGS.items():
            path = state / "settings" / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(values))
        env = dict(os.environ)
        runtime = kernel_sockets.runtime_folder(state / "runtime", f"lab-{state.name}") or state / "runtime"
        env.update({"JUPYTERLAB_SETTINGS_DIR": str(state / "settings"),
                    "JUPYTERLAB_WORKSPACES_DIR": str(state / "workspaces"),
                    "JUPYTER_RUNTIME_DIR": str(runtime)})
        env.update(self.extra_env)
        return env

    def __enter__(self) -> "LabServer":
        up = threading.Event()
        self._proc = subprocess.Popen(server_argv(self.root, port=0, token=self.token, open_browser=False),
                                      env=self._environment(), cwd=self.root, stdin=subprocess.DEVNULL,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      start_new_session=True)

        def read():
            for line in self._proc.stdout:
                self.log.append(line.rstrip("\n"))
                found = _RUNNING.search(line)
                if found and not up.is_set():
                    self.port, self.up_at = int(found.group(1)), time.monotonic()
                    up.set()
            up.set()  # the server ended: stop waiting

        threading.Thread(target=read, daemon=True, name="jupyterlab-log").start()
        deadline = time.monotonic() + self.startup_timeout
        if not up.wait(self.startup_timeout) or self.port is None or not self._accepting(deadline):
            self.__exit__(None, None, None)
            raise LabError(f"JupyterLab did not start within {self.startup_timeout:.0f} s; its last lines:\n"
                           + "\n".join(self.log[-20:]))
        return self

    def _accepting(self, deadline: float) -> bool:
        """Wait until the server accepts connections: it prints its address before its event loop binds the port."""
        while time.monotonic() < deadline and self._proc.poll() is None:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return True
            except OSError:
                time.sleep(0.05)
        return False

    def __exit__(self, *exc) -> None:
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.terminate()  # the server shuts its kernels down, and their ranks go with them
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                proc.wait(10)
        self._state.cleanup()


# --- the browser ---------------------------------------------------------------------------------------------

# What the page is asked, in its own JavaScript. A code cell's prompt reads "[*]:" while it waits or runs.
_KERNEL_IDLE = "() => [...document.querySelectorAll('.jp-StatusBar-TextItem')].some(e => /\\|\\s*Idle$/.test(e.textContent.trim()))"
_NOTHING_RUNNING = "() => ![...document.querySelectorAll('.jp-CodeCell .jp-InputPrompt')].some(e => e.textContent.includes('*'))"
_SAVED = "() => !document.querySelector('.jp-mod-current.jp-mod-dirty, .lm-TabBar-tab.lm-mod-current.jp-mod-dirty')"
PLOTLY_MIME = "application/vnd.plotly.v1+json"
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"
_PLOTLY_DRAWN = ".jp-OutputArea-output.js-plotly-plot"  # the output area is the plot
_WIDGET_DRAWN = ".jp-OutputArea-output > .jupyter-widgets"
_ALL_DRAWN = ("(want) => [...document.querySelectorAll('%s')].filter(e => e.querySelector('.main-svg')).length"
              " >= want.plots && document.querySelectorAll('%s').length >= want.widgets"
              % (_PLOTLY_DRAWN, _WIDGET_DRAWN))
_WIDGET_TROUBLE = re.compile(r"Error displaying widget|Loading widget\.\.\.|model not found", re.I)


class NotebookPage:
    """One notebook open in the browser, its kernel started."""

    def __init__(self, page, server: LabServer, notebook: str):
        self.page, self.server, self.notebook = page, server, notebook

    def _menu(self, menu: str, item: str) -> None:
        self.page.click(f".lm-MenuBar-itemLabel:text-is('{menu}')")
        self.page.click(f".lm-Menu-itemLabel:text-is('{item}')")

    def wait_idle(self, timeout: float) -> None:
        self.page.wait_for_function(_NOTHING_RUNNING, timeout=timeout * 1000)
        self.page.wait_for_function(_KERNEL_IDLE, timeout=timeout * 1000)

    def run_all(self, timeout: float = 600.0, draw_timeout: float = 30.0) -> dict:
        """Run → Run All Cells, wait for the last cell, save, and report what the page and the file show."""
        start = time.monotonic()
        self._menu("Run", "Run All Cells")
        self.wait_idle(timeout)
        seconds = time.monotonic() - start
        return {**self.report(draw_timeout), "seconds": seconds}

    def run_cell(self, containing: str, timeout: float = 300.0) -> tuple[float, str]:
        """Run the first code cell whose source holds ``containing``: the seconds until it finished, and its output's text."""
        cell = self.page.locator(".jp-CodeCell", has=self.page.locator(".jp-InputArea", has_text=containing)).first
        if not cell.count():
            raise LabError(f"{self.notebook} has no code cell containing {containing!r}.")
        cell.locator(".jp-InputPrompt").click()  # selects the cell without entering its editor
        start = time.monotonic()
        self._menu("Run", "Run Selected Cell and Do not Advance")
        self.page.wait_for_function("(el) => /\\[\\d+\\]/.test(el.textContent)",
                                    arg=cell.locator(".jp-InputPrompt").element_handle(), timeout=timeout * 1000)
        return time.monotonic() - start, " ".join(cell.locator(".jp-OutputArea-output").all_inner_texts())

    def saved(self, timeout: float = 60.0) -> dict:
        """Save the notebook from the page and read back what JupyterLab wrote."""
        self._menu("File", "Save Notebook")
        self.page.wait_for_function(_SAVED, timeout=timeout * 1000)
        return json.loads((self.server.root / self.notebook).read_text(encoding="utf-8"))

    def report(self, draw_timeout: float = 30.0) -> dict:
        """Cells, errors, rank output, plotly figures and widgets, from the saved file and the drawn page."""
        from playwright.sync_api import TimeoutError as PlaywrightTimeout

        nb = self.saved()
        code = [c for c in nb["cells"] if c["cell_type"] == "code"]
        outputs = [o for c in code for o in c.get("outputs", [])]
        errors = [f"code cell {i}: {o.get('ename')}: {o.get('evalue')}" for i, c in enumerate(code)
                  for o in c.get("outputs", []) if o["output_type"] == "error"]
        texts = [o["text"] if o["output_type"] == "stream" else o.get("data", {}).get("text/plain", "")
                 for o in outputs]
        want = {"plots": sum(PLOTLY_MIME in o.get("data", {}) for o in outputs),
                "widgets": sum(WIDGET_MIME in o.get("data", {}) for o in outputs)}
        # Each figure or widget the kernel sent must be drawn: a plotly plot with its SVG, a widget's own view.
        # Drawing follows the output by a moment (plotly.js loads on first use), so wait for it, within reason;
        # what is still missing then shows in the counts.
        try:
            self.page.wait_for_function(_ALL_DRAWN, arg=want, timeout=draw_timeout * 1000)
        except PlaywrightTimeout:
            pass
        shown = " ".join(self.page.locator(".jp-OutputArea-output").all_inner_texts())
        return {
            "code_cells": len(code),
            "executed": sum(c.get("execution_count") is not None for c in code),
            "errors": errors,
            "text": "\n".join(t if isinstance(t, str) else "".join(t) for t in texts),  # the file splits lines
            "plotly_outputs": want["plots"],
            "plotly_drawn": self.page.locator(_PLOTLY_DRAWN).filter(has=self.page.locator(".main-svg")).count(),
            "widget_outputs": want["widgets"],
            "widgets_drawn": self.page.locator(_WIDGET_DRAWN).count(),
            "widget_trouble": sorted(set(_WIDGET_TROUBLE.findall(shown))),
        }


class Browser:
    """Headless Chromium, one page per notebook."""

    def __init__(self, executable: str | None = None):
        self.executable = executable or find_chromium()
        self._playwright = self._browser = None

    def __enter__(self) -> "Browser":
        if self.executable is None:
            raise LabError("no Chromium found: install it (Debian: apt-get install chromium) or name its "
                           "executable in GPUCOURSE_CHROMIUM.")
        try:
            from playwright.sync_api import sync_playwright
        except ImportError as e:
            raise LabError("driving a browser needs Playwright: pip install -e '.[dev]'.") from e
        self._playwright = sync_playwright().start()
        self._browser = self._playwright.chromium.launch(executable_path=self.executable, args=CHROMIUM_FLAGS)
        return self

    def new_page(self):
        """A blank Playwright page of this browser."""
        return self._browser.new_page(viewport={"width": 1400, "height": 900})

    def open(self, server: LabServer, notebook: str, timeout: float = 120.0) -> NotebookPage:
        """Open ``notebook`` in a new page and wait until its kernel is idle."""
        page = self.new_page()
        page.set_default_timeout(timeout * 1000)
        page.goto(server.url(notebook))
        page.wait_for_selector(".jp-Notebook .jp-Cell")
        page.wait_for_function(_KERNEL_IDLE)
        return NotebookPage(page, server, notebook)

    def __exit__(self, *exc) -> None:
        if self._browser is not None:
            self._browser.close()
        if self._playwright is not None:
            self._playwright.stop()


def course_copy(into: str | os.PathLike) -> Path:
    """A copy of ``notebooks/`` to serve, so that saving a driven notebook never touches the course's own files."""
    dest = Path(into) / "notebooks"
    shutil.copytree(NOTEBOOKS, dest, ignore=shutil.ignore_patterns(".ipynb_checkpoints"))
    return dest


def first_check(server: LabServer, browser: Browser, timeout: float = 300.0) -> dict:
    """What a learner waits for their first grade: from the server being up to ``check("ex01")`` answering in 01.

    Opens notebooks/01 in a fresh page (its kernel starts), runs the cell that
    holds ``check("ex01")`` and nothing before it (that cell imports what it
    needs), and returns ``{"seconds", "cell_s", "text"}``.
    """
    page = browser.open(server, "01_collectives.ipynb", timeout=timeout)
    cell_s, text = page.run_cell('check("ex01")', timeout=timeout)
    return {"seconds": time.monotonic() - server.up_at, "cell_s": cell_s, "text": text}


def kernelspec_dir(into: str | os.PathLike, name: str = "gpucourse-course") -> Path:
    """A kernelspec folder whose one kernel is this interpreter, so notebooks import this gpucourse."""
    spec = Path(into) / "kernels" / name
    spec.mkdir(parents=True, exist_ok=True)
    (spec / "kernel.json").write_text(json.dumps({
        # Warnings only to the kernel's own log: its start-up notes would mix into the caller's output.
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}", "--IPKernelApp.log_level=ERROR"],
        "display_name": "gpucourse", "language": "python"}))
    return spec.parent


def execute(nb, path: str | os.PathLike, kernels: str | os.PathLike, name: str = "gpucourse-course",
            cell_timeout: float = 240.0, smoke: bool = True, env: dict | None = None):
    """Run notebook ``nb`` (read from ``path``) top to bottom in a fresh kernel, in ``path``'s folder; returns ``nb``.

    The kernel does not inherit PYTEST_CURRENT_TEST: with it, ipykernel stops
    capturing file descriptors 1 and 2, and the kernel is no longer the kind
    JupyterLab starts (ranks forked from it would see a different stdout).
    """
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import KernelManager
    from nbclient import NotebookClient

    kernel_env = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
    if smoke:
        kernel_env["GPUCOURSE_SMOKE"] = "1"
    kernel_env.update(env or {})
    km = KernelManager(kernel_name=name, kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(kernels)]),
                       **kernel_sockets.kernel_manager_options(kernels))
    try:
        NotebookClient(nb, km=km, timeout=cell_timeout, allow_errors=False,
                       resources={"metadata": {"path": str(Path(path).parent)}}).execute(env=kernel_env)
    finally:  # nbclient shuts down only kernels it started itself
        if km.has_kernel:
            km.shutdown_kernel(now=True)
    return nb


def course_notebooks() -> list[Path]:
    """The course's notebooks, in teaching order."""
    return sorted(NOTEBOOKS.glob("*.ipynb"))


def run_course(smoke: bool = True, progress_file: str | os.PathLike | None = None, stream=None) -> dict:
    """Execute every notebook (smoke size by default); return seconds per notebook. A failing cell raises."""
    import nbformat

    seconds = {}
    with tempfile.TemporaryDirectory(prefix="gpucourse-course-") as tmp:
        kernels = kernelspec_dir(tmp)
        env = {"GPUCOURSE_PROGRESS": str(progress_file or Path(tmp) / "progress.json")}
        for path in course_notebooks():
            start = time.monotonic()
            execute(nbformat.read(path, as_version=4), path, kernels, env=env, smoke=smoke)
            seconds[path.name] = time.monotonic() - start
            if stream is not None:
                print(f"  {path.name:<36} {seconds[path.name]:6.1f} s", file=stream, flush=True)
    return seconds
