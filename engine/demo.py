"""Where the bundled demo model lives: the default of ``sharpi run`` and the desktop app.

The file is committed at ``resources/models/`` in the repository (trained by
``packaging/train_demo.py``). A wheel installs it as data under ``<prefix>/share/sharpi/models/``
(``[tool.setuptools.data-files]`` in ``pyproject.toml``). :func:`demo_model_path` looks in
``$SHARPI_DEMO_MODEL`` (``EngineOptions.demo_model``), then the checkout this module sits in, then the
install prefixes.
"""

from __future__ import annotations

import site
import sys
from pathlib import Path

from engine import config
from engine.config import EngineOptions

DEMO_FILE = "sharpi-demo-q8_0.gguf"
# Every file shipped beside it: its model card, and the second demo — a Gated-DeltaNet qwen35moe with an MTP head
# (packaging/train_demo.py --arch qwen35moe), listed by the app's model library from the same folder.
SHIPPED_FILES = (DEMO_FILE, "MODEL_CARD.md", "sharpi-demo-gdn-q8_0.gguf", "MODEL_CARD_GDN.md")
DATA_DIR = Path("share") / "sharpi" / "models"  # under an install prefix
REPO_DIR = Path("resources") / "models"  # under the repository root
ENV = config.ENV["demo_model"]


def candidate_paths(options: EngineOptions | None = None) -> list[Path]:
    """Every place :func:`demo_model_path` looks, in order (``options``: default ``config.current()``)."""
    out = []
    given = (options if options is not None else config.current()).demo_model
    if given is not None:
        out.append(Path(given))
    out.append(Path(__file__).resolve().parent.parent / REPO_DIR / DEMO_FILE)  # a checkout / editable install
    prefixes = [sys.prefix, sys.base_prefix, site.getuserbase()]
    for prefix in dict.fromkeys(p for p in prefixes if p):
        out.append(Path(prefix) / DATA_DIR / DEMO_FILE)
    return out


def demo_model_path(options: EngineOptions | None = None) -> Path:
    """Path of the bundled demo GGUF; :class:`FileNotFoundError` naming the places looked in."""
    paths = candidate_paths(options)
    for p in paths:
        if p.is_file():
            return p
    looked = ", ".join(str(p) for p in paths)
    raise FileNotFoundError(f"the bundled demo model {DEMO_FILE} is not installed (looked in: {looked})")
