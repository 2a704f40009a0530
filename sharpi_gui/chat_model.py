"""The chat's state: conversations, the open transcript, the message being streamed.

Talks to the store (every finished or stopped message is written at once) and to the bridge
(generation); the chat view renders what this holds and calls its methods. Needs no engine import:
the bridge is handed in.
"""

from __future__ import annotations

import json
import os

from PySide6.QtCore import QObject, Signal

from sharpi_gui import data as D
from sharpi_gui.settings import Settings
from sharpi_gui.store import UNTITLED, ConversationStore, DamagedConversation

TITLE_CHARS = 48


def _title_from(text: str) -> str:
    line = " ".join(text.split())
    return line if len(line) <= TITLE_CHARS else line[: TITLE_CHARS - 1].rstrip() + "…"


class ChatModel(QObject):
    conversationsChanged = Signal()  # the list (titles, order) changed
    currentChanged = Signal()  # another conversation is open, or its messages were reloaded
    messageAdded = Signal(object)  # Message (user or assistant) appended to the open transcript
    streamStarted = Signal()
    streamText = Signal(str)  # the whole text streamed so far
    streamReasoning = Signal(str)  # the whole reasoning streamed so far
    streamEnded = Signal(object)  # the saved assistant Message, or None if nothing was produced
    statsChanged = Signal(object)  # GenStats of the latest event
    notice = Signal(object)  # Failure to show inline in the transcript
    info = Signal(str)  # a note (Markdown) to show inline in the transcript, not an error
    busyChanged = Signal(bool)
    presetsChanged = Signal()  # the loaded model's presets changed (another model, one saved or deleted)

    def __init__(self, store: ConversationStore, bridge, settings: Settings, parent: QObject | None = None):
        super().__init__(parent)
        self.store, self.bridge, self.settings = store, bridge, settings
        self.conversations: list[D.Conversation] = store.conversations()
        self.current: D.Conversation | None = None
        self.messages: list[D.Message] = []
        self.stream = ""
        self.reasoning = ""  # the streaming reply's reasoning so far
        self.stats = D.GenStats()
        self.tokens_at_stop: int | None = None
        self._rid = 0
        self._stream_cid = 0
        self._stream_parent: int | None = None  # the message the streaming reply answers
        self.model_name = ""  # the loaded model's file name: presets are kept per model file
        bridge.loaded.connect(self._on_model_loaded)
        bridge.token.connect(self._on_token)
        bridge.thought.connect(self._on_thought)
        bridge.trimmed.connect(self._on_trimmed)
        self._told_trimmed: set[int] = set()  # conversations already told that old turns are left out
        bridge.finished.connect(self._on_finished)
        bridge.failed.connect(self._on_failed)
        last = settings.last_conversation
        if any(c.id == last for c in self.conversations):
            self.select(last)
        elif self.conversations:
            self.select(self.conversations[0].id)

    @property
    def busy(self) -> bool:
        return self._rid != 0

    @property
    def streaming_here(self) -> bool:
        """A reply is streaming into the open conversation."""
        return self.busy and self.current is not None and self.current.id == self._stream_cid

    # -- conversations ------------------------------------------------------------------------------
    def _reload_list(self) -> None:
        self.conversations = self.store.conversations()
        self.conversationsChanged.emit()

    def new_conversation(self) -> D.Conversation:
        conv = self.store.create(UNTITLED, self.settings.default_system_prompt)
        self._reload_list()
        self.select(conv.id)
        return conv

    def select(self, cid: int) -> None:
        if self.busy and cid != (self.current.id if self.current else 0):
            self.stop()
        conv = self.store.conversation(cid)
        if conv is None:
            return
        try:
            messages = self.store.messages(cid)
        except DamagedConversation as e:
            self.notice.emit(
                D.Failure(D.ERR_ENGINE, "This conversation is damaged", f"{e}. The others are unaffected.")
            )
            messages = []
        self.current = conv
        self.messages = messages
        self.settings.last_conversation = cid
        self.currentChanged.emit()

    def rename(self, cid: int, title: str) -> None:
        title = " ".join(title.split())
        if not title:
            return
        self.store.rename(cid, title)
        if self.current and self.current.id == cid:
            self.current = self.store.conversation(cid)
        self._reload_list()

    def delete(self, cid: int) -> None:
        if self.current and self.current.id == cid:
            if self.busy:
                self.stop()
            self.current, self.messages = None, []
        self.store.delete(cid)
        self._reload_list()
        if self.current is None:
            if self.conversations:
                self.select(self.conversations[0].id)
            else:
                self.currentChanged.emit()

    def set_system_prompt(self, text: str) -> None:
        if self.current is None:
            self.new_conversation()
        self.store.set_system_prompt(self.current.id, text)
        self.current = self.store.conversation(self.current.id)
        self.settings.default_system_prompt = text

    def export(self, path: str, cid: int | None = None) -> str:
        """Write a conversation (default: the open one) to ``path``: JSON (``.json``: title, system
        prompt, messages with their speed figures) or Markdown (anything else). Returns the path."""
        cid = cid if cid is not None else (self.current.id if self.current else 0)
        conv = self.store.conversation(cid)
        if conv is None:
            raise OSError("no conversation to export")
        msgs = self.store.messages(cid)
        if path.lower().endswith(".json"):
            doc = {
                "title": conv.title,
                "system_prompt": conv.system_prompt,
                "messages": [
                    {"role": m.role, "content": m.content, "created": m.created, **m.meta}
                    | ({"reasoning": m.reasoning} if m.reasoning else {})
                    for m in msgs
                ],
            }
            text = json.dumps(doc, indent=1, ensure_ascii=False) + "\n"
        else:
            parts = [f"# {conv.title}\n"]
            if conv.system_prompt.strip():
                parts.append(f"**System prompt:** {conv.system_prompt.strip()}\n")
            for m in msgs:
                thought = "".join(f"> {line}\n" for line in m.reasoning.strip().splitlines()) if m.reasoning else ""
                thought = f"**Reasoning:**\n\n{thought}\n" if thought else ""
                parts.append(f"## {'You' if m.role == 'user' else 'Assistant'}\n\n{thought}{m.content.strip()}\n")
            text = "\n".join(parts)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        return path

    # -- generation ---------------------------------------------------------------------------------
    def send(self, text: str) -> bool:
        """Save ``text`` as the user's message and start the reply. False if nothing was sent."""
        text = text.strip()
        if not text or self.busy:
            return False
        if not self.bridge.has_model:
            self.notice.emit(D.Failure(D.ERR_NO_MODEL, "No model", "Open a model first (File → Open, Ctrl+O)."))
            return False
        if self.current is None:
            self.new_conversation()
        if self.current.title == UNTITLED and not self.messages:
            self.rename(self.current.id, _title_from(text))
        parent = self.messages[-1].id if self.messages else None
        msg = self.store.add_message(self.current.id, "user", text, parent_id=parent)
        self.messages.append(msg)
        self.messageAdded.emit(msg)
        self._reload_list()
        return self._start()

    def regenerate(self) -> bool:
        """Answer the last question again; the previous reply stays, as an alternative (← 1/2 →)."""
        if self.busy or self.current is None or not self.messages:
            return False
        if self.messages[-1].role == "assistant":
            self.messages.pop()
            self.currentChanged.emit()
        if not self.messages or self.messages[-1].role != "user":
            return False
        return self._start()

    def edit_and_resend(self, mid: int, text: str) -> bool:
        """Send ``text`` in place of the question ``mid`` and answer it: a new branch beside the old one,
        which stays reachable with the arrows of the edited question."""
        text = text.strip()
        at = next((i for i, m in enumerate(self.messages) if m.id == mid), None)
        if not text or self.busy or at is None or self.messages[at].role != "user":
            return False
        if not self.bridge.has_model:
            self.notice.emit(D.Failure(D.ERR_NO_MODEL, "No model", "Open a model first (File → Open, Ctrl+O)."))
            return False
        parent = self.messages[at].parent_id
        self.messages = self.messages[:at]
        msg = self.store.add_message(self.current.id, "user", text, parent_id=parent)
        self.messages.append(msg)
        self.currentChanged.emit()
        self._reload_list()
        return self._start()

    def branch(self, mid: int) -> D.Branch:
        """Where message ``mid`` sits among its alternatives."""
        return self.store.branch(mid)

    def switch_branch(self, mid: int, step: int) -> bool:
        """Show the alternative ``step`` places from message ``mid`` (-1: the one before, 1: the next),
        down to the newest message below it."""
        if self.busy or self.current is None:
            return False
        b = self.store.branch(mid)
        to = b.index + step
        if b.count == 0 or not 0 <= to < b.count:
            return False
        self.store.set_leaf(self.current.id, self.store.latest_leaf_under(b.sibling_ids[to]))
        self.select(self.current.id)
        return True

    def search(self, query: str) -> list[D.SearchHit]:
        """Conversations whose title or messages (any branch) contain ``query``."""
        return self.store.search(query)

    # -- presets --------------------------------------------------------------------------------------
    def _on_model_loaded(self, card, _limits=None) -> None:
        self.model_name = os.path.basename(card.path)
        self.presetsChanged.emit()

    def presets(self) -> list[D.Preset]:
        """The presets of the loaded model."""
        return self.store.presets(self.model_name) if self.model_name else []

    def save_preset(self, name: str) -> D.Preset | None:
        """Save the open conversation's system prompt and the sampling settings as ``name`` for the
        loaded model (replacing a preset of that name)."""
        name = " ".join(name.split())
        if not name or not self.model_name:
            return None
        system = self.current.system_prompt if self.current else self.settings.default_system_prompt
        preset = self.store.save_preset(self.model_name, name, system, self.settings.sampling)
        self.presetsChanged.emit()
        return preset

    def apply_preset(self, preset: D.Preset) -> None:
        """Use ``preset``: its system prompt in the open conversation, its sampling settings from now on."""
        self.settings.sampling = dict(preset.sampling)
        self.set_system_prompt(preset.system_prompt)
        self.currentChanged.emit()

    def delete_preset(self, preset: D.Preset) -> None:
        self.store.delete_preset(preset.id)
        self.presetsChanged.emit()

    def stop(self) -> None:
        if self.busy:
            self.tokens_at_stop = self.bridge.stop()

    def abort(self) -> None:
        """The app is closing: save the reply streamed so far as a stopped message, ignore the rest."""
        if self.busy:
            self.bridge.stop()
            self._save_reply(D.GenStats(finish_reason="cancelled", n_generated=self.stats.n_generated))
            self._rid = 0

    def chat_messages(self) -> list[dict]:
        """The open conversation as the engine's chat messages (system prompt first). A reply's reasoning goes as
        ``reasoning_content`` beside its answer: the model's chat template keeps or drops it (Qwen3's and
        gpt-oss's drop it from every earlier turn; a template that knows no reasoning never sees it)."""
        out = []
        if self.current and self.current.system_prompt.strip():
            out.append({"role": "system", "content": self.current.system_prompt})
        for m in self.messages:
            msg = {"role": m.role, "content": m.content}
            if m.role == "assistant" and m.reasoning:
                msg["reasoning_content"] = m.reasoning
            out.append(msg)
        return out

    def _start(self) -> bool:
        rid = self.bridge.generate(self.chat_messages(), self.settings.sampling)
        if not rid:
            self.notice.emit(D.Failure(D.ERR_ENGINE, "Busy", "The engine is busy (loading or applying); try again."))
            return False
        self._rid, self._stream_cid, self.stream, self.tokens_at_stop = rid, self.current.id, "", None
        self.reasoning = ""
        self._stream_parent = self.messages[-1].id if self.messages else None
        self.streamStarted.emit()
        self.busyChanged.emit(True)
        return True

    def _on_token(self, rid: int, text: str, stats: D.GenStats) -> None:
        if rid != self._rid:
            return
        self.stream += text
        self.stats = stats
        self.streamText.emit(self.stream)
        self.statsChanged.emit(stats)

    def _on_thought(self, rid: int, text: str) -> None:
        if rid != self._rid:
            return
        self.reasoning += text
        self.streamReasoning.emit(self.reasoning)

    def _on_trimmed(self, rid: int, dropped: int, n_ctx: int) -> None:
        if rid != self._rid or self._stream_cid in self._told_trimmed:
            return
        self._told_trimmed.add(self._stream_cid)
        self.info.emit(
            f"This conversation no longer fits the model's context of {n_ctx:,} tokens, so its oldest "
            "turns are left out of what the model reads (the system prompt and the latest turns stay). "
            "They stay here in the transcript."
        )

    def _save_reply(self, stats: D.GenStats) -> D.Message | None:
        if not (self.stream or self.reasoning) or self.store.conversation(self._stream_cid) is None:
            return None  # nothing, or deleted meanwhile
        meta = {
            "finish_reason": stats.finish_reason,
            "n_prompt": stats.n_prompt,
            "n_generated": stats.n_generated,
            "ttft_s": round(stats.ttft_s, 4),
            "prompt_tok_s": round(stats.prompt_tok_s, 2),
            "decode_tok_s": round(stats.decode_tok_s, 2),
        }
        msg = self.store.add_message(
            self._stream_cid, "assistant", self.stream, meta, parent_id=self._stream_parent, reasoning=self.reasoning
        )
        if self.current and self.current.id == self._stream_cid:
            self.messages.append(msg)
        return msg

    def _end(self, msg: D.Message | None) -> None:
        self._rid = 0
        if msg is None and self.current is not None and self.current.id == self._stream_cid:
            self.select(self.current.id)  # nothing new: the branch shown before (a regenerated reply comes back)
        self.streamEnded.emit(msg)
        self.busyChanged.emit(False)
        self._reload_list()

    def _on_finished(self, rid: int, stats: D.GenStats) -> None:
        if rid != self._rid:
            return
        self.stats = stats
        self.statsChanged.emit(stats)
        msg = self._save_reply(stats)
        self._end(msg)
        if stats.finish_reason == "context":
            self.notice.emit(
                D.Failure(
                    D.ERR_CONTEXT,
                    "Context full",
                    f"{stats.message or 'The context is full'}, so the reply stops here. Send another "
                    "message to go on: the oldest turns make room for it.",
                )
            )

    def _on_failed(self, rid: int, failure: D.Failure) -> None:
        if rid != self._rid:
            return
        msg = self._save_reply(self.stats)
        self._end(msg)
        self.notice.emit(failure)
