"""The worker's HTTP server: the standard library's ThreadingHTTPServer, one thread per request.

Handler threads only parse, tokenize, queue the job with the :class:`Scheduler` and write what
comes back; the model runs on the scheduler's thread alone. A handler waiting for tokens checks
every 0.1 s whether its client is still there (the socket reads as closed), and a write to a
gone client fails: either way the job is cancelled and its blocks go back to the pool.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (``/chat/completions`` too, as
mlx-lm), ``GET /v1/models``, ``GET /health``, ``GET /v1/stats``; a route called with another
method gets 405 with ``Allow``. Every error, including a malformed request line or headers, is
a JSON body ``{"error": {message, type, param, code}}``: a body the JSON parser cannot take
(nested too deeply for its recursion, a number past the interpreter's digit limit) is a 400
like any invalid JSON. ``/health`` answers 503 with ``status:
"no_session"`` while the worker cannot use a pool session (evicted and re-opening one, or the
daemon not answering: :meth:`PoolClient.session_problem`). While the daemon does not answer, a
completion request is refused at once with 503 and ``Retry-After``, naming the daemon; every
503 carries ``Retry-After``. CORS as mlx_lm.server's ``--allowed-origins``: every response
carries its headers; ``OPTIONS`` on any path is a 204 preflight answer.

A request's text goes through :class:`~vqpool.worker.api.completion_text.CompletionText`: when a
stop string completes, the handler answers at once and cancels the job with reason "stop".

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
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from vqpool.shared.api_error import ApiError
from vqpool.worker.api.chat_output import ChatOutput
from vqpool.worker.api.completion_text import CompletionText
from vqpool.worker.api.openai_api import (
    CHAT,
    TEXT,
    CompletionRequest,
    ResponseBuilder,
    ServedOptions,
    parse_completion,
)
from vqpool.worker.models.loading import LoadedModel
from vqpool.worker.sched.scheduler import (
    GenerationJob,
    JobEnd,
    NeverFitsError,
    QueueFullError,
    Scheduler,
    ScoredToken,
    ShuttingDownError,
)

log = logging.getLogger("vqpool.worker")

MAX_BODY_BYTES = 8 * 1024 * 1024
CLIENT_CHECK_INTERVAL = 0.1
"""Seconds between checks that a waiting request's client is still connected."""
RETRY_AFTER_DAEMON_DOWN = 1
"""Retry-After of a request refused because vqpoold does not answer: the worker notices that
it answers again within a heartbeat."""
SOCKET_TIMEOUT = 60.0
"""Seconds a client may take to send its request or to take a write."""

_COMPLETION_ROUTES = {
    "/v1/completions": TEXT,
    "/v1/chat/completions": CHAT,
    "/chat/completions": CHAT,
}
_GET_ROUTES = ("/health", "/v1/models", "/v1/stats")


@dataclass
class ServingApp:
    """What the handlers serve.

    Attributes:
        model: The loaded model and tokenizer.
        scheduler: Runs the jobs.
        default_max_tokens: ``max_tokens`` of a request that gives none.
        max_tokens_limit: The largest ``max_tokens`` accepted.
        describe_pool: Returns the pool's description for /health and /v1/stats; a
            ``pool_error`` key in it makes /health answer 503.
        served_name: The model id clients see and send (``--served-model-name``; empty: the
            ``--model`` argument as given, which requests may name too).
        pool_unavailable: Why no request can start now (vqpoold does not answer:
            ``PoolClient.daemon_unavailable``), or None. A request is then refused at once
            with 503 instead of waiting for the daemon's calls to time out.
    """

    model: LoadedModel
    scheduler: Scheduler
    default_max_tokens: int
    max_tokens_limit: int
    describe_pool: Callable[[], dict[str, Any]]
    served_name: str = ""
    pool_unavailable: Callable[[], str | None] = lambda: None
    created: int = field(default_factory=lambda: int(time.time()))
    """The ``created`` of the model's /v1/models entry: when the worker started serving it
    (mlx_lm.server gives its server's start time)."""
    allowed_origins: tuple[str, ...] = ("*",)
    """Origins a browser may call from (``--allowed-origins``; ``*``: any)."""
    options: ServedOptions = field(default_factory=ServedOptions)
    """The draft model and adapters a request may name (``--draft-model``, ``--adapter-path``)."""

    @property
    def model_id(self) -> str:
        return self.served_name or self.model.name


