"""Files written whole or not at all, however the process ends, with the mode open() gives a new file
(0o666 less the umask), so others can read them where the umask lets them."""

import os
from pathlib import Path


def atomic_write(path, write):
    """Calls write(f) on a binary temp file beside `path` (its name + ".tmp"), fsyncs it, renames it
    onto `path` and fsyncs the directory, so a kill or power loss leaves the old file or the new one,
    never a part. On any error, write's included, the temp file is removed and the error re-raised."""
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


def new_file_mode():
    """The mode open() gives a file it creates: 0o666 less this process's umask. For files that
    a library writes through a temp file of mode 0o600 and renames (safetensors' save_file)."""
    umask = os.umask(0o022)  # the umask can only be read by setting it; set back at once
    os.umask(umask)
    return 0o666 & ~umask
