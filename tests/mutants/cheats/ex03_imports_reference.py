"""Cheat ex03: hands in the course's reference bucketing."""

from gpucourse.parallel.data_parallel_buckets import assign_buckets  # noqa: F401


class BucketedGradientSync:
    def __init__(self, model, cap_bytes):
        from gpucourse.parallel import data_parallel_buckets  # noqa: F401

    def finish(self):
        pass
