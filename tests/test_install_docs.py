"""The README's install lines are the ones CI runs, and they are true on a fresh machine: no bare
``sudo`` (root has none), ``apt-get update`` before ``apt-get install``, torch from PyTorch's CPU
wheel index for users without a GPU and a separate line for NVIDIA users."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CPU_INDEX = "--index-url https://download.pytorch.org/whl/cpu"


def _bash_blocks(text: str) -> list[list[str]]:
    return [[ln for ln in b.splitlines() if ln.strip()] for b in re.findall(r"```bash\n(.*?)```", text, re.S)]


def install_block() -> list[str]:
    """The README's first bash block: the CPU-only install and launch."""
    return _bash_blocks((ROOT / "README.md").read_text(encoding="utf-8"))[0]


def test_install_lines_are_true_on_a_fresh_machine():
    lines = install_block()
    text = "\n".join(lines)
    assert not re.search(r"(^|[;&|]\s*)sudo\b", text, re.M), "a bare sudo fails as root, where there is none"
    apt = [ln for ln in lines if "apt-get" in ln]
    assert apt and "apt-get update" in apt[0] and apt[0].index("apt-get update") < apt[0].index("apt-get install")
    assert "$(command -v sudo) apt-get install" in apt[0]
    torch_lines = [ln for ln in lines if re.search(r"pip install .*\btorch\b", ln)]
    assert len(torch_lines) == 1 and CPU_INDEX in torch_lines[0], "torch must come from PyTorch's CPU index"
    assert lines[-1].strip() == "sharpi-gui"


def test_readme_has_a_separate_nvidia_line():
    blocks = _bash_blocks((ROOT / "README.md").read_text(encoding="utf-8"))
    nvidia = [b for b in blocks[1:3] if any(re.fullmatch(r"pip install torch==[\d.]+", ln.strip()) for ln in b)]
    assert nvidia, "the second block gives NVIDIA users PyPI's (CUDA) torch"
    pin = re.search(r"torch==([\d.]+)", "\n".join(install_block())).group(1)
    assert f"torch=={pin}" in "\n".join(nvidia[0]), "both lines pin the same torch"


def test_ci_runs_the_readme_install_lines_verbatim():
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    for line in install_block():
        if line.startswith("python3 -m venv") or line.strip() == "sharpi-gui":
            continue  # CI makes its own venv (.venv-ci) and launches no window
        assert any(c.startswith(line) for c in ci), f".ci/run does not run the README's line: {line}"
