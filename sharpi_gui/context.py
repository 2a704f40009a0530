"""What the main window is built from: the bridge, the store, settings, the four state models, the API
keys, the theme.

``app.create_context`` builds the real one; tests build theirs with a temporary data directory and
settings file. Nothing here imports the engine (the bridge instance is handed in).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sharpi_gui.chat_model import ChatModel
from sharpi_gui.experts_model import ExpertsModel
from sharpi_gui.keys import KeyStore
from sharpi_gui.placement_model import PlacementModel
from sharpi_gui.server_model import ServerModel
from sharpi_gui.settings import Settings
from sharpi_gui.store import ConversationStore
from sharpi_gui.theme import LIGHT, Theme, ThemeManager


@dataclass
class AppContext:
    bridge: object  # sharpi_gui.bridge.EngineBridge
    store: ConversationStore
    settings: Settings
    chat: ChatModel
    placement: PlacementModel
    experts: ExpertsModel
    server: ServerModel
    keys: KeyStore = field(default_factory=KeyStore)  # API keys: the OS keyring, else this run's memory
    theme: Theme = LIGHT
    themes: ThemeManager | None = None
    closed: bool = False

    @classmethod
    def build(
        cls,
        bridge,
        store: ConversationStore,
        settings: Settings,
        themes: ThemeManager | None = None,
        keys: KeyStore | None = None,
    ):
        keys = keys if keys is not None else KeyStore()
        return cls(
            bridge=bridge,
            store=store,
            settings=settings,
            chat=ChatModel(store, bridge, settings),
            placement=PlacementModel(bridge),
            experts=ExpertsModel(bridge, settings.heatmap_mode),
            server=ServerModel(bridge, settings, keys),
            keys=keys,
            theme=themes.theme if themes is not None else LIGHT,
            themes=themes,
        )

    def close(self) -> None:
        """Stop the engine thread, close the database; safe to call twice."""
        if self.closed:
            return
        self.closed = True
        self.settings.heatmap_mode = self.experts.mode
        self.chat.abort()  # a reply in flight is kept as stopped
        self.bridge.shutdown()
        self.store.close()
