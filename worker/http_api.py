"""The worker's HTTP server: the standard library's ThreadingHTTPServer, one thread per request.

Handler threads only parse, tokenize, queue the job with the :class:`Scheduler` and write what
comes back; the model runs on the scheduler's thread alone. A handler waiting for tokens checks
every 0.1 s whether its client is still there (the socket reads as closed), and a write to a
gone client fails: either way the job is cancelled and its blocks go back to the pool.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (``/chat/completions`` too, as
mlx-lm), ``GET /v1/models``, ``GET /health``, ``GET /v1/stats``. Every error, including a
malformed request line or headers, is a JSON body ``{"error": {message, type, param, code}}``.

The standard library is enough here: the server is HTTP/1.0 (a connection per request, as
``mlx_lm.server``), and server-sent events are plain writes on that connection.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import select
import socket
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from vqpool.worker.models import LoadedModel
from vqpool.worker.openai_api import (
    CHAT,
    TEXT,
    ApiError,
    CompletionRequest,
    ResponseBuilder,
    parse_completion,
    usage,
)
from vqpool.worker.scheduler import (
    GenerationJob,
    JobEnd,
    QueueFullError,
    Scheduler,
    ShuttingDownError,
)

log = logging.getLogger("vqpool.worker")

MAX_BODY_BYTES = 8 * 1024 * 1024
CLIENT_CHECK_INTERVAL = 0.1
"""Seconds between checks that a waiting request's client is still connected."""
SOCKET_TIMEOUT = 60.0
"""Seconds a client may take to send its request or to take a write."""

_COMPLETION_ROUTES = {
    "/v1/completions": TEXT,
    "/v1/chat/completions": CHAT,
    "/chat/completions": CHAT,
}


@dataclass
class ServingApp:
    """What the handlers serve.

    Attributes:
        model: The loaded model and tokenizer.
        scheduler: Runs the jobs.
        default_max_tokens: ``max_tokens`` of a request that gives none.
        max_tokens_limit: The largest ``max_tokens`` accepted.
        describe_pool: Returns the pool's description for /health and /v1/stats.
    """

    model: LoadedModel
    scheduler: Scheduler
    default_max_tokens: int
    max_tokens_limit: int
    describe_pool: Callable[[], dict[str, Any]]


class _ClientGone(Exception):
    """The client closed its connection."""


