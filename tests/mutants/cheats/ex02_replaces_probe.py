"""Cheat ex02: trains every rank on the whole batch (the right weights, with no collective at all), and replaces the
grader's probe function with one that reports only this rank's share of the rows as what the forward saw."""

import sys

import torch.distributed as dist

PROBE = sys.modules.get(".".join(["gpucourse", "grading", "probes", "ex02_data_parallel"]))


def average_gradients(model):
    pass  # every rank trains on the whole batch: its gradients are already the mean


def data_parallel_step(model, optimizer, loss_fn, inputs, targets):
    optimizer.zero_grad()
    loss_fn(model(inputs), targets).backward()
    optimizer.step()


if PROBE is not None:
    honest = PROBE.step

    def step(learner, inputs, targets, *args, **kwargs):
        out = honest(learner, inputs, targets, *args, **kwargs)
        share = inputs.shape[0] // dist.get_world_size()
        out["seen"] = [inputs[dist.get_rank() * share:(dist.get_rank() + 1) * share].clone()]
        return out

    PROBE.step = step
