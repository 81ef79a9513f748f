"""The front door's OpenAI-style HTTP API: the workers' routes for every model, by ``model``.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (``/chat/completions`` too, as
the workers and mlx_lm.server), ``GET /v1/models`` (every served model and its state), ``GET
/health`` (never behind the API key), ``GET /metrics``. A request's ``model`` is resolved by
the catalog's one rule (name, alias, label); a request that names it otherwise than by its name
reaches the worker with the name, the only change made to a body. A request's own
``keep_alive`` (seconds or a duration; -1 never, 0 right after) replaces its model's for the
idle time after it.

Every refusal is a JSON error in the workers' shape. With an API key, every route but
``/health`` needs ``Authorization: Bearer KEY``. CORS as mlx_lm.server's ``--allowed-origins``:
every response carries its headers and a preflight ``OPTIONS`` (any path, no key: browsers send
none) is answered here with 204, never by a worker, so it loads no model.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
from aiohttp import web
from vqpool.daemon.front.catalog import Catalog, ModelEntry, parse_keep_alive
from vqpool.daemon.front.metrics import FrontMetrics
from vqpool.daemon.front.proxy import forward, upstream_session
from vqpool.daemon.front.supervisor import Supervisor
from vqpool.shared.api_error import ApiError

log = logging.getLogger("vqpool.serve")

MAX_BODY_BYTES = 8 * 1024 * 1024
"""The largest request body, as the workers'."""
COMPLETION_ROUTES = ("/v1/completions", "/v1/chat/completions", "/chat/completions")
CLIENT_CLOSED = 499
"""The status counted for a request whose client left before its answer (nginx's)."""
NAMES_SHOWN = 20
"""The most model names a 404 lists."""

SUPERVISOR = web.AppKey("supervisor", Supervisor)
CATALOG = web.AppKey("catalog", Catalog)
METRICS = web.AppKey("metrics", FrontMetrics)
SESSION = web.AppKey("session", aiohttp.ClientSession)
QUEUE_TIMEOUT = web.AppKey("queue_timeout", float)
BODY_TIMEOUT = web.AppKey("body_timeout", float)
WRITE_TIMEOUT = web.AppKey("write_timeout", float)
STARTED = web.AppKey("started", float)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def error_response(error: ApiError) -> web.Response:
    return web.json_response(error.body(), status=error.status, headers=error.headers)


@web.middleware
async def json_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every refusal, ours or aiohttp's (404, 405, 413), as a JSON error body."""
    try:
        return await handler(request)
    except ApiError as error:
        return error_response(error)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        kinds = {404: "not_found", 405: "method_not_allowed"}
        kind = kinds.get(exc.status, "invalid_request_error")
        text = exc.text if exc.status != 404 else f"no route {request.method} {request.path}"
        refusal = ApiError(exc.status, text or exc.reason, kind=kind)
        if exc.status == 405 and "Allow" in exc.headers:
            refusal.headers["Allow"] = exc.headers["Allow"]
        return error_response(refusal)


@web.middleware
async def preflight(request: web.Request, handler: Handler) -> web.StreamResponse:
    """A CORS preflight, answered before any other check (:func:`cors_headers` adds the rest)."""
    if request.method == "OPTIONS":
        return web.Response(status=204, content_type="application/json")
    return await handler(request)


def cors_headers(
    allowed_origins: tuple[str, ...],
) -> Callable[[web.Request, web.StreamResponse], Awaitable[None]]:
    """Adds mlx_lm.server's CORS headers to every response before it is sent (a stream too)."""

    async def add(request: web.Request, response: web.StreamResponse) -> None:
        origin = request.headers.get("Origin")
        if "*" in allowed_origins:
            response.headers["Access-Control-Allow-Origin"] = "*"
        elif origin in allowed_origins:
            response.headers["Access-Control-Allow-Origin"] = origin
            response.headers["Vary"] = "Origin"
        response.headers["Access-Control-Allow-Methods"] = "*"
        response.headers["Access-Control-Allow-Headers"] = "*"

    return add


def api_key_check(api_key: str) -> Callable[..., Awaitable[web.StreamResponse]]:
    expected = f"Bearer {api_key}".encode()

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path != "/health":
            given = request.headers.get("Authorization", "").encode()
            if not hmac.compare_digest(given, expected):
                raise ApiError(
                    401,
                    "missing or wrong API key: send Authorization: Bearer KEY",
                    kind="authentication_error",
                    headers={"WWW-Authenticate": "Bearer"},
                )
        return await handler(request)

    return check