class _ClientGone(Exception):
    """The client closed its connection."""


class ServingHandler(BaseHTTPRequestHandler):
    """One HTTP request (see the module docstring)."""

    server: ServingServer
    server_version = "vqpool-worker"
    timeout = SOCKET_TIMEOUT

    @property
    def app(self) -> ServingApp:
        return self.server.app

    # -- plumbing --------------------------------------------------------------------------------

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s %s", self.address_string(), format % args)

    _responded = False
    """Whether a status line was sent (an error after that cannot be a new response)."""

    def send_response(self, code: int, message: str | None = None) -> None:
        self._responded = True
        super().send_response(code, message)

    def end_headers(self) -> None:
        self._send_cors_headers()
        super().end_headers()

    def _send_cors_headers(self) -> None:
        """CORS on every response, as mlx_lm.server sends it: the origin allowed (``*``, or the
        request's own when listed), any method and header."""
        allowed = self.app.allowed_origins
        origin = self.headers.get("Origin") if getattr(self, "headers", None) else None
        if "*" in allowed:
            self.send_header("Access-Control-Allow-Origin", "*")
        elif origin in allowed:
            self.send_header("Access-Control-Allow-Origin", origin)
            self.send_header("Vary", "Origin")
        self.send_header("Access-Control-Allow-Methods", "*")
        self.send_header("Access-Control-Allow-Headers", "*")

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

    def _next_event(self, job: GenerationJob) -> int | ScoredToken | JobEnd:
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
        except RecursionError:  # the parser recurses per level of nesting
            raise ApiError(400, "the body's JSON nests too deeply") from None
        except ValueError:  # an integer past the interpreter's digit limit
            raise ApiError(
                400,
                f"the body's JSON has a number of more than {sys.get_int_max_str_digits()} digits",
            ) from None

    # -- routes ----------------------------------------------------------------------------------

    def _wrong_method(self, path: str) -> ApiError | None:
        """405 (with ``Allow``) when ``path`` is a route of another method, else None."""
        if self.command != "POST" and path in _COMPLETION_ROUTES:
            allow = "POST"
        elif self.command != "GET" and path in _GET_ROUTES:
            allow = "GET"
        else:
            return None
        return ApiError(
            405,
            f"{path} takes {allow}, not {self.command}",
            kind="method_not_allowed",
            headers={"Allow": allow},
        )

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        app = self.app
        if path == "/health":
            pool = app.describe_pool()
            healthy = "pool_error" not in pool
            status = {"status": "ok" if healthy else "no_session", "model": app.model_id}
            self._send_json(200 if healthy else 503, {**status, **pool})
        elif path == "/v1/models":
            model = {
                "id": app.model_id,
                "object": "model",
                "created": app.created,
                "owned_by": "vqpool",
            }
            self._send_json(200, {"object": "list", "data": [model]})
        elif path == "/v1/stats":
            stats = {
                "model": app.model_id,
                "pid": os.getpid(),
                **app.describe_pool(),
                **app.scheduler.stats.snapshot(),
            }
            self._send_json(200, stats)
        else:
            wrong = self._wrong_method(path)
            self._send_error(wrong or ApiError(404, f"no route GET {path}", kind="not_found"))

    def do_POST(self) -> None:
        path = self.path.split("?", 1)[0]
        kind = _COMPLETION_ROUTES.get(path)
        try:
            if kind is None:
                wrong = self._wrong_method(path)
                raise wrong or ApiError(404, f"no route POST {path}", kind="not_found")
            app = self.app
            request = parse_completion(
                self._read_json(),
                kind,
                app.model,
                default_max_tokens=app.default_max_tokens,
                max_tokens_limit=app.max_tokens_limit,
                served_names=(app.model_id, app.model.name),
                options=app.options,
            )
            down = app.pool_unavailable()
            if down is not None:
                raise ApiError(
                    503,
                    f"could not start: {down}",
                    kind="service_unavailable",
                    headers={"Retry-After": str(RETRY_AFTER_DAEMON_DOWN)},
                )
            job = GenerationJob(
                request.prompt,
                request.max_tokens,
                request.sampling,
                logprobs=request.logprobs,
                top_logprobs=request.top_logprobs,
                num_draft_tokens=request.num_draft_tokens,
            )
            try:
                app.scheduler.submit(job)
            except NeverFitsError as exc:
                raise ApiError(400, str(exc), param="max_tokens") from None
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
        except Exception:  # a bug: still a JSON answer, never a connection closed on nothing
            log.exception("POST %s failed", path)
            if not self._responded:
                with contextlib.suppress(OSError):
                    self._send_error(
                        ApiError(500, "internal error (see the worker's log)", kind="server_error")
                    )

    def _other_method(self) -> None:
        path = self.path.split("?", 1)[0]
        wrong = self._wrong_method(path)
        self._send_error(
            wrong or ApiError(404, f"no route {self.command} {path}", kind="not_found")
        )

    do_PUT = do_DELETE = do_PATCH = _other_method

    def do_OPTIONS(self) -> None:
        """A browser's CORS preflight, on any path (as mlx_lm.server): 204 with the headers."""
        self.send_response(204)
        self.send_header("Content-Type", "application/json")
        self.end_headers()

    # -- completions -----------------------------------------------------------------------------

    @staticmethod
    def _refusal(end: JobEnd) -> ApiError:
        retry_after = end.retry_after or (1 if end.status == 503 else None)  # every 503 has one
        headers = {"Retry-After": str(retry_after)} if retry_after else None
        kind = (
            "overloaded"
            if end.status == 503
            else "invalid_request_error"
            if end.status < 500
            else "server_error"
        )
        return ApiError(end.status, end.detail or end.finish_reason, kind=kind, headers=headers)

    def _text(self, request: CompletionRequest) -> CompletionText:
        return CompletionText(
            self.app.model.tokenizer,
            request.stop,
            request.top_logprobs,
            reports_tokens=request.return_token_ids or request.logprobs,
        )

    def _chat_output(self, request: CompletionRequest, *, streaming: bool) -> ChatOutput | None:
        """The splitter of a chat answer into reasoning, tool calls and content, for a
        tokenizer that marks them (None: the text is all content)."""
        if request.kind != CHAT:
            return None
        markers = self.app.model.tokenizer.output_markers(request.prompt)
        return None if markers is None else ChatOutput(markers, request.tools, streaming=streaming)

    def _complete(self, job: GenerationJob, request: CompletionRequest) -> None:
        text = self._text(request)
        parts: list[str] = []
        while True:
            event = self._next_event(job)
            if isinstance(event, JobEnd):
                break
            parts.append(text.add(event))
            if text.stopped:
                self.app.scheduler.cancel(job, "stop")
                break
        if text.stopped:
            finish_reason, detail = "stop", None
        else:
            assert isinstance(event, JobEnd)
            if event.finish_reason in ("rejected", "error"):
                raise self._refusal(event)
            parts.append(text.finish())
            finish_reason, detail = event.finish_reason, event.detail
        content, reasoning, tool_calls = "".join(parts), "", None
        output = self._chat_output(request, streaming=False)
        if output is not None:
            output.add(content)
            output.end(finish_reason)
            delta = output.take()
            content, reasoning, tool_calls = delta.content, delta.reasoning, delta.tool_calls
            finish_reason = output.finish_reason(finish_reason)
        builder = ResponseBuilder(request.kind, self.app.model_id)
        response = builder.complete(
            content,
            finish_reason,
            detail,
            len(request.prompt),
            text.n_tokens,
            text.token_ids if request.return_token_ids else None,
            text.logprobs if request.logprobs else None,
            job.cached_tokens,
            reasoning,
            tool_calls,
        )
        self._send_json(200, response)

    def _write_event(self, payload: dict[str, Any] | str) -> None:
        data = payload if isinstance(payload, str) else json.dumps(payload)
        self.wfile.write(f"data: {data}\n\n".encode())
        self.wfile.flush()

    def _stream_tokens(
        self,
        job: GenerationJob,
        event: int | ScoredToken | JobEnd,
        text: CompletionText,
        chunk: Callable[[str], None],
    ) -> JobEnd | None:
        """Send the job's tokens as chunks from ``event`` on; its JobEnd, or None when a stop
        string ended it (the job is cancelled; the text before the stop string is
        ``text.stopped_text``)."""
        with_tokens = text.reports_tokens
        while not isinstance(event, JobEnd):
            piece = text.add(event)
            if text.stopped:
                self.app.scheduler.cancel(job, "stop")
                return None
            if piece or with_tokens:
                chunk(piece)
            event = self._next_event(job)
        return event

    def _stream(self, job: GenerationJob, request: CompletionRequest) -> None:
        # Headers wait for the first event, so a request the queue rejects still gets its 503.
        event = self._next_event(job)
        if isinstance(event, JobEnd) and event.finish_reason in ("rejected", "error"):
            raise self._refusal(event)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.end_headers()
        builder = ResponseBuilder(request.kind, self.app.model_id)
        text = self._text(request)
        output = self._chat_output(request, streaming=True)

        def chunk(piece: str, finish_reason: str | None = None, detail: str | None = None) -> None:
            """One chunk with the ids and logprobs of the tokens since the last one; a chat
            answer's piece split first (nothing is sent from inside a tool call's text, as
            mlx_lm.server, unless the chunk reports its tokens)."""
            reasoning, tool_calls = "", None
            if output is not None:
                output.add(piece)
                if finish_reason is not None:
                    output.end(finish_reason)
                    finish_reason = output.finish_reason(finish_reason)
                elif not text.reports_tokens and output.in_tool_call:
                    return
                delta = output.take()
                if not (delta or finish_reason or text.reports_tokens):
                    return
                piece, reasoning, tool_calls = delta.content, delta.reasoning, delta.tool_calls
            ids = text.take_token_ids() if request.return_token_ids else None
            logprobs = text.take_logprobs() if request.logprobs else None
            self._write_event(
                builder.chunk(piece, finish_reason, detail, ids, logprobs, reasoning, tool_calls)
            )

        try:
            ended = self._stream_tokens(job, event, text, chunk)
            if ended is None:
                chunk(text.stopped_text, "stop")
            elif ended.finish_reason == "error":
                self._write_event(self._refusal(ended).body())
            else:
                chunk(text.finish(), ended.finish_reason, ended.detail)
            if request.include_usage and (ended is None or ended.finish_reason != "error"):
                self._write_event(
                    builder.usage_chunk(len(request.prompt), text.n_tokens, job.cached_tokens)
                )
            self._write_event("[DONE]")
        except OSError:  # a client that left, or stopped reading until the write timed out
            self.app.scheduler.cancel(job)
            raise


class ServingServer(ThreadingHTTPServer):
    """The worker's HTTP server: bound at once (a port clash shows before a long model load),
    listening only once :meth:`serve` gives it the app (until then connections are refused)."""

    daemon_threads = True
    # The listen backlog: socketserver's default of 5 reset connections of clients that
    # reconnected while the accepting thread waited for the CPU (20 clients, bench_budget).
    request_queue_size = 128
    app: ServingApp

    def __init__(self, host: str, port: int) -> None:
        super().__init__((host, port), ServingHandler, bind_and_activate=False)
        try:
            self.server_bind()
        except BaseException:
            self.server_close()
            raise

    def serve(self, app: ServingApp) -> None:
        """Start listening for ``app``; call :meth:`serve_forever` next."""
        self.app = app
        self.server_activate()


def make_server(host: str, port: int) -> ServingServer:
    """A server bound to ``host:port`` (0: any free port); not listening yet.

    Raises:
        OSError: The address is taken or cannot be bound.
    """
    return ServingServer(host, port)
