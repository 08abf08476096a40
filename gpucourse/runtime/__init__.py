"""Starting ranks and knowing who you are inside one."""

from .launcher import (DevicePlan, LaunchError, LaunchTimeout, WorkerError, in_place, launch, notebook_device,
                       plan_device, visible_gpus)
from .worker import RankContext, current, report

__all__ = ["DevicePlan", "LaunchError", "LaunchTimeout", "WorkerError", "RankContext", "current", "in_place",
           "launch", "notebook_device", "plan_device", "report", "visible_gpus"]
