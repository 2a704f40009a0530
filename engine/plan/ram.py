"""The host memory a process can still take, as the loader and the expert cache's host copy check it."""

from __future__ import annotations


def available_ram() -> int | None:
    """Bytes of RAM this process can still take: MemAvailable, within a cgroup v2 limit; None if unknown."""
    out = []
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    out.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        with open("/sys/fs/cgroup/memory.current") as f:
            used = int(f.read().strip())
        if limit != "max":
            out.append(max(0, int(limit) - used))
    except (OSError, ValueError):
        pass
    return min(out) if out else None
