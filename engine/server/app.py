"""The OpenAI-compatible HTTP API on FastAPI: routes, errors, streaming (SSE), auth and limits.

Every route answers JSON; every failure an OpenAI-style ``{"error": {...}}`` body (400 for what a
request got wrong, 401 without the key, 404 for an unknown model or route, 413 for an oversized
body, 429 with ``Retry-After`` when the queue is full, 503 while the model loads), never a traceback.
Generation runs on the :class:`~engine.server.runner.ModelRunner` (one at a time); a client that goes
away cancels its generation (streaming: when the response task is cancelled; otherwise a watcher on
the connection).
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.errors import SharpIError, UsageError
from engine.server.host import READY, ModelHost, RequestRecord
from engine.server.metrics import CONTENT_TYPE, ServerMetrics
from engine.server.protocol import Answer, RequestError, plan_chat, plan_completion
from engine.server.runner import QueueFull
from engine.server.schemas import ChatCompletionRequest, CompletionRequest

log = logging.getLogger("sharpi.server")


@dataclass(frozen=True)
class ServerOptions:
    api_key: str | None = None  # required as "Authorization: Bearer KEY" on /v1 and /metrics when set
    max_body_bytes: int = 4 << 20  # a larger request body is refused with 413
    retry_after_s: int = 1  # the Retry-After of a 429 / 503


def _error(status: int, message: str, type: str = "invalid_request_error", *, param=None, code=None, headers=None):
    body = {"error": {"message": message, "type": type, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errs = exc.errors()
    if not errs:
        return "the request is invalid", None
    e = errs[0]
    if e.get("type") == "json_invalid":
        return f"the request body is not valid JSON: {e.get('ctx', {}).get('error', e.get('msg'))}", None
    loc = [str(x) for x in e.get("loc", ()) if x != "body"]
    where = ".".join(loc)
    more = f" (and {len(errs) - 1} more problems)" if len(errs) > 1 else ""
    return (f"{where}: {e.get('msg')}" if where else str(e.get("msg"))) + more, where or None


GENERATION_ROUTES = frozenset({"/v1/chat/completions", "/v1/completions"})
ROUTES = frozenset({"/health", "/metrics", "/v1/models", *GENERATION_ROUTES})
RECORDED = "sharpi.recorded"  # set in the ASGI scope once a request is in the host's log


class _Guard:
    """Plain ASGI in front of the app: the API key, the body-size limit and the request counter.

    The body is read up front (at most ``max_body_bytes``, else 413) and replayed to the app, after
    which the connection's own ``receive`` takes over (so a disconnect still arrives)."""

    def __init__(self, app, options: ServerOptions, metrics: ServerMetrics, host: ModelHost):
        self.app, self.options, self.metrics, self.host = app, options, metrics, host

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        status = {"code": 0}

        async def counted_send(msg):
            if msg["type"] == "http.response.start":
                status["code"] = msg["status"]
            await send(msg)

        t0 = time.perf_counter()
        try:
            await self._guarded(scope, receive, counted_send, path)
        finally:
            if path in ROUTES and status["code"]:
                self.metrics.requests.labels(path, str(status["code"])).inc()
            if path in GENERATION_ROUTES and status["code"] and not scope.get(RECORDED):  # refused before generating
                self.host.record(RequestRecord(time.time(), path, status["code"], duration_s=time.perf_counter() - t0))

    async def _guarded(self, scope, receive, send, path):
        key = self.options.api_key
        if key and path != "/health":
            got = dict(scope.get("headers", [])).get(b"authorization", b"")
            if not secrets.compare_digest(got, f"Bearer {key}".encode()):
                resp = _error(401, "a valid API key is required (Authorization: Bearer KEY)", code="invalid_api_key")
                return await resp(scope, receive, send)
        limit = self.options.max_body_bytes
        chunks, size, more = [], 0, True
        while more:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            size += len(msg.get("body", b""))
            if size > limit:
                resp = _error(413, f"the request body is over {limit} bytes", code="body_too_large")
                return await resp(scope, receive, send)
            chunks.append(msg.get("body", b""))
            more = msg.get("more_body", False)
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


