"""vqpool serve's admission through real processes: single-flight loads, failed loads and their
backoff, keep-alive from the last request's end, the API key, bad input that changes nothing,
SIGTERM under a running stream, and settings that refuse to start."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from daemon_harness import remove_tree, short_tmpdir, wait_until
from front_harness import FrontDoor
from vqpool.worker.testing.http_client import HttpReply, stream_events

LLAMA = "builtin:llama"
QWEN = "builtin:qwen3"
ERROR_FIELDS = {"message", "type", "param", "code"}
EXIT_TIMEOUT = 30.0
"""Seconds a ``vqpool serve`` that refuses its settings may take to exit (it exits at once)."""


def send(
    front: FrontDoor,
    method: str,
    path: str,
    body: bytes | None = None,
    headers: dict[str, str] | None = None,
) -> HttpReply:
    """One request with raw bytes and any headers; the reply, its body JSON when it is."""
    host, port = front.url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        response = conn.getresponse()
        raw = response.read()
    finally:
        conn.close()
    try:
        parsed: Any = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        parsed = raw.decode(errors="replace")
    return HttpReply(response.status, parsed, {k.lower(): v for k, v in response.getheaders()})


def completion_body(model: Any = LLAMA, **fields: Any) -> bytes:
    return json.dumps({"model": model, "prompt": "hello", "max_tokens": 4, **fields}).encode()


def assert_error(reply: HttpReply, status: int) -> dict[str, Any]:
    """``reply`` is a ``status`` refusal in the workers' JSON error shape; its error object."""
    assert reply.status == status, (reply.status, reply.body)
    assert isinstance(reply.body, dict) and set(reply.body) == {"error"}, reply.body
    error = reply.body["error"]
    assert set(error) == ERROR_FIELDS and error["code"] == status, error
    return error


def metric(front: FrontDoor, name: str, model: str) -> float:
    """The value of metric ``name`` for ``model`` on ``/metrics``."""
    text = front.get("/metrics").body
    match = re.search(rf'^{re.escape(name)}\{{model="{re.escape(model)}"\}} (\S+)$', text, re.M)
    assert match, f"{name} for {model} not in /metrics"
    return float(match.group(1))


def serve_refused(*args: str, config: str | None = None) -> tuple[int, str, Path]:
    """Run ``vqpool serve`` that should refuse to start: its exit status, its stderr and the
    run directory it was given."""
    base = short_tmpdir("vqr")
    try:
        run_dir = base / "run"
        argv = [sys.executable, "-m", "vqpool.daemon.front", "serve", "--run-dir", str(run_dir)]
        if config is not None:
            (base / "vqpool.toml").write_text(config)
            argv += ["--config", str(base / "vqpool.toml")]
        env = {k: v for k, v in os.environ.items() if k != "VQPOOL_API_KEY"}
        done = subprocess.run(
            [*argv, "--port", "0", *args],
            capture_output=True,
            text=True,
            timeout=EXIT_TIMEOUT,
            env=env,
        )
        return done.returncode, done.stderr, run_dir
    finally:
        remove_tree(base)


# -- single flight --------------------------------------------------------------------------------


def test_twenty_concurrent_first_requests_start_one_worker():
    with FrontDoor("--model", LLAMA) as front:
        assert front.row(LLAMA)["state"] == "not_loaded"
        start = threading.Barrier(20)

        def first_request(_: int) -> HttpReply:
            start.wait()
            return front.complete(LLAMA)

        with ThreadPoolExecutor(20) as pool:
            replies = list(pool.map(first_request, range(20)))

        assert [r.status for r in replies] == [200] * 20, [r.body for r in replies]
        row = front.row(LLAMA)
        assert row["state"] == "loaded" and row["loads"] == 1, row
        assert len(front.sessions_of(LLAMA)) == 1
        # The premise held: every one of them waited for the load, none found it loaded.
        assert metric(front, "vqpool_front_queue_wait_seconds_count", LLAMA) == 20


# -- failed loads ---------------------------------------------------------------------------------

BROKEN = """
[models."broken"]
path = "builtin:nope"
"""
BROKEN_REASON = "unknown built-in model 'builtin:nope'"


