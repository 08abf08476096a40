"""gpucourse: run, watch, change and check multi-GPU training — on a laptop or on eight GPUs.

    from gpucourse import TrainConfig, run, launch
    result = run(TrainConfig(dp=2, steps=20))      # a RunResult
    values = launch(fn, world_size=4, timeout=60)  # [rank0_value, rank1_value, ...]

Names are imported when first used (PEP 562), so ``import gpucourse.runtime``
loads the launcher alone: a grading sandbox, a bare GPU node or a cluster job
pays only for what it touches.

The folders are the course's wings: the trainers' building blocks at the top and in ``runtime/`` and
``parallel/``; serving at run time in ``serving/``; a cluster on paper (plans, memory, published runs) in
``modeled/``; other stacks' settings in ``interop/``; the course's own tools in ``course/``; then ``grading/``,
``quiz/``, ``viz/``, ``workshop/``, ``bench/`` and ``cli/``.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

__version__ = "0.1.0"

# name -> the submodule that defines it (a submodule itself when the name is one).
_EXPORTS = {
    "TrainConfig": "config", "ConfigError": "config", "RunResult": "measure",
    "LaunchError": "runtime", "LaunchTimeout": "runtime", "WorkerError": "runtime", "current": "runtime",
    "launch": "runtime", "report": "runtime", "run": "train", "check": "grading",
    "progress": None, "quiz": None, "viz": None,
}

# Modules that lived at the top before the folders: their old names still import, with a warning, for one release.
_MOVED = {old: f"{folder}.{old}" for folder, olds in {
    "modeled": ("plan", "memory", "replay", "published", "calibrate", "offload", "cluster", "gpus", "shapes",
                "tensor_cores", "serve_plan", "serve_published", "topology"),
    "interop": ("stack_config", "serve_config"),
    "course": ("tour", "troubleshoot", "lab", "predict", "bandwidth", "kernel_sockets", "doctor", "readings",
               "slurm"),
}.items() for old in olds}
_MOVED["progress"] = "course.progress"


def _moved(old: str):
    """The module that ``gpucourse.<old>`` became, with a DeprecationWarning naming its new place, said at the line
    that used the old name (the first frame outside this file and the import system)."""
    new = _MOVED[old]
    if old != "progress":  # ``from gpucourse import progress`` stays a public name
        level, frame = 2, sys._getframe(1)
        while frame is not None and (frame.f_code.co_filename == __file__
                                     or frame.f_code.co_filename.startswith("<frozen importlib")):
            level += frame.f_code.co_filename == __file__  # warnings skips the import system's frames itself
            frame = frame.f_back
        warnings.warn(f"gpucourse.{old} is now gpucourse.{new}; the old name will be removed in the next release",
                      DeprecationWarning, stacklevel=level)
    module = importlib.import_module(f"{__name__}.{new}")
    globals()[old] = module  # said once: the next use of the old name finds it here
    return module


class _OldNames(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Makes ``import gpucourse.plan`` (and ``from gpucourse.plan import x``) give ``gpucourse.modeled.plan``."""

    def __init__(self):
        self._specs = {}

    def find_spec(self, fullname, path=None, target=None):
        package, _, old = fullname.rpartition(".")
        if package != __name__ or old not in _MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        module = _moved(spec.name.rpartition(".")[2])
        self._specs[module.__name__] = module.__spec__  # the import system stamps the alias's spec on it
        return module

    def exec_module(self, module):
        module.__spec__ = self._specs.pop(module.__name__)


if not any(isinstance(finder, _OldNames) for finder in sys.meta_path):
    sys.meta_path.append(_OldNames())


__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _MOVED and name not in _EXPORTS:
        return _moved(name)
    if name not in _EXPORTS:
        raise AttributeError(f"module 'gpucourse' has no attribute {name!r}")
    home = _EXPORTS[name]
    value = importlib.import_module(f".{home or _MOVED.get(name, name)}", __name__)
    if home is not None:
        value = getattr(value, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
