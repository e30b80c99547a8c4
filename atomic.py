"""
Files written whole or not at all, however the process ends: checkpoints, shards, manifests,
logs, plots and downloads all go through atomic_write.
"""

import os
from pathlib import Path


def atomic_write(path, write):
    """Calls write(f) on a binary temp file beside `path` (its name + ".tmp"), fsyncs it, then
    renames it onto `path` and fsyncs the directory: a process killed (or a machine that loses
    power) at any moment leaves either the old file or the new one, never a part. On an error
    (disk full, or one that write raised) the temp file is removed and the error raised."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if hasattr(os, "O_DIRECTORY"):  # the rename itself is durable only once its directory is
        fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
