"""Where lowbit keeps what it builds once: converted models and the native library."""

from __future__ import annotations

import os
import sys
from pathlib import Path


def default_cache_dir() -> Path:
    """The user cache dir for lowbit. On Linux that is the XDG rule (``$XDG_CACHE_HOME/lowbit``,
    else ``~/.cache/lowbit``), applied here as platformdirs applies it so that a fresh process
    need not import platformdirs; elsewhere platformdirs decides."""
    if sys.platform.startswith("linux"):
        base = os.environ.get("XDG_CACHE_HOME", "").strip() or os.path.expanduser("~/.cache")
        return Path(base) / "lowbit"
    import platformdirs

    return Path(platformdirs.user_cache_dir("lowbit"))