async def _read_body(request: web.Request) -> dict[str, Any]:
    deadline = request.app[BODY_TIMEOUT]
    try:
        async with asyncio.timeout(deadline):
            raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise ApiError(413, f"the body is larger than {MAX_BODY_BYTES} bytes") from None
    except TimeoutError:
        raise ApiError(
            408, f"the body did not arrive within {deadline:g} s", kind="timeout"
        ) from None
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"the body is not valid JSON: {exc}") from None
    except RecursionError:
        raise ApiError(400, "the body's JSON nests too deeply") from None
    except ValueError:
        raise ApiError(
            400, f"the body's JSON has a number of more than {sys.get_int_max_str_digits()} digits"
        ) from None
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
    return body


def _model_of(body: dict[str, Any], catalog: Catalog) -> ModelEntry:
    given = body.get("model")
    if given is None:
        if len(catalog.entries) == 1:
            return next(iter(catalog.entries.values()))
        raise ApiError(400, f"name a model: one of {_names(catalog)}", param="model")
    if not isinstance(given, str):
        raise ApiError(400, "model must be a string", param="model")
    return served_model(catalog, given)


def served_model(catalog: Catalog, given: str) -> ModelEntry:
    """The model ``given`` names (the catalog's one rule).

    Raises:
        ApiError: 400 when it is the label of several models, 404 when it names none.
    """
    try:
        entry = catalog.resolve(given)
    except ValueError as exc:
        raise ApiError(400, str(exc), param="model") from None
    if entry is None:
        raise ApiError(
            404,
            f"model {given[:200]!r} is not served here; served: {_names(catalog)}",
            kind="not_found",
            param="model",
        )
    return entry


def _names(catalog: Catalog) -> str:
    names = catalog.names
    shown = ", ".join(names[:NAMES_SHOWN])
    return shown + (f" and {len(names) - NAMES_SHOWN} more" if len(names) > NAMES_SHOWN else "")


async def completion(request: web.Request) -> web.StreamResponse:
    app = request.app
    body = await _read_body(request)
    entry = _model_of(body, app[CATALOG])
    keep_alive = None
    if "keep_alive" in body:
        try:
            keep_alive = parse_keep_alive(body["keep_alive"])
        except ValueError as exc:
            raise ApiError(400, str(exc), param="keep_alive") from None
    if body.get("model") != entry.name:
        body["model"] = entry.name
        data = json.dumps(body).encode()
    else:
        data = await request.read()  # the client's bytes, as sent
    supervisor = app[SUPERVISOR]
    slot = supervisor.slots[entry.name]
    status = 500
    try:
        async with supervisor.lease(slot, keep_alive, app[QUEUE_TIMEOUT]) as (worker, waited):
            response = await forward(
                request,
                app[SESSION],
                supervisor,
                worker,
                data,
                app[WRITE_TIMEOUT],
                waited.headers(),
            )
            status = response.status
            return response
    except ApiError as error:
        status = error.status
        raise
    except asyncio.CancelledError:  # the client left
        status = CLIENT_CLOSED
        raise
    finally:
        app[METRICS].request(entry.name, status)


async def models(request: web.Request) -> web.Response:
    data = []
    for view in request.app[SUPERVISOR].views():
        data.append(
            {
                "id": view["name"],
                "object": "model",
                "created": int(view["loaded_at"] or request.app[STARTED]),
                "owned_by": "vqpool",
                **{k: view[k] for k in ("aliases", "state", "idle_s", "keep_alive_left_s")},
            }
        )
    return web.json_response({"object": "list", "data": data})


async def health(request: web.Request) -> web.Response:
    states = {v["name"]: v["state"] for v in request.app[SUPERVISOR].views()}
    return web.json_response({"status": "ok", "models": states})


async def metrics_text(request: web.Request) -> web.Response:
    return web.Response(
        body=request.app[METRICS].exposition(),
        content_type="text/plain",
        charset="utf-8",
    )


def build_public_app(
    supervisor: Supervisor,
    catalog: Catalog,
    metrics: FrontMetrics,
    *,
    queue_timeout: float,
    api_key: str | None,
    body_timeout: float,
    write_timeout: float,
    allowed_origins: tuple[str, ...] = ("*",),
) -> web.Application:
    middlewares: list[Any] = [preflight, json_errors]
    if api_key:
        middlewares.append(api_key_check(api_key))
    app = web.Application(middlewares=middlewares, client_max_size=MAX_BODY_BYTES)
    app[SUPERVISOR] = supervisor
    app[CATALOG] = catalog
    app[METRICS] = metrics
    app[QUEUE_TIMEOUT] = queue_timeout
    app[BODY_TIMEOUT] = body_timeout
    app[WRITE_TIMEOUT] = write_timeout
    app[STARTED] = time.time()
    for path in COMPLETION_ROUTES:
        app.router.add_post(path, completion)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics_text)

    async def session_context(app: web.Application) -> Any:
        app[SESSION] = upstream_session()
        yield
        await app[SESSION].close()

    app.cleanup_ctx.append(session_context)
    app.on_response_prepare.append(cors_headers(allowed_origins))
    return app