def test_a_failed_load_answers_every_waiter_then_retries_with_backoff():
    with FrontDoor(config=BROKEN) as front:
        start = threading.Barrier(5)

        def first_request(_: int) -> HttpReply:
            start.wait()
            return front.complete("broken")

        with ThreadPoolExecutor(5) as pool:
            replies = list(pool.map(first_request, range(5)))
        for reply in replies:
            error = assert_error(reply, 502)
            assert "the worker of broken exited with status 2" in error["message"], error
            assert BROKEN_REASON in error["message"], error
        row = front.row("broken")
        # One load answered them all, and no other started for the requests it answered.
        assert row["state"] == "not_loaded" and row["load_failures"] == 1, row
        assert BROKEN_REASON in row["last_error"]

        # Each try once the backoff has passed starts a new load, until the backoff is long
        # enough (2 s from the third failure on) to ask within it.
        while front.row("broken")["load_failures"] < 3:
            wait_until(lambda: front.row("broken")["retry_in_s"] is None, 10)
            failures = front.row("broken")["load_failures"]
            assert_error(front.complete("broken"), 502)
            assert front.row("broken")["load_failures"] == failures + 1

        row = front.row("broken")
        assert row["retry_in_s"] is not None and row["retry_in_s"] > 0, row
        refused = front.complete("broken")
        error = assert_error(refused, 502)
        assert BROKEN_REASON in error["message"] and "keep failing" in error["message"], error
        assert int(refused.headers["retry-after"]) >= 1
        assert front.row("broken")["load_failures"] == row["load_failures"]
        assert front.sessions_of("broken") == []


# -- keep-alive -----------------------------------------------------------------------------------


def test_keep_alive_counts_from_the_last_request_end():
    keep_alive = 1.5
    with FrontDoor("--model", LLAMA, "--keep-alive", f"{keep_alive:g}s") as front:
        assert front.complete(LLAMA).status == 200
        first_end = front.row(LLAMA)["last_used"]
        # A second request a third into the first one's keep-alive, still on the same load.
        wait_until(lambda: (front.row(LLAMA)["idle_s"] or 0.0) >= keep_alive / 3, 10)
        assert front.complete(LLAMA).status == 200
        row = front.wait_state(LLAMA, "not_loaded", timeout=30)

        assert row["loads"] == 1 and row["unloads"] == {"idle": 1}, row
        assert row["last_used"] > first_end
        assert row["unloaded_at"] - row["last_used"] >= keep_alive, row
        assert front.sessions_of(LLAMA) == []


KEEP_ALIVE_MODELS = """
[models."llama"]
path = "builtin:llama"

[models."pinned"]
path = "builtin:llama"
pinned = true
keep_alive = 0
"""


def test_a_request_keep_alive_and_pinned_models():
    with FrontDoor(config=KEEP_ALIVE_MODELS) as front:
        # keep_alive -1: never unloaded (checked again after the cases below ran).
        assert front.complete("llama", keep_alive=-1).status == 200
        row = front.row("llama")
        assert row["state"] == "loaded" and row["keep_alive_s"] is None, row
        assert row["keep_alive_left_s"] is None

        # A bad keep_alive: 400 naming it, and no load.
        for bad in ("soon", True, [1]):
            error = assert_error(front.complete("pinned", keep_alive=bad), 400)
            assert error["param"] == "keep_alive" and "keep_alive" in error["message"], error
        row = front.row("pinned")
        assert row["state"] == "not_loaded" and row["loads"] == 0, row

        # Pinned with keep_alive 0 stays, its own or a request's: an unload would have started
        # before the answer was sent.
        for fields in ({}, {"keep_alive": 0}):
            assert front.complete("pinned", **fields).status == 200
            row = front.row("pinned")
            assert row["state"] == "loaded" and row["unloads"] == {}, row

        row = front.row("llama")
        assert row["state"] == "loaded" and row["loads"] == 1 and row["unloads"] == {}, row
        # keep_alive 0: the unload starts before the answer is sent.
        assert front.complete("llama", keep_alive=0).status == 200
        assert front.row("llama")["state"] in ("unloading", "not_loaded")
        row = front.wait_state("llama", "not_loaded")
        assert row["loads"] == 1 and row["unloads"] == {"idle": 1}, row


# -- API key --------------------------------------------------------------------------------------


def test_the_api_key_guards_every_route_but_health():
    with FrontDoor("--model", LLAMA, "--api-key", "sesame") as front:
        json_type = {"Content-Type": "application/json"}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sesame"}):
            refused = send(front, "POST", "/v1/completions", completion_body(), headers | json_type)
            assert assert_error(refused, 401)["type"] == "authentication_error"
            assert refused.headers["www-authenticate"] == "Bearer"
            assert_error(send(front, "GET", "/v1/models", headers=headers), 401)
        assert front.row(LLAMA)["loads"] == 0

        assert send(front, "GET", "/health").status == 200
        good = {"Authorization": "Bearer sesame"}
        assert send(front, "GET", "/v1/models", headers=good).status == 200
        reply = send(front, "POST", "/v1/completions", completion_body(), good | json_type)
        assert reply.status == 200, reply.body


def test_the_api_key_from_the_environment():
    with FrontDoor("--model", LLAMA, env={"VQPOOL_API_KEY": "from-env"}) as front:
        assert_error(send(front, "GET", "/v1/models"), 401)
        reply = send(front, "GET", "/v1/models", headers={"Authorization": "Bearer from-env"})
        assert reply.status == 200