class ServingHandler(BaseHTTPRequestHandler):
    """One HTTP request (see the module docstring)."""

    app: ServingApp  # set on the subclass make_server builds
    server_version = "vqpool-worker"
    timeout = SOCKET_TIMEOUT

    # -- plumbing --------------------------------------------------------------------------------

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s %s", self.address_string(), format % args)

    def _send_json(
        self, status: int, body: dict[str, Any], headers: dict[str, str] | None = None
    ) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(data)

    def _send_error(self, error: ApiError) -> None:
        self._send_json(error.status, error.body(), error.headers)

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """Errors the base class finds (bad request line, headers, method): JSON, not HTML."""
        self.close_connection = True
        # A request line too broken to name a version reads as HTTP/0.9, which has no status
        # line or headers: answer in HTTP/1.0 so the client sees the 4xx.
        self.request_version = "HTTP/1.0"
        text = message or self.responses.get(code, ("error",))[0]
        with contextlib.suppress(OSError):  # the client may be gone already
            self._send_error(ApiError(code, text))

    def _client_gone(self) -> bool:
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            if not readable:
                return False
            return self.connection.recv(1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):
            return True

    def _next_event(self, job: GenerationJob) -> int | JobEnd:
        """The job's next event; cancels the job and raises _ClientGone if the client left."""
        while True:
            try:
                return job.events.get(timeout=CLIENT_CHECK_INTERVAL)
            except queue.Empty:
                if self._client_gone():
                    self.app.scheduler.cancel(job)
                    raise _ClientGone() from None

    def _read_json(self) -> Any:
        length = self.headers.get("Content-Length")
        if length is None:
            raise ApiError(411, "Content-Length is required")
        try:
            n_bytes = int(length)
        except ValueError:
            raise ApiError(400, f"invalid Content-Length {length!r}") from None
        if n_bytes < 0:
            raise ApiError(400, f"invalid Content-Length {length!r}")
        if n_bytes > MAX_BODY_BYTES:
            self.close_connection = True
            raise ApiError(413, f"the body is {n_bytes} bytes; at most {MAX_BODY_BYTES} accepted")
        raw = self.rfile.read(n_bytes)
        if len(raw) != n_bytes:
            raise ApiError(400, "the body is shorter than its Content-Length")
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ApiError(400, f"the body is not valid JSON: {exc}") from None

    # -- routes ----------------------------------------------------------------------------------

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        app = self.app
        if path == "/health":
            self._send_json(200, {"status": "ok", "model": app.model.name, **app.describe_pool()})
        elif path == "/v1/models":
            model = {"id": app.model.name, "object": "model", "owned_by": "vqpool"}
            self._send_json(200, {"object": "list", "data": [model]})
        elif path == "/v1/stats":
            stats = {
                "model": app.model.name,
                "pid": os.getpid(),
                **app.describe_pool(),
                **app.scheduler.stats.snapshot(),
            }
            self._send_json(200, stats)
        else:
            self._send_error(ApiError(404, f"no route GET {path}", kind="not_found"))

    def do_POST(self) -> None:
        kind = _COMPLETION_ROUTES.get(self.path.split("?", 1)[0])
        try:
            if kind is None:
                raise ApiError(404, f"no route POST {self.path}", kind="not_found")
            app = self.app
            request = parse_completion(
                self._read_json(),
                kind,
                app.model,
                default_max_tokens=app.default_max_tokens,
                max_tokens_limit=app.max_tokens_limit,
            )
            job = GenerationJob(request.prompt, request.max_tokens, request.sampling)
            try:
                app.scheduler.submit(job)
            except (QueueFullError, ShuttingDownError) as exc:
                raise ApiError(
                    503, str(exc), kind="overloaded", headers={"Retry-After": "1"}
                ) from None
            if request.stream:
                self._stream(job, request)
            else:
                self._complete(job, request)
        except ApiError as error:
            self._send_error(error)
        except (_ClientGone, OSError):  # a reset, a broken pipe, or a write that timed out
            log.info("client %s went away; its request was cancelled", self.address_string())

    def _method_not_allowed(self) -> None:
        self._send_error(ApiError(405, f"method {self.command} is not allowed here"))

    do_PUT = do_DELETE = do_PATCH = _method_not_allowed

    # -- completions -----------------------------------------------------------------------------

    @staticmethod
    def _refusal(end: JobEnd) -> ApiError:
        headers = {"Retry-After": str(end.retry_after)} if end.retry_after else None
        kind = "overloaded" if end.status == 503 else "server_error"
        return ApiError(end.status, end.detail or end.finish_reason, kind=kind, headers=headers)

    def _complete(self, job: GenerationJob, request: CompletionRequest) -> None:
        text_stream = self.app.model.tokenizer.text_stream()
        parts: list[str] = []
        token_ids: list[int] = []
        while True:
            event = self._next_event(job)
            if isinstance(event, JobEnd):
                break
            token_ids.append(event)
            text_stream.add_token(event)
            parts.append(text_stream.last_segment)
        if event.finish_reason in ("rejected", "error"):
            raise self._refusal(event)
        text_stream.finalize()
        parts.append(text_stream.last_segment)
        builder = ResponseBuilder(request.kind, self.app.model.name)
        response = builder.complete(
            "".join(parts),
            event.finish_reason,
            event.detail,
            event.prompt_tokens,
            event.completion_tokens,
            token_ids if request.return_token_ids else None,
        )
        self._send_json(200, response)

    def _write_event(self, payload: dict[str, Any] | str) -> None:
        data = payload if isinstance(payload, str) else json.dumps(payload)
        self.wfile.write(f"data: {data}\n\n".encode())
        self.wfile.flush()

    def _stream(self, job: GenerationJob, request: CompletionRequest) -> None:
        # Headers wait for the first event, so a request the queue rejects still gets its 503.
        event = self._next_event(job)
        if isinstance(event, JobEnd) and event.finish_reason in ("rejected", "error"):
            raise self._refusal(event)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.end_headers()
        builder = ResponseBuilder(request.kind, self.app.model.name)
        text_stream = self.app.model.tokenizer.text_stream()
        try:
            with_ids = request.return_token_ids
            while not isinstance(event, JobEnd):
                text_stream.add_token(event)
                segment = text_stream.last_segment
                if segment or with_ids:
                    ids = [event] if with_ids else None
                    self._write_event(builder.chunk(segment, token_ids=ids))
                event = self._next_event(job)
            if event.finish_reason == "error":
                self._write_event(self._refusal(event).body())
            else:
                text_stream.finalize()
                final = builder.chunk(text_stream.last_segment, event.finish_reason, event.detail)
                final["usage"] = usage(event.prompt_tokens, event.completion_tokens)
                self._write_event(final)
                if request.include_usage:
                    self._write_event(
                        builder.usage_chunk(event.prompt_tokens, event.completion_tokens)
                    )
            self._write_event("[DONE]")
        except OSError:  # a client that left, or stopped reading until the write timed out
            self.app.scheduler.cancel(job)
            raise


def make_server(app: ServingApp, host: str, port: int) -> ThreadingHTTPServer:
    """An HTTP server for ``app`` bound to ``host:port`` (0: any free port); not started."""
    handler = type("BoundServingHandler", (ServingHandler,), {"app": app})
    server = ThreadingHTTPServer((host, port), handler)
    server.daemon_threads = True
    return server
