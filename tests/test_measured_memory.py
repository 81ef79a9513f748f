"""Measured, not declared: each worker's heartbeat reports its process's memory (its model's
weights, MLX's active, cache and peak memory, its resident set); the daemon keeps the last
report per session, shows it in ``sessions``, ``model list``, ``status`` and the metrics, refuses
a malformed report without changing anything, and warns once when a model's measured memory
drifts from what is declared for it. Real daemon, real workers, real heartbeats."""

from __future__ import annotations

import json
import re
import urllib.request
from collections.abc import Iterator
from typing import Any, cast

import mlx.core as mx
import pytest
from ctl_harness import run_ctl
from daemon_harness import RawClient, wait_until
from mlx.utils import tree_flatten
from serving_harness import ServingStack
from vqpool.shared.errors import ErrorCode
from vqpool.shared.protocol import MAX_MEMORY_BYTES, MEMORY_KEYS
from vqpool.worker.models.tiny_models import build_tiny_model
from vqpool.worker.pool.heartbeat import LoadReport
from vqpool.worker.testing.launch import DaemonProcess

MIB = 1 << 20
DRIFT_LINE = "measured memory"


def llama_weights_bytes() -> int:
    """builtin:llama's parameters' bytes, as the worker builds it (seed 0)."""
    model, _ = build_tiny_model("llama", seed=0)
    flat = cast(list[tuple[str, mx.array]], tree_flatten(model.parameters()))
    return sum(array.nbytes for _, array in flat)


@pytest.fixture(scope="module")
def stack() -> Iterator[ServingStack]:
    serving = ServingStack(
        ["builtin:llama"],
        daemon_args=("--n-blocks", "512", "--lease", "1", "--metrics-port", "0"),
        worker_args=("--mlx-cache-limit", "32MiB"),
    ).start()
    try:
        yield serving
    finally:
        serving.stop()


def reported(stack: ServingStack) -> dict[str, Any]:
    """The worker's session, once its heartbeat has reported its memory."""

    def session() -> dict[str, Any] | None:
        rows = [s for s in stack.daemon.admin("sessions") if s["model"] == "builtin:llama"]
        return rows[0] if rows and rows[0]["memory"] is not None else None

    wait_until(lambda: session() is not None, timeout=10)
    found = session()
    assert found is not None
    return found


def test_a_worker_reports_its_weights_exactly_and_its_memory(stack: ServingStack) -> None:
    session = reported(stack)
    memory = session["memory"]
    assert set(memory) == set(MEMORY_KEYS)
    assert memory["weights"] == llama_weights_bytes()
    assert memory["rss"] > 0
    # The weights live in MLX arrays: MLX's active memory holds at least them.
    assert memory["mlx_active"] >= memory["weights"]
    assert memory["mlx_peak"] >= memory["mlx_active"]
    assert memory["mlx_cache"] <= 32 * MIB  # --mlx-cache-limit
    assert "MLX buffer cache limited to 33554432 bytes" in stack.workers["builtin:llama"].log()


def test_model_list_status_and_metrics_show_weights_and_measured(stack: ServingStack) -> None:
    reported(stack)
    reply = stack.complete("builtin:llama", {"prompt": "hello there", "max_tokens": 4})
    assert reply.status == 200, reply
    (view,) = [
        v for v in stack.daemon.admin("model_list")["models"] if v["model"] == "builtin:llama"
    ]
    memory = view["memory"]
    weights = llama_weights_bytes()
    assert memory["weights"] == weights and memory["processes"] == 1
    assert memory["measured"] == memory["mlx_active"] + memory["mlx_cache"]
    assert memory["kv_held"] == view["held"]
    assert memory["declared"] == view["held"] + weights
    assert memory["difference"] == memory["measured"] - memory["declared"]
    assert memory["margin"] == 128 * MIB  # a tiny model: the floor
    assert memory["drift"] is False  # a worker that behaves does not drift

    listing = run_ctl(stack.run_dir, "model", "list")
    assert listing.returncode == 0, listing.stderr
    header = next(line for line in listing.stdout.splitlines() if line.startswith("MODEL"))
    assert header.split()[:4] == ["MODEL", "HELD", "WEIGHTS", "MEASURED"]
    as_json = json.loads(run_ctl(stack.run_dir, "model", "list", "--json").stdout)
    (row,) = [v for v in as_json["models"] if v["model"] == "builtin:llama"]
    assert row["memory"]["weights"] == weights and row["memory"]["drift"] is False

    status = run_ctl(stack.run_dir, "status")
    assert status.returncode == 0, status.stderr
    header = next(line for line in status.stdout.splitlines() if line.startswith("MODEL  "))
    assert "WEIGHTS" in header and "MEASURED" in header

    match = re.search(r"metrics on (http://127\.0\.0\.1:\d+/metrics)", stack.daemon.log())
    assert match, stack.daemon.log()
    with urllib.request.urlopen(match.group(1), timeout=5) as response:
        text = response.read().decode()
    assert f'vqpool_model_weights_bytes{{model="builtin:llama"}} {float(weights)}' in text
    for kind in ("mlx_active", "mlx_cache", "mlx_peak", "rss", "total"):
        assert f'vqpool_model_measured_bytes{{kind="{kind}",model="builtin:llama"}}' in text
    assert 'vqpool_model_memory_drift{model="builtin:llama"} 0.0' in text


