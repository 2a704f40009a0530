"""The main window: chat in the middle, placement and experts docks, menus, shortcuts, status bar.

It receives everything it shows through an :class:`~sharpi_gui.context.AppContext` (the bridge is
handed in, never imported), renders, and routes the user's intents to the models.
"""

from __future__ import annotations

import sys
from pathlib import Path

from PySide6.QtCore import Qt, QTimer
from PySide6.QtGui import QAction, QCloseEvent, QKeySequence
from PySide6.QtWidgets import (
    QDialog,
    QFileDialog,
    QLabel,
    QMainWindow,
    QMenu,
    QProgressBar,
    QPushButton,
    QWidget,
)

from sharpi_gui import data as D
from sharpi_gui.views import dialogs
from sharpi_gui.views.chat import ChatView
from sharpi_gui.views.experts import ExpertsDock, decode_text
from sharpi_gui.views.library import LibraryDialog
from sharpi_gui.views.model_card import ModelCardDialog
from sharpi_gui.views.placement import PlacementDock
from sharpi_gui.views.remote import ConnectDialog
from sharpi_gui.views.server import ServerDock

APP_NAME = "SharpI"


def window_title(model: str) -> str:
    """The window's title: "SharpI — model", or the model's name alone when it begins with SharpI (the demo
    model is "SharpI demo …"): the title bar says SharpI once."""
    return model if model.startswith(APP_NAME + " ") else f"{APP_NAME} — {model}"


