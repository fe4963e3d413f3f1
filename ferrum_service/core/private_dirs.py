"""Directories the server loads code or data from must be its own.

A cache directory that another local user can write to (``FERRUM_CACHE_DIR`` pointed at a shared
path, a world-writable parent) lets that user plant a built extension the server then loads (code
execution) or a converted weight file it then serves. :func:`untrusted_reason` says why a
directory fails that test; callers refuse to load from it.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path


def untrusted_reason(path: Path, up_to: Path | None = None) -> str | None:
    """Why ``path`` (and each directory from ``up_to`` down to it) cannot be trusted to hold
    what this process loads: a symlink, not a directory, not owned by this process's user, or
    writable by its group or others. None when it can (or does not exist yet)."""
    path = Path(path)
    chain = [path]
    if up_to is not None:
        up_to = Path(up_to)
        p = path
        while p != up_to and p.parent != p and up_to in p.parents:
            p = p.parent
            chain.append(p)
    uid = os.getuid()
    for d in chain:
        try:
            st = os.lstat(d)
        except FileNotFoundError:
            continue
        if stat.S_ISLNK(st.st_mode):
            return f"{d} is a symbolic link"
        if not stat.S_ISDIR(st.st_mode):
            return f"{d} is not a directory"
        if st.st_uid != uid:
            return f"{d} is owned by uid {st.st_uid}, not by this process's uid {uid}"
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            return f"{d} is writable by its group or by others (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def make_private_dir(path: Path, up_to: Path | None = None) -> Path:
    """Create ``path`` (mode 0700 for what is created) and check it with
    :func:`untrusted_reason`; PermissionError naming the reason when it fails."""
    Path(path).mkdir(parents=True, exist_ok=True, mode=0o700)
    why = untrusted_reason(path, up_to)
    if why is not None:
        raise PermissionError(f"refusing to load from {path}: {why}")
    return Path(path)


__all__ = ["make_private_dir", "untrusted_reason"]