GOOD = {
    "weights": 10 * MIB,
    "mlx_active": 12 * MIB,
    "mlx_cache": 0,
    "mlx_peak": 12 * MIB,
    "rss": 90 * MIB,
}

BAD_REPORTS = [
    ({**GOOD, "rss": -1}, "ping.memory.rss must be an integer in 0..1125899906842624, got -1"),
    (
        {**GOOD, "mlx_active": MAX_MEMORY_BYTES + 1},
        "ping.memory.mlx_active must be an integer in 0..1125899906842624",
    ),
    ({**GOOD, "weights": "10MiB"}, "ping.memory.weights must be an integer"),
    ({**GOOD, "weights": 1.5}, "ping.memory.weights must be an integer"),
    ({**GOOD, "vram": 1}, "ping.memory: unknown figure(s) ['vram']"),
    ([1, 2, 3], "ping.memory must be a map"),
]


@pytest.fixture
def daemon(start_daemon: Any) -> DaemonProcess:
    return cast(DaemonProcess, start_daemon("--n-blocks", "64", "--lease", "30"))


def session_of(daemon: DaemonProcess, model: str) -> dict[str, Any]:
    (row,) = [s for s in daemon.admin("sessions") if s["model"] == model]
    return cast(dict[str, Any], row)


@pytest.mark.parametrize(("report", "error"), BAD_REPORTS)
def test_a_bad_memory_report_is_refused_clearly_and_changes_nothing(
    daemon: DaemonProcess, report: Any, error: str
) -> None:
    client = RawClient(daemon.run_dir)
    try:
        client.hello(model="raw")
        assert client.call("ping", {"memory": GOOD})["ok"]
        before = session_of(daemon, "raw")["memory"]
        assert before == GOOD
        models_before = daemon.admin("model_list")["models"]
        reply = client.call("ping", {"memory": report, "running": 3})
        assert not reply["ok"]
        assert reply["error"]["code"] == ErrorCode.BAD_REQUEST, reply
        assert error in reply["error"]["message"], reply
        after = session_of(daemon, "raw")
        assert after["memory"] == before and after["running"] is None  # the whole ping refused
        assert daemon.admin("model_list")["models"][0]["memory"] == models_before[0]["memory"]
    finally:
        client.close()


def test_drift_is_warned_once_per_episode_and_shown(daemon: DaemonProcess) -> None:
    client = RawClient(daemon.run_dir)
    try:
        client.hello(model="drifter")
        # Declared: no KV held, 10 MiB of weights. Measured: 2 GiB of MLX memory.
        far = {**GOOD, "mlx_active": 2048 * MIB}
        assert client.call("ping", {"memory": far})["ok"]
        (view,) = daemon.admin("model_list")["models"]
        assert view["memory"]["drift"] is True
        assert view["memory"]["difference"] == 2048 * MIB - 10 * MIB
        warnings = [line for line in daemon.log().splitlines() if DRIFT_LINE in line]
        assert len(warnings) == 1, daemon.log()
        assert " WARNING " in warnings[0] and "'drifter'" in warnings[0]
        assert "2 GiB" in warnings[0] and "declared 10 MiB" in warnings[0]
        # The same episode: no second warning.
        assert client.call("ping", {"memory": {**far, "mlx_active": 3072 * MIB}})["ok"]
        # Back within the margin ends it; drifting again within five minutes stays quiet too.
        assert client.call("ping", {"memory": GOOD})["ok"]
        assert daemon.admin("model_list")["models"][0]["memory"]["drift"] is False
        assert client.call("ping", {"memory": far})["ok"]
        assert len([ln for ln in daemon.log().splitlines() if DRIFT_LINE in ln]) == 1
        listing = run_ctl(daemon.run_dir, "model", "list")
        assert "DRIFT" in listing.stdout, listing.stdout
        # The model's last session ends: a new worker of it drifting is a new episode.
        assert client.call("goodbye")["ok"]
        client.hello(model="drifter")
        assert client.call("ping", {"memory": far})["ok"]
        assert len([ln for ln in daemon.log().splitlines() if DRIFT_LINE in ln]) == 2
    finally:
        client.close()


def test_the_heartbeat_samples_once_per_interval_and_drops_memory_an_older_daemon_refuses() -> None:
    """The load report the heartbeat sends: one sample per heartbeat interval (pings woken by
    load changes reuse it); after a refusal worded as a daemon older than the argument words
    it (``parse_args``), memory is dropped and the rest still sent. A refusal of a bad value is
    not taken for an older daemon's."""
    samples: list[dict[str, int]] = []

    def probe() -> dict[str, int]:
        samples.append(dict(GOOD))
        return samples[-1]

    report = LoadReport()
    report.load = (1, 0, None)
    report.memory_probe = probe
    report.memory_interval = 60.0
    assert report.ping_args()["memory"] == GOOD
    assert report.ping_args()["memory"] == GOOD
    assert len(samples) == 1
    assert not report.refuse_unknown("ping.memory.rss must be an integer in 0..1, got -1")
    assert report.refuse_unknown("ping: unknown argument(s) ['memory', 'prompt_cache']")
    assert report.ping_args() == {"running": 1, "queued": 0}
