"""A small standard-library client for the worker's HTTP API (demo, benchmark, tests).

Any OpenAI client works against the worker; this one exists so that vqpool's own scripts need
no extra dependency, and so they see status codes, headers and raw server-sent events.
"""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit


@dataclass
class HttpReply:
    """A complete reply: status, headers (lower-case names) and the body (JSON when it is)."""

    status: int
    body: Any
    headers: dict[str, str] = field(default_factory=dict)


class HttpStatusError(Exception):
    """A streaming request answered with another status than 200."""

    def __init__(self, reply: HttpReply) -> None:
        super().__init__(f"HTTP {reply.status}: {reply.body}")
        self.reply = reply


def _connect(url: str, timeout: float) -> http.client.HTTPConnection:
    parts = urlsplit(url)
    return http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port, timeout=timeout)


def _reply(response: http.client.HTTPResponse) -> HttpReply:
    raw = response.read()
    try:
        body: Any = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        body = raw.decode(errors="replace")
    headers = {k.lower(): v for k, v in response.getheaders()}
    return HttpReply(response.status, body, headers)


def request_json(
    base_url: str, method: str, path: str, body: Any = None, timeout: float = 120.0
) -> HttpReply:
    """One request with a JSON body (or none); the reply, whatever its status."""
    conn = _connect(base_url, timeout)
    try:
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"} if data is not None else {}
        conn.request(method, path, body=data, headers=headers)
        return _reply(conn.getresponse())
    finally:
        conn.close()


def stream_events(
    base_url: str,
    path: str,
    body: dict[str, Any],
    timeout: float = 120.0,
    headers_out: dict[str, str] | None = None,
) -> Iterator[dict[str, Any]]:
    """POST a ``stream: true`` request and yield each server-sent event's JSON until [DONE].

    Closing the iterator early closes the connection (the worker then cancels the request).
    ``headers_out``, when given, receives the response's headers (lower-case names) before
    the first event.

    Raises:
        HttpStatusError: The worker answered with another status than 200.
    """
    conn = _connect(base_url, timeout)
    try:
        conn.request(
            "POST",
            path,
            body=json.dumps({**body, "stream": True}).encode(),
            headers={"Content-Type": "application/json"},
        )
        response = conn.getresponse()
        if response.status != 200:
            raise HttpStatusError(_reply(response))
        if headers_out is not None:
            headers_out.update((k.lower(), v) for k, v in response.getheaders())
        for line in response:
            if not line.startswith(b"data: "):
                continue
            payload = line[6:].strip()
            if payload == b"[DONE]":
                return
            yield json.loads(payload)
    finally:
        conn.close()