def create_app(host: ModelHost, options: ServerOptions | None = None) -> FastAPI:
    """The server's ASGI app over ``host`` (run it with uvicorn, or drive it with TestClient)."""
    options = options or ServerOptions()
    metrics = ServerMetrics(host)
    app = FastAPI(title="SharpI", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.host, app.state.metrics = host, metrics

    # -- errors ----------------------------------------------------------------------------------
    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        message, param = _validation_message(exc)
        return _error(400, message, param=param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _error(exc.status_code, str(exc.detail), kind, headers=getattr(exc, "headers", None))

    @app.exception_handler(RequestError)
    async def _refused(request: Request, exc: RequestError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(Exception)
    async def _crashed(request: Request, exc: Exception):
        log.exception("request %s %s failed", request.method, request.url.path)
        return _error(500, f"internal server error ({type(exc).__name__})", "server_error")

    # -- routes ----------------------------------------------------------------------------------
    @app.get("/health")
    async def health():
        if host.state == READY:
            return {"status": "ok"}
        done, total, what = host.progress
        body = {"status": host.state, "error": {"message": host.error or f"loading the model: {what} ({done}/{total})"}}
        return JSONResponse(body, status_code=503, headers={"Retry-After": str(options.retry_after_s)})

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models():
        meta = {}
        if host.session is not None:
            s = host.session
            meta = {"n_ctx": s.n_ctx, "architecture": s.info.architecture, "n_vocab": s.args.n_vocab}
            meta["n_params"] = s.info.n_parameters
        card = {"id": host.model_id, "object": "model", "created": host.created, "owned_by": "sharpi", "meta": meta}
        return {"object": "list", "data": [card]}

    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest, request: Request):
        session = _ready_session(req.model)
        plan = await run_in_threadpool(plan_chat, session, req)
        return await _generate(request, "chat", req, plan)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        session = _ready_session(req.model)
        plan = await run_in_threadpool(plan_completion, session, req)
        return await _generate(request, "completion", req, plan)

    # -- generation ------------------------------------------------------------------------------
    def _ready_session(model: str):
        if model != host.model_id:
            raise RequestError(
                404, f"the model {model!r} does not exist; this server serves {host.model_id!r}", param="model",
                code="model_not_found",
            )  # fmt: skip
        if host.state != READY:
            what = host.error or "the model is still loading"
            raise RequestError(503, what, type="unavailable", code="model_not_ready")
        return host.session

    async def _generate(request: Request, kind: str, req, plan):
        session = host.session
        route = request.url.path
        answer = Answer(kind, host.model_id, len(plan.ids), parse_tools=plan.parse_tools)

        def start():
            answer.started_at = time.perf_counter()
            if host.session is not session:  # the app loaded another model while this request waited
                raise UsageError("the model was replaced while this request waited; send it again")
            # a chat's reasoning goes to reasoning_content; a raw completion is the text whole
            return session.generate(
                prompt_ids=plan.ids,
                params=plan.params,
                constraint=plan.constraint,
                reasoning=kind == "chat",
                calls=plan.parse_tools,
            )

        request.scope[RECORDED] = True  # the log entry is written here, when the request ends
        try:
            job = host.runner.submit(start)
        except QueueFull as e:
            host.record(RequestRecord(time.time(), route, 429))
            headers = {"Retry-After": str(options.retry_after_s)}
            return _error(429, f"{e}; retry later", "rate_limit_exceeded", code="queue_full", headers=headers)

        def done(status: int) -> None:
            if status == 200:
                metrics.observe(answer)
            t = answer.timings()
            host.record(
                RequestRecord(
                    time.time(),
                    route,
                    status,
                    answer.n_prompt_tokens,
                    answer.last.n_generated if answer.last else 0,
                    answer.last.decode_tok_s if answer.last else 0.0,
                    t["total_ms"] / 1000,
                    "cancelled" if status == 499 else (answer.last.finish_reason or "") if answer.last else "",
                )
            )

        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(
                _stream(job, answer, include_usage, done),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        watcher = asyncio.ensure_future(_watch_disconnect(request, job))
        try:
            async for ev in job:
                answer.feed(ev)
        except SharpIError as e:
            done(400)
            return _error(400, str(e))
        except Exception:
            done(500)
            raise
        finally:
            watcher.cancel()
        if answer.cancelled or job.cancelled:
            done(499)
            return _error(499, "the client closed the request", code="cancelled")
        done(200)
        return answer.response()

    async def _stream(job, answer: Answer, include_usage: bool, done):
        status = 200
        try:
            first = answer.first_chunk()
            if first is not None:
                yield _sse(first)
            try:
                async for ev in job:
                    for piece in answer.feed(ev):
                        yield _sse(answer.piece_chunk(piece))
            except SharpIError as e:
                status = 400
                yield _sse({"error": {"message": str(e), "type": "invalid_request_error", "param": None, "code": None}})
                yield "data: [DONE]\n\n"
                return
            yield _sse(answer.final_chunk())
            if include_usage:
                yield _sse(answer.usage_chunk())
            yield "data: [DONE]\n\n"
        except BaseException:  # the client went away (the response task is cancelled): stop generating
            status = 499
            job.cancel()
            raise
        finally:
            done(status)

    return app


async def _watch_disconnect(request: Request, job) -> None:
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            job.cancel()
            return


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def asgi_app(host: ModelHost, options: ServerOptions | None = None):
    """:func:`create_app` behind the body-size limit: what uvicorn runs."""
    options = options or ServerOptions()
    app = create_app(host, options)
    return _Guard(app, options, app.state.metrics, host)
