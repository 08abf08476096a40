"""One module per exercise, named like the exercise's file (``ex01_ring_allreduce``), each defining ``EXERCISE``."""
