"""Where lowbit caches what it derives once (converted models, the native library): one answer."""

from __future__ import annotations

import os
import sys
from pathlib import Path


def default_cache_dir() -> Path:
    """The user cache dir. On Linux that is the XDG rule, applied here as platformdirs applies it
    (importing platformdirs costs a fresh process ~7 ms); elsewhere platformdirs decides."""
    if sys.platform.startswith("linux"):
        base = os.environ.get("XDG_CACHE_HOME", "").strip() or os.path.expanduser("~/.cache")
        return Path(base) / "lowbit"
    import platformdirs

    return Path(platformdirs.user_cache_dir("lowbit"))
