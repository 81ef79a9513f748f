"""CORS as mlx_lm.server's ``--allowed-origins``: on a worker and on the front door, every
response names the origin allowed (``*``, or the request's own when listed) and a preflight
``OPTIONS`` gets 204 with the headers; the front door answers preflight itself (no model load,
no API key)."""

from __future__ import annotations

import http.client
from urllib.parse import urlsplit

from front_harness import FrontDoor
from serving_harness import ServingStack

MODEL = "builtin:llama"
ALLOWED = "https://a.example,https://b.example"


def request(base_url: str, method: str, path: str, origin: str) -> http.client.HTTPResponse:
    url = urlsplit(base_url)
    conn = http.client.HTTPConnection(url.hostname or "", url.port, timeout=60)
    body = (
        b'{"model": "builtin:llama", "prompt": "hi", "max_tokens": 1}' if method == "POST" else None
    )
    conn.request(method, path, body=body, headers={"Origin": origin})
    response = conn.getresponse()
    response.read()
    conn.close()
    return response


def check_cors(base_url: str, *, listed_only: bool) -> None:
    """Preflight and real responses (a completion, a 404) carry mlx_lm.server's headers."""
    for method, path, status in (
        ("OPTIONS", "/v1/chat/completions", 204),
        ("POST", "/v1/completions", 200),
        ("GET", "/no/such/route", 404),
    ):
        listed = request(base_url, method, path, "https://b.example")
        assert listed.status == status
        assert listed.getheader("Access-Control-Allow-Methods") == "*"
        assert listed.getheader("Access-Control-Allow-Headers") == "*"
        other = request(base_url, method, path, "https://evil.example")
        if listed_only:
            assert listed.getheader("Access-Control-Allow-Origin") == "https://b.example"
            assert listed.getheader("Vary") == "Origin"
            assert other.getheader("Access-Control-Allow-Origin") is None
        else:
            assert listed.getheader("Access-Control-Allow-Origin") == "*"
            assert other.getheader("Access-Control-Allow-Origin") == "*"


def test_the_worker_sends_cors_headers() -> None:
    stack = ServingStack([MODEL]).start()
    try:
        check_cors(stack.url(MODEL), listed_only=False)
        listed = stack.start_worker(MODEL, ["--allowed-origins", ALLOWED], name="listed")
        try:
            check_cors(listed.url, listed_only=True)
        finally:
            listed.stop()
    finally:
        stack.stop()


def test_the_front_door_answers_preflight_and_sends_cors_headers() -> None:
    with FrontDoor("--model", MODEL, "--allowed-origins", ALLOWED, "--api-key", "k") as front:
        preflight = request(front.url, "OPTIONS", "/v1/completions", "https://a.example")
        assert preflight.status == 204  # no key needed
        assert preflight.getheader("Access-Control-Allow-Origin") == "https://a.example"
        assert front.row(MODEL)["state"] == "not_loaded"  # preflight loads nothing
    with FrontDoor("--model", MODEL) as front:
        check_cors(front.url, listed_only=False)
    with FrontDoor("--model", MODEL, "--allowed-origins", ALLOWED) as front:
        check_cors(front.url, listed_only=True)