class MainWindow(QMainWindow):
    def __init__(self, ctx, parent: QWidget | None = None):
        super().__init__(parent)
        self.ctx = ctx
        self.bridge, self.settings = ctx.bridge, ctx.settings
        self.interactive = True  # False: errors go to stderr, not to dialogs (a scripted run, sharpi-gui --ask)
        theme = ctx.theme
        self.setObjectName("main-window")
        self.setWindowTitle(APP_NAME)
        self.resize(1500, 1000)
        self.card: D.ModelCard | None = None
        self.limits: D.PlacementLimits | None = None
        self.remote: D.RemoteInfo | None = None  # the endpoint the chat streams from, in place of a local model
        self._pending_open: str | None = None  # a model to open once the engine is free
        self._startup_note = ""  # said in the status bar once the first model is loaded

        self.chat = ChatView(ctx.chat, theme)
        self.setCentralWidget(self.chat)
        self.placement_dock = PlacementDock(ctx.placement, theme, self)
        self.experts_dock = ExpertsDock(ctx.experts, theme, self)
        self.addDockWidget(Qt.DockWidgetArea.RightDockWidgetArea, self.placement_dock)
        self.addDockWidget(Qt.DockWidgetArea.RightDockWidgetArea, self.experts_dock)
        self.server_dock = ServerDock(ctx.server, self)
        self.addDockWidget(Qt.DockWidgetArea.LeftDockWidgetArea, self.server_dock)
        self.server_dock.hide()  # Model → Local server (Ctrl+3) shows it
        self.resizeDocks([self.placement_dock], [560], Qt.Orientation.Horizontal)
        self.resizeDocks([self.placement_dock, self.experts_dock], [560, 420], Qt.Orientation.Vertical)

        # status bar
        sb = self.statusBar()
        self.progress = QProgressBar()
        # wide enough for the longest step on one line: "measuring the device (once per machine) (75%)"
        self.progress.setMaximumWidth(340)
        self.progress.setVisible(False)
        self.status = {
            k: QLabel() for k in ("prompt", "decode", "ttft", "ctx", "placement")
        }  # permanent fields, left to right
        self.cancel_button = QPushButton("Cancel")
        self.cancel_button.setToolTip("Stop loading (the model open before stays)")
        self.cancel_button.setVisible(False)
        # This CPU's calibration, measured in the background on the first launch without a GPU.
        self.calib_label = QLabel()
        self.calib_label.setObjectName("calibration-line")
        self.calib_label.setVisible(False)
        self.calib_cancel = QPushButton("Skip")
        self.calib_cancel.setToolTip(
            "Stop measuring this CPU (predicted speeds stay uncalibrated until the next start)"
        )
        self.calib_cancel.setVisible(False)
        sb.addPermanentWidget(self.progress)
        sb.addPermanentWidget(self.cancel_button)
        sb.addPermanentWidget(self.calib_label)
        sb.addPermanentWidget(self.calib_cancel)
        for label in self.status.values():
            label.setContentsMargins(6, 0, 6, 0)
            sb.addPermanentWidget(label)
        self._render_stats(D.GenStats())

        self._build_menus()
        self._wire()
        geometry, state = self.settings.window_state()
        if geometry is not None:
            self.restoreGeometry(geometry)
        if state is not None:
            self.restoreState(state)
        self.chat.set_has_model(False)
        if ctx.themes is not None:
            ctx.themes.changed.connect(self.restyle)
        if ctx.store.notice:  # a broken database moved aside, or a data directory that cannot be written
            QTimer.singleShot(0, self.show_store_notice)

    def show_store_notice(self) -> None:
        """Say what the conversation store did at start-up (its backup, or a session kept in memory)."""
        title = "Conversations are not being saved" if self.ctx.store.in_memory else "Conversation database reset"
        dialogs.show_error(self, D.Failure(D.ERR_ENGINE, title, self.ctx.store.notice or ""))

    # -- menus and shortcuts ----------------------------------------------------------------------------
    def _action(self, menu: QMenu, text: str, slot, shortcut=None, name: str = "") -> QAction:
        act = QAction(text, self)
        if shortcut is not None:
            act.setShortcut(QKeySequence(shortcut))
        act.triggered.connect(slot)
        menu.addAction(act)
        self.actions_by_name[name or text] = act
        return act

    def _build_menus(self) -> None:
        self.actions_by_name: dict[str, QAction] = {}
        mb = self.menuBar()
        m = mb.addMenu("&File")
        self._action(m, "&Open model…", self.open_dialog, QKeySequence.StandardKey.Open, "open")
        self._action(m, "Model &library…", self.library_dialog, "Ctrl+Shift+O", "library")
        self.recent_menu = m.addMenu("Recent &models")
        self.recent_menu.aboutToShow.connect(self._fill_recent)
        self._action(m, "&Connect to server…", self.connect_dialog, "Ctrl+Shift+R", "connect")
        m.addSeparator()
        self._action(m, "&Export profiler stats…", self.export_dialog, "Ctrl+E", "export")
        m.addSeparator()
        self._action(m, "&Quit", self.close, QKeySequence.StandardKey.Quit, "quit")

        m = mb.addMenu("&Chat")
        chat = self.ctx.chat
        self._action(m, "&New conversation", chat.new_conversation, QKeySequence.StandardKey.New, "new")
        self._action(m, "&Rename conversation…", self.chat.rename_current, "F2", "rename")
        self._action(m, "&Delete conversation", self.chat.delete_current, None, "delete")
        self._action(m, "E&xport conversation…", self.export_conversation_dialog, "Ctrl+Shift+E", "export-chat")
        m.addSeparator()
        self._action(m, "&Stop", chat.stop, "Esc", "stop")
        self._action(m, "Re&generate", chat.regenerate, "Ctrl+R", "regenerate")
        self._action(m, "Focus the message box", self.chat.focus_input, "Ctrl+L", "focus")
        m.addSeparator()
        self._action(m, "System &prompt", self.chat.show_system_prompt, None, "system")
        self._action(m, "Sa&mpling settings…", self.sampling_dialog, "Ctrl+Shift+S", "sampling")

        m = mb.addMenu("&Model")
        self._action(m, "Model &card…", self.model_card_dialog, "Ctrl+I", "card")
        self.actions_by_name["card"].setEnabled(False)
        m.addSeparator()
        for dock, key in ((self.placement_dock, "Ctrl+1"), (self.experts_dock, "Ctrl+2"), (self.server_dock, "Ctrl+3")):
            act = dock.toggleViewAction()
            act.setShortcut(QKeySequence(key))
            m.addAction(act)

        m = mb.addMenu("&Help")
        self._action(m, "&Keyboard shortcuts", self.shortcuts_dialog, None, "shortcuts")
        self._action(m, "&About SharpI", lambda: dialogs.about_box(self).exec(), None, "about")

    def _fill_recent(self) -> None:
        self.recent_menu.clear()
        recent = self.settings.recent_models
        for path in recent:
            act = self.recent_menu.addAction(Path(path).name)
            act.setToolTip(path)
            act.setStatusTip(path)
            act.triggered.connect(lambda _c=False, p=path: self.open_model(p))
        if not recent:
            self.recent_menu.addAction("(none)").setEnabled(False)

    # -- wiring -----------------------------------------------------------------------------------------
    def _wire(self) -> None:
        b = self.bridge
        b.loadStarted.connect(self._on_load_started)
        self.cancel_button.clicked.connect(b.cancel_load)
        b.loadProgress.connect(self._on_load_progress)
        b.loaded.connect(self._on_loaded)
        b.loadFailed.connect(self._on_load_failed)
        b.applied.connect(self._on_applied)
        b.applyProgress.connect(self._on_apply_progress)
        b.applyFailed.connect(lambda _f: self._apply_ended())
        b.remoteConnected.connect(self._on_remote)
        b.warning.connect(lambda text: self.statusBar().showMessage(text, 10000))
        b.replanned.connect(self._on_replanned)
        b.waiting.connect(lambda _rid: self.statusBar().showMessage("The chat waits for an API request to finish…"))
        b.busyChanged.connect(self._on_busy)
        b.calibrationProgress.connect(self._on_calibration_progress)
        b.calibrationEnded.connect(self._on_calibration_ended)
        self.calib_cancel.clicked.connect(b.cancel_calibration)
        self.ctx.placement.applyFailed.connect(self.show_error)
        self.ctx.chat.statsChanged.connect(self._render_stats)
        self.ctx.chat.notice.connect(self._on_chat_notice)
        self.experts_dock.panel.exportRequested.connect(self.export_dialog)

    def _on_calibration_progress(self, step: int, steps: int, what: str) -> None:
        count = f" — {step} of {steps}" if steps else ""
        self.calib_label.setText(f"{D.CALIBRATING}{count}")
        self.calib_label.setToolTip(f"measuring {what}; the chat stays usable (asking pauses it)")
        self.calib_label.setVisible(True)
        self.calib_cancel.setVisible(True)

    def _on_calibration_ended(self, how: str, detail: str) -> None:
        if how == "paused":  # a question is being answered: measuring resumes when it is done
            self.calib_label.setText(f"{D.CALIBRATING} — paused while the model answers")
            return
        self.calib_label.setVisible(False)
        self.calib_cancel.setVisible(False)
        text = {
            "done": f"This CPU is calibrated ({detail}): predicted speeds are now measured ones",
            "cancelled": "CPU calibration skipped: predicted speeds stay uncalibrated until the next start",
            "failed": f"CPU calibration failed; predicted speeds stay uncalibrated ({detail})",
        }.get(how, "")
        if text:
            self.statusBar().showMessage(text, 10000)

    def _on_replanned(self, headline: str, note: str) -> None:
        """`auto` moved the experts on the conversation's own routing: the headline in the status bar for a while,
        the whole note (hit rates, predicted tok/s) in the placement label's tooltip until the next placement."""
        self.statusBar().showMessage(headline, 15000)
        self.status["placement"].setToolTip(note)

    def _on_chat_notice(self, failure: D.Failure) -> None:
        """The model's chat template failed: offer ChatML in its place, never silently."""
        if failure.kind != D.ERR_TEMPLATE:
            return
        text = f"{failure.message}\n\nChat with the generic ChatML format instead, for this model until it is reopened?"
        if dialogs.confirm(self, "Chat template failed", text) and self.bridge.use_chatml():
            self.statusBar().showMessage("Chatting with ChatML in place of the model's template; send again.", 10000)

    def _on_load_started(self, path: str) -> None:
        self.progress.setRange(0, 0)
        self.progress.setVisible(True)
        self.cancel_button.setVisible(True)
        self.statusBar().showMessage(f"Loading {Path(path).name}…")
        self.chat.set_status_line(f"Loading {Path(path).name}…")
        self.chat.set_has_model(False)  # nothing to send to until the new model is ready

    def _on_load_progress(self, done: int, total: int, what: str) -> None:
        self.progress.setRange(0, max(total, 1))
        self.progress.setValue(done)
        kernels = what.startswith(D.PREPARING)
        self.progress.setFormat(f"CPU kernels {done} of {total}" if kernels else f"{what} (%p%)")
        if kernels:
            self.chat.set_status_line(f"{what}. The chat opens when they are ready; later starts skip this.")
        else:
            self.chat.set_status_line(f"Loading {Path(self.bridge.loading_path).name}: {what}…")

    def _on_loaded(self, card: D.ModelCard, limits: D.PlacementLimits) -> None:
        self.card, self.limits, self.remote = card, limits, None
        self.placement_dock.set_remote(None)
        self.experts_dock.set_remote(None)
        self.progress.setVisible(False)
        self.cancel_button.setVisible(False)
        self.settings.loading_model = ""
        self.chat.set_status_line("")
        self.setWindowTitle(window_title(card.name))
        note, self._startup_note = self._startup_note, ""
        self.statusBar().showMessage(note or f"Loaded {Path(card.path).name}", 15000 if note else 5000)
        self.settings.add_recent_model(card.path)
        self.actions_by_name["card"].setEnabled(True)
        self.chat.set_has_model(True)
        self._render_stats(D.GenStats(n_ctx=card.n_ctx))

    def _on_remote(self, info: D.RemoteInfo) -> None:
        self.card, self.limits, self.remote = None, None, info
        self.progress.setVisible(False)
        self.setWindowTitle(f"{APP_NAME} — {info.model} @ {info.base_url}")  # a server's model id, often a path
        self.statusBar().showMessage(f"Connected to {info.base_url} ({info.model})", 5000)
        self.settings.remote_url = info.base_url
        self.actions_by_name["card"].setEnabled(False)
        self.placement_dock.set_remote(info)
        self.experts_dock.set_remote(info)
        self.chat.set_has_model(True)
        self._render_stats(D.GenStats())

    def _on_apply_progress(self, done: int, total: int, what: str) -> None:
        """A re-placement's slow part (the expert cache's page-locked host copy: seconds to minutes): the same bar
        as a load's, and the step in the chat's status line."""
        self.progress.setRange(0, max(total, 1))
        self.progress.setValue(done)
        self.progress.setFormat(f"{what} (%p%)")
        self.progress.setVisible(True)
        self.chat.set_status_line(f"Applying the placement: {what}…")

    def _apply_ended(self) -> None:
        self.progress.setVisible(False)
        self.chat.set_status_line("")

    def _on_applied(self, card: D.ModelCard, limits: D.PlacementLimits) -> None:
        self._apply_ended()
        self.card, self.limits = card, limits
        self.status["placement"].setToolTip("")  # a re-plan's note (set after this) belongs to its placement only
        self.settings.placement = limits.applied  # the next load places the model the same way
        self.settings.set_ctx_for(card.path, limits.current.ctx)  # this model's, no other's
        self.settings.kv_type = limits.current.kv_type
        self.statusBar().showMessage("Placement applied", 5000)
        self._render_stats(D.GenStats(n_ctx=card.n_ctx))

    def _on_load_failed(self, failure: D.Failure) -> None:
        self.progress.setVisible(False)
        self.cancel_button.setVisible(False)
        self.settings.loading_model = ""
        self.chat.set_status_line("")
        self.chat.set_has_model(self.bridge.has_model)
        if failure.kind == D.ERR_CANCELLED:
            self.statusBar().showMessage(failure.message, 8000)
            return
        self.settings.remove_recent_model(self.bridge.loading_path)  # not reopened at the next start
        self.statusBar().clearMessage()
        self.show_error(failure)

    def _on_busy(self, state: str) -> None:
        self.placement_dock.panel.set_busy(state != "idle")
        self.actions_by_name["open"].setEnabled(state in ("idle", "generating"))
        self.actions_by_name["connect"].setEnabled(state == "idle")
        if state == "idle" and self._pending_open:
            QTimer.singleShot(0, lambda: self._pending_open and self.open_model(self._pending_open))

    def _render_stats(self, s: D.GenStats) -> None:
        st = self.status
        st["prompt"].setText(f"prompt {s.prompt_tok_s:.1f} tok/s" if s.n_prompt else "prompt — tok/s")
        mtp = "" if s.mtp_acceptance is None else f" · MTP {s.mtp_acceptance:.0%} accepted"
        st["decode"].setText(
            f"decode {decode_text(s.decode_tok_s, s.decode_hit_rate)}{mtp}" if s.decode_tok_s else "decode — tok/s"
        )
        st["ttft"].setText(f"TTFT {s.ttft_s * 1000:.0f} ms" if s.ttft_s else "TTFT —")
        n_ctx = s.n_ctx or (self.card.n_ctx if self.card else 0)
        st["ctx"].setText(f"context {s.n_ctx_used:,} / {n_ctx:,}" if n_ctx else "context —")
        if self.remote is not None:
            st["placement"].setText(f"remote: {self.remote.model} @ {self.remote.base_url}")
            if s.finish_reason and s.decode_tok_s:  # a reply ended: the docks' notes show its speed
                self.placement_dock.set_remote(self.remote, s.decode_tok_s)
                self.experts_dock.set_remote(self.remote, s.decode_tok_s)
        else:
            st["placement"].setText(f"placement: {self.limits.in_force}" if self.limits else "no model")

    def restyle(self, theme) -> None:
        self.chat.restyle(theme)
        self.placement_dock.panel.set_theme(theme)
        self.experts_dock.panel.set_theme(theme)

    # -- actions ----------------------------------------------------------------------------------------
    def show_error(self, failure: D.Failure) -> None:
        """An error dialog; with :attr:`interactive` off (``sharpi-gui --ask``), a line on stderr instead of
        a dialog nobody will close."""
        if self.interactive:
            dialogs.show_error(self, failure)
        else:
            print(f"sharpi-gui: {failure.title}: {failure.message}", file=sys.stderr, flush=True)

    def open_model(self, path: str) -> bool:
        """Load ``path`` now, or, while a reply streams, stop it and load when the engine is free."""
        if self.bridge.load(path, self.settings.ctx_for(path), self.settings.kv_type, self.settings.placement):
            self._pending_open = None
            self.settings.loading_model = path  # still set at the next start: this load never ended
            self.settings.sync()
            return True
        self._pending_open = path
        if self.bridge.state == "generating":
            self.ctx.chat.stop()
        self.statusBar().showMessage(f"Opening {Path(path).name} when the engine is free…", 5000)
        return False

    def open_initial(self, path: str | None = None) -> str | None:
        """Open ``path``, else the last model, else the bundled demo model; None if there is none.
        The last model is skipped when the previous start never finished loading it (it hung, or
        took all the memory): the demo opens instead and the status bar says why."""
        last = self.settings.last_model
        interrupted = self.settings.loading_model
        if interrupted:
            self.settings.loading_model = ""
            if last == interrupted:
                self.settings.remove_recent_model(last)
                last = ""
                self._startup_note = f"{Path(interrupted).name} did not finish loading last time; it is not reopened"
        candidates = [path] if path else [last, self.bridge.demo_model_path()]
        for p in candidates:
            if p and (path or Path(p).is_file()):
                self.open_model(p)
                return p
        return None

    def file_dialog(self, title: str, save: bool, name_filter: str, directory: str = "") -> QFileDialog:
        dlg = QFileDialog(self, title, directory, name_filter)
        dlg.setAcceptMode(QFileDialog.AcceptMode.AcceptSave if save else QFileDialog.AcceptMode.AcceptOpen)
        dlg.setFileMode(QFileDialog.FileMode.AnyFile if save else QFileDialog.FileMode.ExistingFile)
        return dlg

    def open_dialog(self) -> None:
        last = self.settings.last_model
        dlg = self.file_dialog(
            "Open a GGUF model", False, "GGUF models (*.gguf);;All files (*)", str(Path(last).parent) if last else ""
        )
        if dlg.exec() == QDialog.DialogCode.Accepted and dlg.selectedFiles():
            self.open_model(dlg.selectedFiles()[0])

    def library_dialog(self) -> LibraryDialog:
        """The GGUF files on this machine with the planner's verdict on each; Open loads one."""
        dlg = LibraryDialog(self.bridge, self.settings, self, self.card)
        dlg.measured_tok_s = self.limits.measured_tok_s if self.limits else 0.0
        dlg.openRequested.connect(self.open_model)
        dlg.rescan()
        dlg.exec()
        return dlg

    def export_conversation_dialog(self) -> None:
        chat = self.ctx.chat
        if chat.current is None:
            dialogs.show_error(self, D.Failure(D.ERR_NO_MODEL, "Nothing to export", "Open a conversation first."))
            return
        directory = self.settings.export_dir or str(Path.home())
        name = "".join(c if c.isalnum() or c in " -_" else "_" for c in chat.current.title).strip() or "conversation"
        dlg = self.file_dialog(
            "Export the conversation", True, "Markdown (*.md);;JSON (*.json)", str(Path(directory) / f"{name}.md")
        )
        if dlg.exec() != QDialog.DialogCode.Accepted or not dlg.selectedFiles():
            return
        path = dlg.selectedFiles()[0]
        if not path.lower().endswith((".md", ".json")):
            path += ".json" if "json" in dlg.selectedNameFilter().lower() else ".md"
        try:
            chat.export(path)
        except OSError as e:
            dialogs.show_error(self, D.Failure(D.ERR_ENGINE, "Export failed", str(e)))
            return
        self.settings.export_dir = str(Path(path).parent)
        self.statusBar().showMessage(f"Exported {Path(path).name}", 8000)

    def connect_dialog(self) -> None:
        """Ask for an OpenAI-compatible endpoint and chat through it (the local model, if any, is closed)."""
        dlg = ConnectDialog(self.bridge, self.settings.remote_url, self, self.ctx.keys)
        if dlg.exec() == QDialog.DialogCode.Accepted:
            kept = dlg.remember_key()
            if self.connect_remote(dlg.url(), dlg.api_key(), dlg.model()) and dlg.api_key() and not kept:
                self.statusBar().showMessage(f"Connecting to {dlg.url()}… {self.ctx.keys.note}")

    def connect_remote(self, url: str, api_key: str = "", model: str = "") -> bool:
        """Connect the chat to ``url`` now; False (with a note) while the engine is busy."""
        if not self.bridge.connect_remote(url, api_key, model):
            self.statusBar().showMessage("The engine is busy; connect once the reply or the load is done.", 8000)
            return False
        self.progress.setRange(0, 0)
        self.progress.setVisible(True)
        self.statusBar().showMessage(f"Connecting to {url}…")
        return True

    def export_dialog(self) -> None:
        if not self.bridge.has_model or self.remote is not None:
            why = "A remote model has no profiler stats." if self.remote is not None else "Open a model first."
            dialogs.show_error(self, D.Failure(D.ERR_NO_MODEL, "Nothing to export", why))
            return
        directory = self.settings.export_dir or str(Path.home())
        dlg = self.file_dialog(
            "Export profiler stats (JSON + CSV + PNG)",
            True,
            "Profiler stats (*.json)",
            str(Path(directory) / "sharpi-experts"),
        )
        if dlg.exec() != QDialog.DialogCode.Accepted or not dlg.selectedFiles():
            return
        self.export_stats(dlg.selectedFiles()[0])

    def export_stats(self, prefix: str) -> tuple[str, str, str] | None:
        prefix = str(Path(prefix).with_suffix("")) if prefix.endswith(".json") else prefix
        try:
            paths = self.experts_dock.panel.export_to(prefix)
        except OSError as e:
            dialogs.show_error(self, D.Failure(D.ERR_ENGINE, "Export failed", str(e)))
            return None
        self.settings.export_dir = str(Path(prefix).parent)
        self.statusBar().showMessage("Exported " + ", ".join(Path(p).name for p in paths), 8000)
        return paths

    def sampling_dialog(self) -> None:
        dlg = dialogs.SamplingDialog(self.settings.sampling, self.bridge.default_sampling, self)
        if dlg.exec() == QDialog.DialogCode.Accepted:
            self.settings.sampling = dlg.values()

    def model_card_dialog(self) -> None:
        if self.card is not None:
            ModelCardDialog(self.card, self).exec()

    def shortcuts_dialog(self) -> None:
        dialogs.ShortcutsDialog(self).exec()

    # -- closing ----------------------------------------------------------------------------------------
    def closeEvent(self, e: QCloseEvent) -> None:
        self.settings.loading_model = ""  # quitting during a load is not a load that never ended
        self.settings.save_window_state(self.saveGeometry(), self.saveState())
        self.settings.sync()
        self.ctx.close()
        super().closeEvent(e)
