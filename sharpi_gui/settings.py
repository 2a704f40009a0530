"""Persistent settings (QSettings): recent models, sampling, placement controls, window layout.

The app uses the organisation/application names below; tests pass their own ``QSettings`` (an
INI file in a temporary directory) so the user's settings are never touched.
"""

from __future__ import annotations

import json

from PySide6.QtCore import QByteArray, QSettings

from sharpi_gui.data import MOE_CHOICES, PlanSettings

ORGANIZATION = "SharpI"
APPLICATION = "SharpI"
MAX_RECENT = 8
AUTO_CTX = 0  # the model's default context (engine.plan.default_ctx, as the CLI's)


class Settings:
    """Typed accessors over one QSettings store."""

    def __init__(self, qsettings: QSettings | None = None):
        self.q = qsettings if qsettings is not None else QSettings(ORGANIZATION, APPLICATION)

    def _get(self, key: str, default, kind=None):
        v = self.q.value(key, default)
        if v is None:
            return default
        try:
            return kind(v) if kind is not None else v
        except (TypeError, ValueError):
            return default

    def _json(self, key: str, default):
        raw = self._get(key, "", str)
        try:
            v = json.loads(raw) if raw else default
        except ValueError:
            return default
        return v if isinstance(v, type(default)) else default

    def sync(self) -> None:
        self.q.sync()

    # -- models -----------------------------------------------------------------------------------
    @property
    def recent_models(self) -> list[str]:
        return [str(p) for p in self._json("models/recent", []) if isinstance(p, str)]

    def add_recent_model(self, path: str) -> None:
        items = [path] + [p for p in self.recent_models if p != path]
        self.q.setValue("models/recent", json.dumps(items[:MAX_RECENT]))

    def remove_recent_model(self, path: str) -> None:
        self.q.setValue("models/recent", json.dumps([p for p in self.recent_models if p != path]))

    @property
    def last_model(self) -> str:
        recent = self.recent_models
        return recent[0] if recent else ""

    @property
    def loading_model(self) -> str:
        """The model a load was started for and has not ended (loaded, failed or cancelled) yet."""
        return self._get("models/loading", "", str)

    @loading_model.setter
    def loading_model(self, path: str) -> None:
        self.q.setValue("models/loading", path)

    @property
    def library_folders(self) -> list[str]:
        """Folders the user added to the model library (the usual download folders come on top)."""
        return [str(p) for p in self._json("library/folders", []) if isinstance(p, str)]

    @library_folders.setter
    def library_folders(self, folders: list[str]) -> None:
        self.q.setValue("library/folders", json.dumps(list(folders)))

    def ctx_for(self, path: str) -> int:
        """The context to load ``path`` with: the one last applied to that model, else AUTO_CTX (the
        model's default, as ``sharpi run`` gives it). One model's setting never carries to another."""
        v = self._json("models/ctx_by_model", {}).get(str(path), AUTO_CTX)
        return v if isinstance(v, int) and v >= 8 else AUTO_CTX

    def set_ctx_for(self, path: str, ctx: int) -> None:
        d = self._json("models/ctx_by_model", {})
        d[str(path)] = int(ctx)
        self.q.setValue("models/ctx_by_model", json.dumps(d))

    @property
    def kv_type(self) -> str:
        return self._get("models/kv_type", "", str)

    @kv_type.setter
    def kv_type(self, value: str) -> None:
        self.q.setValue("models/kv_type", value)

    @property
    def placement(self) -> PlanSettings | None:
        """The last applied placement (budget, expert mode, GPU layers); None = the default."""
        d = self._json("models/placement", {})
        try:
            vram, moe, g = int(d["vram_bytes"]), str(d["moe"]), int(d["n_gpu_layers"])
        except (KeyError, TypeError, ValueError):
            return None
        if vram < 0 or moe not in MOE_CHOICES or g < -1:
            return None
        # the context is the model's own (ctx_for): the bridge sets it when it places the model
        return PlanSettings(
            vram_bytes=vram, ctx=AUTO_CTX, kv_type=self.kv_type or PlanSettings.kv_type, moe=moe, n_gpu_layers=g
        )

    @placement.setter
    def placement(self, s: PlanSettings | None) -> None:
        if s is None:
            self.q.remove("models/placement")
            return
        self.q.setValue(
            "models/placement", json.dumps({"vram_bytes": s.vram_bytes, "moe": s.moe, "n_gpu_layers": s.n_gpu_layers})
        )
        self.kv_type = s.kv_type

    # -- chat -------------------------------------------------------------------------------------
    @property
    def sampling(self) -> dict:
        """Sampling overrides (keys of engine SamplingParams); missing keys take the engine's defaults."""
        return self._json("chat/sampling", {})

    @sampling.setter
    def sampling(self, value: dict) -> None:
        self.q.setValue("chat/sampling", json.dumps(value))

    @property
    def default_system_prompt(self) -> str:
        return self._get("chat/system_prompt", "", str)

    @default_system_prompt.setter
    def default_system_prompt(self, value: str) -> None:
        self.q.setValue("chat/system_prompt", value)

    @property
    def last_conversation(self) -> int:
        return self._get("chat/last_conversation", 0, int)

    @last_conversation.setter
    def last_conversation(self, cid: int) -> None:
        self.q.setValue("chat/last_conversation", int(cid))

    # -- docks ------------------------------------------------------------------------------------
    @property
    def heatmap_mode(self) -> str:
        return self._get("experts/mode", "heat", str)

    @heatmap_mode.setter
    def heatmap_mode(self, mode: str) -> None:
        self.q.setValue("experts/mode", mode)

    @property
    def export_dir(self) -> str:
        return self._get("experts/export_dir", "", str)

    @export_dir.setter
    def export_dir(self, path: str) -> None:
        self.q.setValue("experts/export_dir", path)

    # -- the local server (its API key is never stored here) --------------------------------------
    @property
    def server_host(self) -> str:
        return self._get("server/host", "127.0.0.1", str) or "127.0.0.1"

    @server_host.setter
    def server_host(self, value: str) -> None:
        self.q.setValue("server/host", value)

    @property
    def server_port(self) -> int:
        v = self._get("server/port", 8080, int)
        return v if 0 < v < 65536 else 8080

    @server_port.setter
    def server_port(self, value: int) -> None:
        self.q.setValue("server/port", int(value))

    # -- a remote endpoint (its API key is never stored here) ------------------------------------
    @property
    def remote_url(self) -> str:
        return self._get("remote/url", "", str)

    @remote_url.setter
    def remote_url(self, value: str) -> None:
        self.q.setValue("remote/url", value)

    # -- window -----------------------------------------------------------------------------------
    def window_state(self) -> tuple[QByteArray | None, QByteArray | None]:
        g, s = self.q.value("window/geometry"), self.q.value("window/state")
        return (g if isinstance(g, QByteArray) else None, s if isinstance(s, QByteArray) else None)

    def save_window_state(self, geometry: QByteArray, state: QByteArray) -> None:
        self.q.setValue("window/geometry", geometry)
        self.q.setValue("window/state", state)
