"""``sharpi-gui [MODEL.gguf]``: the desktop app.

With no argument it opens the last model, else the bundled demo model, else an empty window that
says how to open one.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from PySide6.QtCore import QSettings
from PySide6.QtGui import QIcon
from PySide6.QtWidgets import QApplication

from sharpi_gui.bridge import EngineBridge, app_data_dir
from sharpi_gui.context import AppContext
from sharpi_gui.keys import KeyStore
from sharpi_gui.settings import APPLICATION, ORGANIZATION, Settings
from sharpi_gui.store import ConversationStore
from sharpi_gui.theme import ThemeManager
from sharpi_gui.views.main_window import MainWindow

ICON = Path(__file__).with_name("sharpi.svg")


def create_window(
    data_dir: str | None = None,
    qsettings: QSettings | None = None,
    themes: ThemeManager | None = None,
    simulate_device: bool = False,
    keys: KeyStore | None = None,
    calibrate_cpu: bool = True,
) -> MainWindow:
    """A main window over a fresh bridge; ``data_dir`` / ``qsettings`` default to the user's.
    ``simulate_device``: without a GPU, offer the engine's simulated device (tests of the device
    placement controls); the app never does, it says there is no GPU. ``keys``: where API keys are kept
    (default: the OS keyring). ``calibrate_cpu``: without a GPU, measure this CPU in the background after the
    first model is warmed up (once per machine; the predictions' speeds)."""
    store = ConversationStore(data_dir if data_dir is not None else app_data_dir())
    ctx = AppContext.build(
        EngineBridge(simulate_device=simulate_device, calibrate_cpu=calibrate_cpu),
        store,
        Settings(qsettings),
        themes,
        keys,
    )
    return MainWindow(ctx)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sharpi-gui", description="SharpI desktop app")
    p.add_argument("model", nargs="?", help="GGUF model to open (default: the last one, else the demo model)")
    p.add_argument("--data-dir", help="where conversations are stored (default: the user data directory)")
    p.add_argument("--dark", action=argparse.BooleanOptionalAction, default=None, help="force the dark/light theme")
    p.add_argument(
        "--ask",
        metavar="TEXT",
        help="send TEXT once the model is loaded, print the answer and exit (0: answered, 1: failed, 2: timed out)",
    )
    p.add_argument("--timeout", type=float, default=600.0, help="with --ask: seconds to wait for the answer")
    p.add_argument("--screenshot", metavar="PNG", help="with --ask: save the window there once answered")
    return p


def no_display_reason(env=None) -> str:
    """Why Qt cannot open a window here ("" if it may): on Linux, no X11 or Wayland display and no
    other Qt platform asked for. (Qt itself then aborts with a misleading "libxcb-cursor0 is needed".)"""
    env = os.environ if env is None else env
    if not sys.platform.startswith("linux") or env.get("QT_QPA_PLATFORM", "") not in ("", "xcb", "wayland"):
        return ""
    if env.get("DISPLAY") or env.get("WAYLAND_DISPLAY"):
        return ""
    return (
        "sharpi-gui: no display to open a window on (neither DISPLAY nor WAYLAND_DISPLAY is set). Run it in "
        "a desktop session, over `ssh -X`, or under `xvfb-run`; in a terminal, `sharpi run --chat` chats."
    )


def configure_application(app: QApplication) -> QApplication:
    """The app's names and icon, as the desktop shell shows them."""
    app.setOrganizationName(ORGANIZATION)
    app.setApplicationName(APPLICATION)
    app.setWindowIcon(QIcon(str(ICON)))
    app.setDesktopFileName("sharpi")  # packaging/app/sharpi.desktop: the desktop shell's icon and name
    # No application display name: Qt would append it to every window title ("SharpI — model — SharpI").
    return app


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    reason = "" if QApplication.instance() else no_display_reason()
    if reason:
        print(reason, file=sys.stderr)
        return 1
    app = configure_application(QApplication.instance() or QApplication(sys.argv[:1]))
    themes = ThemeManager(app, dark=args.dark)
    window = create_window(args.data_dir, None, themes)
    window.show()
    if args.ask:
        from sharpi_gui.scripted import ScriptedQuestion

        question = ScriptedQuestion(window, args.ask, args.timeout, screenshot=args.screenshot)
        question.done.connect(app.exit)
    if window.open_initial(args.model) is None and args.ask:
        print("sharpi-gui --ask: no model to open (give one, or install the demo model)", file=sys.stderr)
        window.ctx.close()
        return 1
    rc = app.exec()
    window.ctx.close()  # if the loop ended without closing the window (a no-op otherwise)
    return rc


if __name__ == "__main__":
    sys.exit(main())
