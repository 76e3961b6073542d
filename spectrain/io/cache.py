"""Where spectrain keeps what it fetches or derives once per machine (dequantized targets, built engines)."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "SPECTRAIN_CACHE_DIR"


def cache_root() -> Path:
    """``$SPECTRAIN_CACHE_DIR``, else ``$XDG_CACHE_HOME/spectrain``, else ``~/.cache/spectrain``.

    Every cache (GGUF copies, fingerprints, the ``auto`` dtype decision, built engines) lives under this one
    root, so one variable moves all of them, and a sandbox that redirects XDG_CACHE_HOME catches them all."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser() / "spectrain"
