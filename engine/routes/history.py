"""The user's routing history: a folder of routing traces (``.npz``, :mod:`engine.routes.trace`),
``EngineOptions.routes_dir`` (``SHARPI_ROUTES_DIR``), else the user data directory's ``routes`` folder. The app
records into it (the experts dock's *Record routing*); ``sharpi run|bench|serve --record-routes FILE`` does with
FILE there. The planner's expert-cache hit-rate curve is replayed from it (``engine.runtime.hit_curves``).
"""

from __future__ import annotations

import time
from pathlib import Path

from engine import config
from engine.config import EngineOptions


def history_dir(options: EngineOptions | None = None) -> Path:
    """``EngineOptions.routes_dir`` if set, else the user data directory's ``routes``."""
    d = (options or config.current()).routes_dir
    if d is not None:
        return Path(d)
    from platformdirs import user_data_dir

    return Path(user_data_dir("SharpI", "SharpI")) / "routes"


def history_traces(options: EngineOptions | None = None) -> list[Path]:
    """The history's trace files, oldest name first."""
    d = history_dir(options)
    return sorted(d.glob("*.npz")) if d.is_dir() else []


def save_to_history(trace, options: EngineOptions | None = None) -> Path:
    """Write ``trace`` into the history as ``routes-YYYYmmdd-HHMMSS[-n].npz``; returns its path."""
    from engine.routes.trace import save_trace

    d = history_dir(options)
    d.mkdir(parents=True, exist_ok=True)
    stem = time.strftime("routes-%Y%m%d-%H%M%S")
    path, n = d / f"{stem}.npz", 1
    while path.exists():
        n += 1
        path = d / f"{stem}-{n}.npz"
    save_trace(trace, path)
    return path
