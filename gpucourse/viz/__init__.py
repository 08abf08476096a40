"""See it: plotly figures of runs, schedules and collectives, for the notebook and the tour report.

    from gpucourse import TrainConfig, run, viz
    r = viz.watch(TrainConfig(pp=4, microbatches=8))      # run(), drawn live: loss and per-rank activity
    viz.timeline(r)                                        # per-rank Gantt chart, bubble shaded
    viz.schedule(pp=4, microbatches=8, schedule="1f1b")    # simulated, no processes; slider over m
    viz.compare([single, dp, tp])                          # loss curves and their largest difference
    viz.memory(r, predicted=estimate)                      # stacked bytes per rank, measured beside predicted
    viz.collective("all_reduce", world_size=4)             # the ring algorithm, step by step
    viz.expert_load(r); viz.all_to_all(r)                  # a mixture of experts: the router, the dispatch
    viz.scaling(results)                                   # throughput and efficiency against world size
    viz.bandwidth(rows)                                    # bus bandwidth against message size

Every function returns a ``plotly.graph_objects.Figure`` and takes a RunResult
or the path of its JSON file. Nothing needs WebGL or a network: the figures
draw in JupyterLab, in an HTML file opened from disk, and offline. Colours come
from one table, :data:`PALETTE`: a kind of span, a rank, a memory category
keeps its colour in every figure. plotly is imported only when a figure is drawn.
"""

from .collectives import CollectiveSimulation, bandwidth, collective, simulate_collective
from .experts import all_to_all, expert_load
from .gantt import rank_activity, ring, schedule, timeline
from .live import LiveView, final_figure, watch
from .runs import compare, memory, scaling
from .style import PALETTE

__all__ = ["PALETTE", "CollectiveSimulation", "LiveView", "all_to_all", "bandwidth", "collective", "compare",
           "expert_load", "final_figure", "memory", "rank_activity", "ring", "scaling", "schedule",
           "simulate_collective", "timeline", "watch"]
