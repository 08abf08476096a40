"""Writing a file whole or not at all: a result, a grade, a checkpoint's index or a setting is never half-written.

Torch-free on purpose: the workshop, the lab server, the progress file and the
grader's host write files too, and none of them should pay for importing torch.
"""

from __future__ import annotations

import contextlib
import os
import tempfile


def write_atomic(path: str | os.PathLike, data: str | bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file beside it and a rename, so a reader sees the old file or
    the new one, never part of it (a rename within one folder is atomic)."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=os.path.basename(path))
    try:
        with os.fdopen(fd, "wb" if isinstance(data, bytes) else "w") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
