"""Chat through a remote OpenAI-compatible endpoint (vLLM, SGLang, llama-server, another ``sharpi serve``)
with the same generation events a local :class:`~engine.api.Session` yields.

For models that outgrow the machine: ``sharpi run --remote URL`` streams from an existing serving engine over
the OpenAI protocol instead of loading a file. :class:`RemoteSession` has the slice of ``Session`` the chat
front ends use — ``generate(prompt | messages=, params=)``, ``cancel()``, ``close()`` — plus the endpoint's
model list. Placement, experts and logits do not apply to it.

What a remote stream cannot say is left at zero in the events: token ids (``token_id`` is None), the
context (``n_ctx``, ``n_ctx_used``), and prompt speed unless the server sends llama-server's ``timings``.
``n_generated`` counts streamed pieces until the final event, which takes the server's ``usage`` when
it sends one; ``ttft_s`` and ``decode_tok_s`` are measured here, on the client.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator

from engine.errors import SharpIError, UsageError
from engine.generate import GenerationEvent, SamplingParams
from engine.generate.events import FINISH_CANCELLED, FINISH_EOS, FINISH_LENGTH, FINISH_STOP

_FINISH = {"stop": FINISH_EOS, "length": FINISH_LENGTH, "tool_calls": FINISH_STOP, "content_filter": FINISH_STOP}


class RemoteError(SharpIError):
    """The endpoint could not be reached or refused a request (the message carries its error)."""


class RemoteSession:
    """A conversation partner over HTTP. ``base_url`` ends in ``/v1`` (as OpenAI clients take it)."""

    def __init__(self, base_url: str, api_key: str | None = None, model: str | None = None, timeout: float = 600.0):
        import httpx

        if not base_url.startswith(("http://", "https://")):
            raise UsageError(f"the remote URL must start with http:// or https://, got {base_url!r}")
        self.base_url = base_url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.Client(base_url=self.base_url, headers=headers, timeout=timeout)
        self._cancel = threading.Event()
        self._response = None  # the stream being read (cancel() interrupts its socket)
        try:
            self.models = self.list_models()
            if model is not None and model not in self.models:
                raise UsageError(f"{self.base_url} does not serve {model!r} (it serves: {', '.join(self.models)})")
        except BaseException:
            self.close()
            raise
        self.model = model or self.models[0]
        self.last_decode_tok_s = 0.0  # measured on the last generation (the app's docks show it)

    def list_models(self) -> list[str]:
        """The ids ``GET /models`` lists."""
        import httpx

        try:
            r = self._client.get("/models")
        except httpx.HTTPError as e:
            raise RemoteError(f"cannot reach {self.base_url}: {e}") from None
        _raise_for(r)
        ids = [m.get("id") for m in r.json().get("data", []) if isinstance(m, dict) and m.get("id")]
        if not ids:
            raise RemoteError(f"{self.base_url}/models lists no model")
        return ids

    def generate(
        self,
        prompt: str | None = None,
        *,
        messages: list[dict] | None = None,
        params: SamplingParams | None = None,
        cancel: threading.Event | None = None,
    ) -> Iterator[GenerationEvent]:
        """Stream a completion of ``prompt`` (``/completions``) or a chat (``/chat/completions``).
        ``cancel``: this generation's own stop event (as ``Session.generate`` takes it), set from any thread;
        the stream ends as cancelled at the next line the server sends, like :meth:`cancel`."""
        if (prompt is None) == (messages is None):
            raise UsageError("give exactly one of prompt or messages")
        p = params or SamplingParams()
        body = {
            "model": self.model,
            "stream": True,
            "stream_options": {"include_usage": True},
            "temperature": p.temperature,
            "top_p": p.top_p,
            "max_tokens": p.max_tokens,
            # llama-server, vLLM and SGLang take these sampling extensions
            "top_k": p.top_k,
            "min_p": p.min_p,
        }
        if p.stop:
            body["stop"] = list(p.stop)
        if p.seed is not None:
            body["seed"] = p.seed
        if p.presence_penalty:
            body["presence_penalty"] = p.presence_penalty
        if p.frequency_penalty:
            body["frequency_penalty"] = p.frequency_penalty
        if messages is not None:
            # earlier replies' reasoning stays here: templates drop it anyway, and DeepSeek's API refuses it (400)
            body["messages"] = [{k: v for k, v in m.items() if k != "reasoning_content"} for m in messages]
            route = "/chat/completions"
        else:
            body["prompt"] = prompt
            route = "/completions"
        self._cancel.clear()
        return self._stream(route, body, cancel)

    def _stream(self, route: str, body: dict, cancel: threading.Event | None) -> Iterator[GenerationEvent]:
        import httpx

        t0 = time.perf_counter()
        n, ttft, t_first, finish, usage, timings = 0, 0.0, None, None, None, {}

        def event(text: str, done: str | None = None, reasoning: str = "") -> GenerationEvent:
            now = time.perf_counter()
            tps = (n - 1) / (now - t_first) if t_first is not None and n > 1 and now > t_first else 0.0
            gen = usage.get("completion_tokens", n) if (done and usage) else n
            n_prompt = usage.get("prompt_tokens", 0) if usage else 0
            if done:
                self.last_decode_tok_s = float(timings.get("predicted_per_second") or tps)
            return GenerationEvent(
                text=text,
                token_id=None,
                n_prompt=n_prompt,
                n_generated=gen,
                n_ctx_used=0,
                n_ctx=0,
                ttft_s=ttft,
                prompt_tok_s=float(timings.get("prompt_per_second") or 0.0),
                decode_tok_s=float(timings.get("predicted_per_second") or tps) if done else tps,
                finish_reason=done,
                reasoning=reasoning,
            )

        def cancelled() -> bool:
            return self._cancel.is_set() or (cancel is not None and cancel.is_set())

        try:
            with self._client.stream("POST", route, json=body) as r:
                self._response = r
                if cancelled():  # a cancel that came before there was a socket to interrupt
                    self._interrupt()
                if r.status_code != 200:
                    r.read()
                    _raise_for(r)
                for line in r.iter_lines():
                    # leaving the block closes the connection: the server stops
                    if cancelled():
                        yield event("", FINISH_CANCELLED)
                        return
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    try:
                        chunk = json.loads(data)
                    except json.JSONDecodeError:
                        raise RemoteError(f"the server sent a malformed stream line: {data[:200]!r}") from None
                    if "error" in chunk:
                        raise RemoteError(f"the server reported: {_message(chunk)}")
                    usage = chunk.get("usage") or usage
                    timings = chunk.get("timings") or timings
                    for choice in chunk.get("choices") or []:
                        delta = choice.get("delta") or {}
                        text = delta.get("content") or choice.get("text") or ""
                        # the reasoning, as llama.cpp's server and DeepSeek stream it (vLLM: "reasoning")
                        thought = delta.get("reasoning_content") or delta.get("reasoning") or ""
                        if choice.get("finish_reason"):
                            finish = _FINISH.get(choice["finish_reason"], FINISH_STOP)
                        if text or thought:
                            n += 1
                            now = time.perf_counter()
                            if t_first is None:
                                t_first, ttft = now, now - t0
                            yield event(
                                text if isinstance(text, str) else "",
                                reasoning=thought if isinstance(thought, str) else "",
                            )
        except httpx.HTTPError as e:
            if not cancelled():
                raise RemoteError(f"the connection to {self.base_url} failed: {e}") from None
            finish = FINISH_CANCELLED  # cancel() cut the connection while the server was silent
        finally:
            self._response = None
        if finish is None and cancelled():
            finish = FINISH_CANCELLED
        yield event("", finish or FINISH_EOS)  # a stream that ends without a reason ended its text

    def fit_messages(self, messages: list[dict], max_tokens: int) -> tuple[list[dict], int]:
        """``Session.fit_messages``' contract: the endpoint keeps its own context (and says when it is
        full), so every message goes: (messages, 0 dropped)."""
        return list(messages), 0

    def cancel(self) -> None:
        """Stop the generation in progress (any thread): at once, even while the server is still silent (a
        long prompt), by shutting the connection's socket; the stream then ends as cancelled."""
        self._cancel.set()
        self._interrupt()

    def _interrupt(self) -> None:
        r = self._response
        stream = r.extensions.get("network_stream") if r is not None else None
        sock = stream.get_extra_info("socket") if stream is not None else None
        if sock is not None:
            try:  # wakes the read blocked on it (close() alone would not); the response's exit closes it
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def reset(self) -> None:
        """Nothing is cached on this side."""

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> RemoteSession:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _message(body) -> str:
    err = body.get("error") if isinstance(body, dict) else None
    if isinstance(err, dict):
        return str(err.get("message") or err)
    return str(err or body)


def _raise_for(r) -> None:
    if r.status_code == 200:
        return
    try:
        what = _message(r.json())
    except ValueError:
        what = r.text[:300]
    raise RemoteError(f"{r.request.url} answered {r.status_code}: {what}")
