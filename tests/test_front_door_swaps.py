"""vqpool serve through real processes, on what users of model swappers complain about most: an
unload that cuts a running request, a client that leaves while its generation goes on, a
crashed worker, concurrent first requests that load too much, a killed front door that leaves
its workers behind, an operator's unload of a busy model.

Each premise is made to hold, never slept for: a request is held open by reading the first
chunk of a long stream, and states are waited for on the control socket's rows.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import threading
from collections.abc import Generator, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psutil
import pytest
from daemon_harness import remove_tree, short_tmpdir, wait_until
from front_harness import FrontDoor, paths_for
from vqpool.worker.testing.http_client import request_json, stream_events
from vqpool.worker.testing.model_dirs import write_model_dir

LLAMA = "builtin:llama"
QWEN = "builtin:qwen3"
FULL_STREAM_TOKENS = 1500
"""A stream read to its end: seconds of generation, long enough to look at the rows meanwhile."""
ENDLESS_TOKENS = 20000
"""A stream the test cuts (a disconnect, a kill) long before it could end."""
SIGKILL_REASON = f"killed by signal {int(signal.SIGKILL)}"


Stream = tuple[dict[str, Any], Generator[dict[str, Any], None, None]]
"""A stream's first event, read, and the rest, to read."""


def open_stream(front: FrontDoor, model: str, max_tokens: int, **fields: Any) -> Stream:
    """A stream of ``model`` whose first chunk is read: the request runs at the worker.
    ``fields``: more of the request's body."""
    body = {
        "model": model,
        "prompt": "a long answer, please: ",
        "max_tokens": max_tokens,
        "return_token_ids": True,
        "stream_options": {"include_usage": True},
        **fields,
    }
    events = stream_events(front.url, "/v1/completions", body)
    assert isinstance(events, Generator)  # closing it closes the connection
    first = next(events)
    assert first["choices"][0]["finish_reason"] is None, first
    return first, events


def read_to_end(stream: Stream) -> dict[str, Any]:
    """A whole stream: its tokens counted, its finish reason, its usage, its errors."""
    first, rest = stream
    tokens, finish_reason, usage, errors = 0, None, None, []
    for event in itertools.chain([first], rest):
        if "error" in event:
            errors.append(event["error"])
        elif event["choices"]:
            choice = event["choices"][0]
            tokens += len(choice.get("token_ids") or [])
            finish_reason = choice["finish_reason"] or finish_reason
        else:
            usage = event["usage"]
    return {"tokens": tokens, "finish_reason": finish_reason, "usage": usage, "errors": errors}


def worker_stats(front: FrontDoor, model: str) -> dict[str, Any]:
    reply = request_json(front.row(model)["url"], "GET", "/v1/stats", timeout=10)
    assert reply.status == 200, reply.body
    stats: dict[str, Any] = reply.body
    return stats


