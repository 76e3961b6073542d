"""Free space before a long write: prepare-features and train refuse to start when their output cannot fit."""

from __future__ import annotations

import shutil
from pathlib import Path


def gib(n: float) -> str:
    """A size for a message: GiB with one decimal, MiB below one GiB."""
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def free_bytes(path: str | Path) -> int:
    """Free space on the file system that `path` is (or will be) on."""
    p = Path(path).expanduser().resolve()
    while not p.exists() and p != p.parent:
        p = p.parent
    return shutil.disk_usage(p).free


def require_disk(path: str | Path, need: float, what: str, fix: str) -> None:
    """Refuse (one line naming the fix) when `need` bytes will not fit on `path`'s disk."""
    free = free_bytes(path)
    if need > free:
        raise ValueError(f"{what} needs ~{gib(need)} at {path} but only {gib(free)} are free there; {fix}")
