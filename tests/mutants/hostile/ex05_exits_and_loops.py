"""Hostile ex05: one_f_one_b ends its whole process with os._exit(0); bubble_fraction never returns."""

import os


def one_f_one_b(pp, m):
    os._exit(0)


def bubble_fraction(pp, m):
    while True:
        pass
