"""Where spectrain keeps what it fetches or derives once per machine (dequantized targets, built engines)."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "SPECTRAIN_CACHE_DIR"


def cache_root() -> Path:
    """``$SPECTRAIN_CACHE_DIR``, default ``~/.cache/spectrain``."""
    return Path(os.environ.get(CACHE_ENV) or "~/.cache/spectrain").expanduser()
