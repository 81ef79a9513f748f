"""The front door's control socket, ``front.sock`` in the run directory (owner only): what
``vqpoolctl ps``, ``load`` and ``unload`` ask.

Routes (JSON): ``GET /models`` (the front door's pid and URL, and every model's row),
``POST /load`` ``{"model": NAME, "timeout": S}`` (load it as a request would and wait),
``POST /unload`` ``{"model": NAME, "timeout": S}`` (unload it as soon as its requests end;
waits at most ``timeout`` for that), ``POST /drop-disk`` ``{"model": NAME}`` (remove the
entry files of the prompt cache's disk tier of a model that is not loaded: no worker writes them;
a loaded model's worker drops its own when vqpoold tells it, 409 here). Names resolve as in the
public API.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

from aiohttp import web
from vqpool.daemon.front.catalog import Catalog
from vqpool.daemon.front.model_slot import ModelSlot
from vqpool.daemon.front.public_api import json_errors, served_model
from vqpool.daemon.front.supervisor import Supervisor
from vqpool.shared.api_error import ApiError
from vqpool.shared.kv_disk import kv_disk_directory, remove_entry_files

MAX_CONTROL_BODY = 64 * 1024
MAX_WAIT = 3600.0
"""The longest a control request waits for a load or an unload."""

SUPERVISOR = web.AppKey("supervisor", Supervisor)
CATALOG = web.AppKey("catalog", Catalog)
FRONT = web.AppKey("front", dict[str, Any])


async def _target(request: web.Request) -> tuple[ModelSlot, float]:
    try:
        body = json.loads(await request.read())
    except ValueError:
        raise ApiError(400, "the body is not valid JSON") from None
    if not isinstance(body, dict) or not isinstance(body.get("model"), str):
        raise ApiError(400, 'the body must be {"model": NAME, "timeout": SECONDS}')
    timeout = body.get("timeout", 60.0)
    if (
        isinstance(timeout, bool)
        or not isinstance(timeout, int | float)
        or not (0 <= timeout <= MAX_WAIT)
    ):
        raise ApiError(400, f"timeout must be 0..{MAX_WAIT:g} seconds", param="timeout")
    entry = served_model(request.app[CATALOG], body["model"])
    return request.app[SUPERVISOR].slots[entry.name], float(timeout)


def _row(slot: ModelSlot) -> dict[str, Any]:
    return slot.view(asyncio.get_running_loop().time())


async def models(request: web.Request) -> web.Response:
    supervisor = request.app[SUPERVISOR]
    max_loaded = supervisor.max_loaded
    front: dict[str, Any] = request.app[FRONT]
    return web.json_response(
        {
            **front,
            "max_loaded": max_loaded,
            "models": supervisor.views(),
        }
    )


async def load(request: web.Request) -> web.Response:
    slot, timeout = await _target(request)
    await request.app[SUPERVISOR].load(slot, timeout)
    return web.json_response(_row(slot))


async def unload(request: web.Request) -> web.Response:
    slot, timeout = await _target(request)
    done = await request.app[SUPERVISOR].unload(slot, timeout)
    return web.json_response({**_row(slot), "unloaded": done})


async def drop_disk(request: web.Request) -> web.Response:
    slot, _ = await _target(request)
    if slot.worker is not None:
        raise ApiError(
            409,
            f"{slot.name} is {slot.state}: its worker holds its disk tier; "
            "`vqpoolctl cache drop --disk` asks it through vqpoold",
            kind="conflict",
            param="model",
        )
    # No await from the checks to the last removal: no load starts in between.
    supervisor = request.app[SUPERVISOR]
    directory = _disk_directory(supervisor, slot)
    sharing = [
        other.name
        for other in supervisor.slots.values()
        if other.worker is not None and _disk_directory(supervisor, other) == directory
    ]
    if sharing:
        raise ApiError(
            409,
            f"{directory} is also the disk tier of {', '.join(sharing)}, whose worker runs",
            kind="conflict",
            param="model",
        )
    entries, n_bytes = remove_entry_files(directory)
    return web.json_response(
        {"model": slot.name, "directory": str(directory), "entries": entries, "bytes": n_bytes}
    )


def _disk_directory(supervisor: Supervisor, slot: ModelSlot) -> Path:
    entry = slot.entry
    return kv_disk_directory(supervisor.run_dir, entry.name, entry.worker_option("--kv-disk-dir"))


def build_control_app(supervisor: Supervisor, catalog: Catalog, url: str) -> web.Application:
    app = web.Application(middlewares=[json_errors], client_max_size=MAX_CONTROL_BODY)
    app[SUPERVISOR] = supervisor
    app[CATALOG] = catalog
    app[FRONT] = {"pid": os.getpid(), "url": url}
    app.router.add_get("/models", models)
    app.router.add_post("/load", load)
    app.router.add_post("/unload", unload)
    app.router.add_post("/drop-disk", drop_disk)
    return app
