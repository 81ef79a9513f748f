"""An evicted worker lives on: it opens a new pool session by itself, the requests that were
running on the freed blocks fail cleanly, and new requests are served."""

from __future__ import annotations

from daemon_harness import wait_until
from serving_harness import ServingStack
from vqpool.shared.protocol import session_label
from vqpool.worker.testing.http_client import request_json, stream_events

LLAMA = "builtin:llama"


def test_an_evicted_worker_reopens_its_session_and_fails_only_the_running_requests() -> None:
    stack = ServingStack([LLAMA]).start()
    try:
        url = stack.url(LLAMA)
        evicted = request_json(url, "GET", "/health").body["session"]
        events = stream_events(url, "/v1/completions", {"prompt": "evict me", "max_tokens": 3000})
        for _ in range(3):
            next(events)
        stack.daemon.admin("evict_session", sid=int(evicted, 16))  # /health shows it in hex
        # The running request ends with an error event (its blocks were freed), not a hang.
        rest = list(events)
        assert "error" in rest[-1], rest[-1]
        assert "evicted" in rest[-1]["error"]["message"]

        def new_session() -> bool:
            health = request_json(url, "GET", "/health")
            return health.status == 200 and health.body["session"] not in (evicted, None)

        wait_until(new_session, timeout=10)
        assert [session_label(s["sid"]) for s in stack.daemon.admin("sessions")] == [
            request_json(url, "GET", "/health").body["session"]
        ]
        reply = stack.complete(LLAMA, {"prompt": "after the eviction", "max_tokens": 20})
        assert reply.status == 200, reply
        assert reply.body["usage"]["completion_tokens"] == 20
        assert stack.worker_stats(LLAMA)["ended_error"] == 1
        stack.wait_for_no_blocks()
    finally:
        stack.stop()