def gone(pid: int) -> bool:
    """Whether process ``pid`` has exited (a zombie nobody reaped counts as exited)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_an_unload_for_room_waits_for_the_running_stream_and_the_burst_queues() -> None:
    with FrontDoor("--max-loaded", "1", *paths_for([LLAMA, QWEN])) as front:
        stream = open_stream(front, LLAMA, FULL_STREAM_TOKENS)
        burst_size = 4
        with ThreadPoolExecutor(burst_size) as pool:
            burst = [pool.submit(front.complete, QWEN, 4) for _ in range(burst_size)]
            wait_until(lambda: front.row(QWEN)["queued"] == burst_size, timeout=20)
            rows = front.models()
            assert rows[QWEN]["state"] == "not_loaded"
            assert rows[LLAMA]["state"] == "loaded" and rows[LLAMA]["running"] == 1
            ended = read_to_end(stream)
            replies = [future.result(timeout=60) for future in burst]
        assert ended["errors"] == [] and ended["finish_reason"] == "length"
        assert ended["tokens"] == ended["usage"]["completion_tokens"] == FULL_STREAM_TOKENS
        assert [r.status for r in replies] == [200] * burst_size, [r.body for r in replies]
        rows = front.models()
        assert rows[LLAMA]["state"] == "not_loaded" and rows[LLAMA]["unloads"] == {"room": 1}
        assert rows[QWEN]["state"] == "loaded" and rows[QWEN]["loads"] == 1


CANCEL_CONFIG = f"""
[models."{LLAMA}"]
path = "{LLAMA}"
prompt_cache_bytes = 0
"""


def test_a_client_that_leaves_cancels_the_generation_and_its_blocks_go_back() -> None:
    # No prompt cache: an ended request's blocks would otherwise stay with the worker.
    with FrontDoor(config=CANCEL_CONFIG) as front:
        _, events = open_stream(front, LLAMA, ENDLESS_TOKENS)
        wait_until(lambda: front.sessions_of(LLAMA)[0]["n_blocks"] > 0, timeout=10)
        assert front.row(LLAMA)["running"] == 1
        events.close()  # closes the client's connection mid-stream
        wait_until(lambda: front.sessions_of(LLAMA)[0]["n_blocks"] == 0, timeout=15)
        wait_until(lambda: front.row(LLAMA)["running"] == 0, timeout=5)
        stats = worker_stats(front, LLAMA)
        assert stats["ended_cancelled"] == 1 and stats["ended_length"] == 0
        assert stats["completion_tokens"] < ENDLESS_TOKENS
        assert stats["active"] == 0
        assert front.complete(LLAMA).status == 200


def test_a_killed_worker_fails_its_requests_by_name_and_a_crash_loop_backs_off() -> None:
    with FrontDoor(*paths_for([LLAMA])) as front:
        stream = open_stream(front, LLAMA, ENDLESS_TOKENS)
        first_pid = front.row(LLAMA)["pid"]
        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(front.complete, LLAMA, ENDLESS_TOKENS)
            wait_until(lambda: worker_stats(front, LLAMA)["active"] == 2, timeout=20)
            os.kill(first_pid, signal.SIGKILL)
            cut = read_to_end(stream)
            plain = waiting.result(timeout=30)
        assert len(cut["errors"]) == 1 and cut["finish_reason"] is None
        assert SIGKILL_REASON in cut["errors"][0]["message"], cut["errors"]
        assert plain.status == 502 and SIGKILL_REASON in plain.body["error"]["message"]
        row = front.wait_state(LLAMA, "not_loaded")
        assert row["crashes"] == 1 and row["running"] == 0 and row["pid"] is None
        assert row["retry_in_s"] is None  # one crash: no backoff yet

        assert front.complete(LLAMA).status == 200
        row = front.row(LLAMA)
        assert row["loads"] == 2 and row["pid"] not in (None, first_pid)

        # A crash loop: killed right after each load, twice more.
        os.kill(row["pid"], signal.SIGKILL)
        wait_until(lambda: front.row(LLAMA)["crashes"] == 2, timeout=10)
        wait_until(lambda: front.row(LLAMA)["retry_in_s"] is None, timeout=10)
        reloaded = front.control(timeout=60).load(LLAMA, 60)
        assert reloaded["state"] == "loaded" and reloaded["loads"] == 3
        os.kill(reloaded["pid"], signal.SIGKILL)
        wait_until(lambda: front.row(LLAMA)["crashes"] == 3, timeout=10)
        row = front.row(LLAMA)
        refused = front.complete(LLAMA)
        assert row["state"] == "not_loaded" and row["retry_in_s"] is not None
        assert SIGKILL_REASON in row["last_error"]
        assert refused.status == 502, refused.body
        assert int(refused.headers["retry-after"]) >= 1
        assert SIGKILL_REASON in refused.body["error"]["message"]
        assert front.row(LLAMA)["loads"] == 3  # the refused request started no load


@pytest.fixture
def third_model() -> Iterator[str]:
    base = short_tmpdir("vqm")
    yield str(write_model_dir(base / "third", "llama", seed=3))
    remove_tree(base)


def test_concurrent_first_requests_for_three_models_never_load_more_than_two(
    third_model: str,
) -> None:
    models = [LLAMA, QWEN, third_model]
    with FrontDoor("--max-loaded", "2", *paths_for(models)) as front:
        samples: list[tuple[dict[str, str], list[str]]] = []
        done = threading.Event()

        def sample() -> None:
            while not done.is_set():
                states = {name: row["state"] for name, row in front.models().items()}
                sessions = [s["model"] for s in front.admin("sessions")]
                samples.append((states, sessions))

        per_model = 2
        sampler = threading.Thread(target=sample)
        sampler.start()
        try:
            with ThreadPoolExecutor(len(models) * per_model) as pool:
                futures = [pool.submit(front.complete, m, 4) for m in models * per_model]
                replies = [future.result(timeout=90) for future in futures]
        finally:
            done.set()
            sampler.join()
        assert [r.status for r in replies] == [200] * len(replies), [r.body for r in replies]
        assert len(samples) > 10
        for states, sessions in samples:
            assert sum(state != "not_loaded" for state in states.values()) <= 2, states
            assert len(set(sessions)) <= 2 and len(sessions) == len(set(sessions)), sessions
        rows = front.models()
        # Two load at once; the third waits for room, which an idle model leaves for it. How
        # many loads that takes depends on when each request arrives; that every load but the
        # loaded ones was followed by its unload (no model ever loaded twice) does not.
        for m in models:
            loaded_now = rows[m]["state"] == "loaded"
            assert rows[m]["loads"] == sum(rows[m]["unloads"].values()) + loaded_now, rows
        assert sum(rows[m]["unloads"].get("room", 0) for m in models) >= 1
        assert sorted(rows[m]["state"] for m in models) == ["loaded", "loaded", "not_loaded"]


def front_door_on(run_dir: Path, *args: str) -> FrontDoor:
    """A FrontDoor on an existing run directory (its log still in its own directory)."""
    front = FrontDoor(*args)
    front.argv[front.argv.index("--run-dir") + 1] = str(run_dir)
    front.run_dir = run_dir
    return front


def test_a_killed_front_door_leaves_no_worker_and_the_next_one_reuses_the_daemon() -> None:
    first = FrontDoor(*paths_for([LLAMA])).start()
    second = front_door_on(first.run_dir, *paths_for([LLAMA]))
    daemon_pid = first.admin("ping")["pid"]
    try:
        assert first.complete(LLAMA).status == 200
        worker_pid = first.row(LLAMA)["pid"]
        assert [s["pid"] for s in first.sessions_of(LLAMA)] == [worker_pid]
        os.kill(first.pid, signal.SIGKILL)
        assert first.process is not None and first.process.wait(10) == -signal.SIGKILL
        # stdin EOF: the worker exits by itself and says goodbye (well before any lease ends).
        wait_until(lambda: gone(worker_pid), timeout=15)
        wait_until(lambda: first.sessions_of(LLAMA) == [], timeout=5)
        assert not gone(daemon_pid)

        second.start()
        assert "using the vqpoold running" in second.log()
        assert second.admin("ping")["pid"] == daemon_pid
        assert second.complete(LLAMA).status == 200
        new_pid = second.row(LLAMA)["pid"]
        assert [s["pid"] for s in second.sessions_of(LLAMA)] == [new_pid]
        assert [p.pid for p in second.children()] == [new_pid]
        assert second.stop() == 0
        assert not gone(daemon_pid)  # not its daemon: left running
    finally:
        second.close()
        with contextlib.suppress(psutil.NoSuchProcess):
            daemon = psutil.Process(daemon_pid)
            daemon.terminate()
            try:
                daemon.wait(15)
            except psutil.TimeoutExpired:
                daemon.kill()
        first.close()


KEEP_ALIVE_CONFIG = f"""
[models."{LLAMA}"]
path = "{LLAMA}"
keep_alive = "2s"
"""


def test_an_operator_unload_waits_for_the_running_stream_and_a_load_by_hand_works() -> None:
    with FrontDoor(config=KEEP_ALIVE_CONFIG) as front:
        stream = open_stream(front, LLAMA, FULL_STREAM_TOKENS)
        pending = front.control().unload(LLAMA, 0.2)
        assert pending["unloaded"] is False
        assert pending["state"] == "loaded" and pending["unload_when_idle"] is True
        assert pending["running"] == 1
        ended = read_to_end(stream)
        assert ended["errors"] == [] and ended["finish_reason"] == "length"
        assert ended["usage"]["completion_tokens"] == FULL_STREAM_TOKENS
        row = front.wait_state(LLAMA, "not_loaded")
        assert row["unloads"] == {"operator": 1} and row["unload_when_idle"] is False

        loaded = front.control(timeout=60).load(LLAMA, 60)
        assert loaded["state"] == "loaded" and loaded["loads"] == 2
        assert loaded["keep_alive_s"] == 2.0
        assert 0 < loaded["keep_alive_left_s"] <= 2.0
        # The keep-alive counts from the load: it unloads by itself once it runs out.
        row = front.wait_state(LLAMA, "not_loaded", timeout=20)
        assert row["unloads"] == {"operator": 1, "idle": 1}
