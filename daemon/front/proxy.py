"""Pass one completion request to its model's worker and the worker's answer back, unchanged.

A streamed answer (server-sent events) is written on as each piece arrives, never buffered. A
client that leaves cancels the handler (the server runs with handler cancellation), which
closes the upstream connection: the worker sees its client gone, cancels the request and its
blocks go back. A worker that dies mid-request is named in a 502 (or, once a stream has
started, in a last error event). A client that takes none of its answer for ``write_timeout``
seconds is cut off the same way (client_limits.py says why).
"""

from __future__ import annotations

import asyncio
import json
import logging

import aiohttp
from aiohttp import web
from vqpool.daemon.front.errors import bad_gateway
from vqpool.daemon.front.supervisor import Supervisor
from vqpool.daemon.front.worker_process import WorkerProcess

log = logging.getLogger("vqpool.serve")

STREAM_END = b"data: [DONE]"
"""How every whole stream of a worker ends: its streams end at the connection's close (no
length, no chunks), so one that ends otherwise was cut (the worker died)."""
PASSED_HEADERS = ("Content-Type", "Cache-Control", "Retry-After", "Allow")
"""The worker's response headers a client sees (the rest describe the worker's connection)."""
EVENT_STREAM = "text/event-stream"


def upstream_session() -> aiohttp.ClientSession:
    """The one client session to every worker: no connection cap of its own (the worker
    bounds its queue), no read deadline (a long completion streams for minutes)."""
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10.0, sock_read=None)
    return aiohttp.ClientSession(connector=connector, timeout=timeout, auto_decompress=False)


async def forward(
    request: web.Request,
    session: aiohttp.ClientSession,
    supervisor: Supervisor,
    worker: WorkerProcess,
    body: bytes,
    write_timeout: float,
    extra_headers: dict[str, str] | None = None,
) -> web.StreamResponse:
    """Send ``body`` to ``worker`` on the request's path; its answer as the response, with
    ``extra_headers`` (the front door's own: what the request waited for its model)."""
    headers = {"Content-Type": "application/json"}
    if "Accept" in request.headers:
        headers["Accept"] = request.headers["Accept"]
    try:
        upstream = await session.post(worker.url + request.path, data=body, headers=headers)
    except aiohttp.ClientError as exc:
        raise bad_gateway(await supervisor.exit_reason(worker, exc)) from None
    try:
        passed = {h: upstream.headers[h] for h in PASSED_HEADERS if h in upstream.headers}
        passed.update(extra_headers or {})
        if upstream.content_type != EVENT_STREAM:
            try:
                data = await upstream.read()
            except aiohttp.ClientError as exc:
                raise bad_gateway(await supervisor.exit_reason(worker, exc)) from None
            response = web.StreamResponse(status=upstream.status, headers=passed)
            response.content_length = len(data)
            await response.prepare(request)
            await _send(request, response, data, write_timeout, eof=True)
            return response
        response = web.StreamResponse(status=upstream.status, headers=passed)
        await response.prepare(request)
        tail = b""
        try:
            async for piece in upstream.content.iter_any():
                await _send(request, response, piece, write_timeout)
                tail = (tail + piece)[-64:]
            if not tail.rstrip().endswith(STREAM_END):
                raise aiohttp.ClientPayloadError("the stream ended before its [DONE]")
        except aiohttp.ClientError as exc:
            reason = await supervisor.exit_reason(worker, exc)
            error = bad_gateway(reason).body()
            await _send(request, response, f"data: {json.dumps(error)}\n\n".encode(), write_timeout)
        await _send(request, response, b"", write_timeout, eof=True)
        return response
    except ClientGone:
        return response  # its connection is closed: aiohttp sends nothing more
    finally:
        # Closing, not releasing: a request the client left must end at the worker too.
        upstream.close()


class ClientGone(Exception):
    """The client left, or took none of its answer for the write timeout: its connection is
    closed, nothing more can be sent."""


async def _send(
    request: web.Request,
    response: web.StreamResponse,
    data: bytes,
    timeout: float,
    *,
    eof: bool = False,
) -> None:
    """Write ``data`` (and end the answer when ``eof``); a client that takes none of it for
    ``timeout`` seconds has its connection closed (its buffered answer dropped) and
    :class:`ClientGone` is raised, as for a client that left."""
    try:
        async with asyncio.timeout(timeout):
            if eof:
                await response.write_eof(data)
            else:
                await response.write(data)
    except TimeoutError:
        log.warning(
            "%s %s: the client took no data for %g s: cut off",
            request.method,
            request.path,
            timeout,
        )
        if request.transport is not None:
            request.transport.abort()
        raise ClientGone from None
    except ConnectionResetError:  # the client left while its answer was written
        raise ClientGone from None
