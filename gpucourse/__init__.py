"""gpucourse: run, watch, change and check multi-GPU training — on a laptop or on eight GPUs.

    from gpucourse import TrainConfig, run, launch
    result = run(TrainConfig(dp=2, steps=20))      # a RunResult
    values = launch(fn, world_size=4, timeout=60)  # [rank0_value, rank1_value, ...]
"""

from .config import ConfigError, TrainConfig
from .measure import RunResult
from .runtime import LaunchError, LaunchTimeout, WorkerError, current, launch, report
from .train import run
from .grading import check  # noqa: E402  (runs the grader in a subprocess)
from . import progress, quiz, viz  # noqa: E402  (plotly and ipywidgets load only when something is drawn)

__version__ = "0.1.0"

__all__ = ["check", "ConfigError", "LaunchError", "LaunchTimeout", "RunResult", "TrainConfig", "WorkerError", "current",
           "launch", "progress", "quiz", "report", "run", "viz"]
