"""The host CPU's feature flags, for messages that compare an engine's host with this one."""

from __future__ import annotations


def cpu_flags(path: str = "/proc/cpuinfo") -> frozenset[str]:
    """The feature flags of the first CPU in ``path`` (Linux), empty where there is no such file."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()
