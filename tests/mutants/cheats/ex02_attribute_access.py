"""Cheat ex02: reaches the reference through the package's attributes."""

import importlib

import gpucourse

average_gradients = None


def data_parallel_step(model, optimizer, loss_fn, inputs, targets):
    dp = importlib.import_module("gpucourse.parallel.data_parallel")
    gpucourse.parallel.data_parallel.allreduce_gradients(model, None)
    return dp