def test_listening_beyond_loopback_needs_an_api_key():
    status, stderr, run_dir = serve_refused("--host", "0.0.0.0", "--model", LLAMA)
    assert status == 2, stderr
    assert stderr.count("\n") == 1 and "--api-key" in stderr, stderr
    assert not run_dir.exists()


# -- bad input ------------------------------------------------------------------------------------


def test_bad_requests_are_refused_and_change_nothing():
    with FrontDoor("--model", LLAMA, "--model", QWEN) as front:
        json_type = {"Content-Type": "application/json"}

        def post(body: bytes) -> HttpReply:
            return send(front, "POST", "/v1/completions", body, json_type)

        assert "not valid JSON" in assert_error(post(b'{"model": '), 400)["message"]
        assert "JSON object" in assert_error(post(b'["builtin:llama"]'), 400)["message"]
        assert assert_error(post(completion_body(model=7)), 400)["param"] == "model"
        unnamed = assert_error(post(json.dumps({"prompt": "x"}).encode()), 400)
        assert LLAMA in unnamed["message"] and QWEN in unnamed["message"], unnamed
        padding = "x" * (8 * 1024 * 1024)
        assert_error(post(completion_body(prompt=padding)), 413)
        assert assert_error(send(front, "GET", "/v1/nothing"), 404)["type"] == "not_found"
        wrong_method = send(front, "GET", "/v1/completions")
        assert assert_error(wrong_method, 405)["type"] == "method_not_allowed"
        assert "POST" in wrong_method.headers["allow"]

        rows = front.models()
        assert {name: row["state"] for name, row in rows.items()} == {
            LLAMA: "not_loaded",
            QWEN: "not_loaded",
        }
        assert all(row["loads"] == row["load_failures"] == 0 for row in rows.values()), rows
        assert front.complete(QWEN).status == 200


# -- stopping -------------------------------------------------------------------------------------


class OpenStream:
    """A long streamed completion read on a thread: its first chunk, how it ended."""

    def __init__(self, url: str, model: str) -> None:
        self.url = url
        self.model = model
        self.first_chunk = threading.Event()
        self.finish_reasons: list[str] = []
        self.errors: list[str] = []
        self.ending = ""
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        body = {"model": self.model, "prompt": "x", "max_tokens": 20000}
        try:
            for event in stream_events(self.url, "/v1/completions", body, timeout=60):
                self.first_chunk.set()
                if "error" in event:
                    self.errors.append(event["error"]["message"])
                    continue
                reason = event["choices"][0].get("finish_reason")
                if reason:
                    self.finish_reasons.append(reason)
            self.ending = "[DONE]"
        except Exception as exc:  # the connection may close under it
            self.ending = repr(exc)


def test_sigterm_under_a_running_stream_stops_everything_and_exits_0():
    with FrontDoor("--model", LLAMA) as front:
        # One vqpool serve per run directory: a second names the first and exits 1.
        second = subprocess.run(
            front.argv,
            capture_output=True,
            text=True,
            timeout=EXIT_TIMEOUT,
        )
        assert second.returncode == 1, second.stderr
        assert f"another vqpool serve already runs on {front.run_dir} (pid {front.pid})" in (
            second.stderr
        )

        stream = OpenStream(front.url, LLAMA)
        assert stream.first_chunk.wait(60), (stream.ending, front.log())
        assert front.row(LLAMA)["running"] == 1
        assert len(front.children()) >= 2  # the worker and the daemon

        assert front.stop(signal.SIGTERM) == 0
        stream.thread.join(EXIT_TIMEOUT)
        assert not stream.thread.is_alive(), "the stream hung after the front door stopped"
        # Ended by the stop, not run to its end. On SIGTERM the worker ends a running request
        # with an error event, "the worker is shutting down", then [DONE], which the front door
        # passes on; its handler threads are daemon threads, so the connection may close first.
        assert stream.finish_reasons == [], (stream.finish_reasons, stream.ending)
        assert stream.errors or stream.ending != "[DONE]", (stream.errors, stream.ending)
        assert all("shutting down" in e for e in stream.errors), stream.errors


# -- settings that refuse to start ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("config", "named"),
    [
        ('[models."a"]\npath = "builtin:llama"\ncolour = "red"\n', "colour"),
        ('[models."a"]\npath = "builtin:llama"\nkeep_alive = "soon"\n', "keep_alive"),
        (
            '[models."a"]\npath = "builtin:llama"\naliases = ["x"]\n'
            '[models."b"]\npath = "builtin:qwen3"\naliases = ["x"]\n',
            "alias 'x'",
        ),
        ("", "no model to serve"),
    ],
    ids=["unknown-key", "bad-keep-alive", "shared-alias", "no-model"],
)
def test_bad_settings_exit_2_with_one_line(config: str, named: str):
    status, stderr, run_dir = serve_refused(config=config)
    assert status == 2, stderr
    assert stderr.count("\n") == 1 and stderr.startswith("vqpool serve: "), stderr
    assert named in stderr, stderr
    assert not run_dir.exists()
