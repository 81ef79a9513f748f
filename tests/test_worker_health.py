"""A worker's /health tells the truth while its daemon is gone: 503 ``no_session`` from soon
after vqpoold dies until the restarted daemon has its session back, then 200 and requests are
served again."""

from __future__ import annotations

import signal

from daemon_harness import wait_until
from serving_harness import ServingStack
from vqpool.worker.testing.http_client import request_json

LLAMA = "builtin:llama"


def test_health_says_no_session_while_the_daemon_is_gone_and_ok_once_it_is_back() -> None:
    stack = ServingStack([LLAMA]).start()  # lease 1 s: the worker pings every 0.25 s
    try:
        url = stack.url(LLAMA)
        before = request_json(url, "GET", "/health")
        assert (before.status, before.body["status"]) == (200, "ok")
        stack.daemon.stop(signal.SIGKILL)

        def no_session() -> bool:
            health = request_json(url, "GET", "/health")
            return health.status == 503 and health.body["status"] == "no_session"

        wait_until(no_session, timeout=5)
        health = request_json(url, "GET", "/health").body
        assert "vqpoold" in health["pool_error"] and health["model"] == LLAMA
        assert no_session()  # stays so while nothing answers
        stack.daemon.start()

        def back() -> bool:
            health = request_json(url, "GET", "/health")
            return health.status == 200 and health.body["session"] != before.body["session"]

        wait_until(back, timeout=10)
        assert request_json(url, "GET", "/health").body["status"] == "ok"
        reply = stack.complete(LLAMA, {"prompt": "after the restart", "max_tokens": 8})
        assert reply.status == 200, reply
        stack.wait_for_no_blocks()
    finally:
        stack.stop()
