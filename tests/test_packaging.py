"""The packaged app's static parts: the .desktop entry names the installed command and icon, the spec
bundles the demo model and the icon exists (the bundle itself is built and launched under Xvfb by
packaging/build_app.sh, a CI step of its own, after .ci/run)."""

from __future__ import annotations

import configparser
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
APP = ROOT / "packaging" / "app"


def test_desktop_entry_runs_the_installed_app():
    entry = configparser.ConfigParser(interpolation=None)
    entry.optionxform = str
    entry.read(APP / "sharpi.desktop", encoding="utf-8")
    e = entry["Desktop Entry"]
    scripts = (ROOT / "pyproject.toml").read_text(encoding="utf-8").split("[project.scripts]")[1].split("[")[0]
    assert e["Type"] == "Application" and e["Name"] == "SharpI" and e["Terminal"] == "false"
    assert e["Exec"].split()[0] == "sharpi-gui" and "\nsharpi-gui = " in scripts and e["TryExec"] == "sharpi-gui"
    assert e["Icon"] == "sharpi" and (ROOT / "sharpi_gui" / "sharpi.svg").is_file()
    assert e["Categories"].endswith(";")


def test_spec_bundles_the_demo_model_and_the_desktop_entry():
    spec = (APP / "sharpi.spec").read_text(encoding="utf-8")
    assert '"sharpi-demo-q8_0.gguf"' in spec and '"sharpi.desktop"' in spec and '"sharpi-demo-gdn-q8_0.gguf"' in spec
    assert (ROOT / "resources" / "models" / "sharpi-demo-q8_0.gguf").is_file()
    script = (ROOT / "packaging" / "build_app.sh").read_text(encoding="utf-8")
    assert "--ask" in script and "xvfb-run" in script and "packaging/app/sharpi.spec" in script
