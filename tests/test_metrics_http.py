"""vqpoold --metrics-port: /metrics scraped over HTTP from a live daemon with two worker
processes, parsed with prometheus_client.parser, every value checked against the daemon's own
admin replies."""

from __future__ import annotations

import re
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest
from ctl_harness import LivePool
from daemon_harness import AgentError, wait_until
from prometheus_client.parser import text_string_to_metric_families
from vqpool.worker.testing.launch import DaemonProcess

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def metrics_url(daemon: DaemonProcess) -> str:
    match = re.search(r"metrics on (http://127\.0\.0\.1:\d+/metrics)", daemon.log())
    assert match, daemon.log()
    return match.group(1)


def scrape(url: str) -> tuple[str, Samples]:
    with urllib.request.urlopen(url, timeout=5) as response:
        assert response.status == 200
        text = response.read().decode()
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return text, samples


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


@pytest.fixture
def pool() -> Iterator[LivePool]:
    live = LivePool.start("--n-blocks", "256", "--lease", "5", "--metrics-port", "0")
    yield live
    live.stop()


def test_scraped_values_equal_the_daemon_state(pool: LivePool) -> None:
    url = metrics_url(pool.daemon)
    assert url.startswith("http://127.0.0.1:")
    text, samples = scrape(url)
    stats = pool.daemon.admin("stats")
    st = stats["stats"]

    # The seed's metrics, same names, same values as the daemon's allocator stats.
    seed = {
        "veloxquant_block_pool_blocks_in_use": st["blocks_in_use"],
        "veloxquant_block_pool_blocks_total": st["n_blocks"],
        "veloxquant_block_pool_peak_blocks_in_use": st["peak_blocks_in_use"],
        "veloxquant_block_pool_allocations_total": st["n_allocations"],
        "veloxquant_block_pool_frees_total": st["n_frees"],
        "veloxquant_block_pool_reused_total": st["n_reused"],
        "veloxquant_block_pool_exhausted_total": st["n_exhausted"],
        "veloxquant_block_pool_grown_total": st["n_grown"],
        "veloxquant_block_pool_retired_total": st["n_retired"],
    }
    for name, expected in seed.items():
        assert value(samples, name) == expected, name
    assert value(samples, "veloxquant_block_pool_fragmentation") == pytest.approx(
        st["fragmentation"], abs=1e-6
    )
    admin_text = pool.daemon.admin("metrics")
    for line in admin_text.splitlines():
        if not line.startswith("#"):
            assert line.split()[0] in text  # every seed sample name is served

    for stream, counts in stats["streams"].items():
        assert value(samples, "vqpool_stream_blocks", stream=stream) == counts["total"]
        assert value(samples, "vqpool_stream_blocks_free", stream=stream) == counts["free"]
        in_use = counts["total"] - counts["free"]
        assert value(samples, "vqpool_stream_blocks_in_use", stream=stream) == in_use

    for session in pool.daemon.admin("sessions"):
        for stream in ("k", "v"):
            labels = {"model": session["model"], "stream": stream}
            blocks = session["blocks"].get(stream, 0)
            assert value(samples, "vqpool_model_blocks_held", **labels) == blocks
            assert value(samples, "vqpool_model_bytes_held", **labels) == blocks * 4096
    assert value(samples, "vqpool_sessions") == stats["sessions"] == 2
    assert value(samples, "vqpool_owners") == stats["owners"] == 3
    assert value(samples, "vqpool_sessions_opened_total") == 2
    assert (
        value(samples, "vqpool_daemon_info", version=stats["version"], boot_id=stats["boot_id"])
        == 1
    )


def test_request_counters_and_histogram(pool: LivePool) -> None:
    url = metrics_url(pool.daemon)
    with pytest.raises(AgentError, match="NotOwnerError"):
        pool.beta.call("free_all", "a1")
    with pytest.raises(AgentError, match="BlockPoolExhaustedError"):
        pool.beta.call("allocate", "k", 16 * 500, 8)
    _, samples = scrape(url)

    def requests(op: str, code: str, socket: str = "worker") -> float:
        return samples.get(
            ("vqpool_requests_total", frozenset({("socket", socket), ("op", op), ("code", code)})),
            0.0,
        )

    assert requests("allocate", "OK") == 5  # the five allocations LivePool made
    assert requests("allocate", "POOL_EXHAUSTED") == 1
    assert requests("free_all", "NOT_OWNER") == 1
    assert requests("hello", "OK") == 2
    assert value(samples, "veloxquant_block_pool_exhausted_total") == 1

    count = value(samples, "vqpool_request_seconds_count", socket="worker", op="allocate")
    assert count == 6
    total = value(samples, "vqpool_request_seconds_sum", socket="worker", op="allocate")
    assert 0 < total < 1.0
    inf = value(samples, "vqpool_request_seconds_bucket", socket="worker", op="allocate", le="+Inf")
    assert inf == count
    buckets = sorted(
        (float(dict(labels)["le"]), v)
        for (name, labels), v in samples.items()
        if name == "vqpool_request_seconds_bucket" and dict(labels).get("op") == "allocate"
    )
    assert [v for _, v in buckets] == sorted(v for _, v in buckets)  # cumulative


def test_reaped_sessions_are_counted(pool: LivePool) -> None:
    url = metrics_url(pool.daemon)
    pool.beta.kill()
    wait_until(lambda: pool.daemon.admin("stats")["sessions_reaped"] == 1, timeout=5)
    _, samples = scrape(url)
    assert value(samples, "vqpool_sessions_reaped_total") == 1
    assert value(samples, "vqpool_sessions") == 1
    assert (
        "vqpool_model_blocks_held",
        frozenset({("model", "beta"), ("stream", "k")}),
    ) not in samples
    assert value(samples, "veloxquant_block_pool_blocks_in_use") == 7


def test_scrapes_during_churn_see_consistent_snapshots(pool: LivePool) -> None:
    """Scrapes run in the HTTP server's threads while the loop serves allocations and frees:
    every scrape must see one instant (the per-stream, per-model and seed numbers agree)."""
    url = metrics_url(pool.daemon)
    stop = threading.Event()

    def churn() -> None:
        i = 0
        while not stop.is_set():
            pool.alpha.call("allocate", "k", 48, f"c{i}")
            pool.alpha.call("allocate", "v", 20, f"c{i}")
            pool.alpha.call("free_all", f"c{i}")
            i += 1

    worker = threading.Thread(target=churn)
    worker.start()
    try:
        deadline = time.monotonic() + 1.5
        n_scrapes = 0
        while time.monotonic() < deadline:
            _, samples = scrape(url)
            n_scrapes += 1
            in_use = value(samples, "veloxquant_block_pool_blocks_in_use")
            assert in_use == value(samples, "veloxquant_block_pool_allocations_total") - value(
                samples, "veloxquant_block_pool_frees_total"
            )
            per_stream = sum(
                value(samples, "vqpool_stream_blocks_in_use", stream=s) for s in ("k", "v")
            )
            per_model = sum(
                v for (name, _), v in samples.items() if name == "vqpool_model_blocks_held"
            )
            assert in_use == per_stream == per_model
    finally:
        stop.set()
        worker.join()
    assert n_scrapes >= 5
    pool.daemon.audit()


def test_off_by_default(start_daemon: Callable[..., DaemonProcess]) -> None:
    daemon = start_daemon("--n-blocks", "16")
    assert "metrics on" not in daemon.log()
    assert psutil.Process(daemon.pid).net_connections(kind="inet") == []


def test_port_from_the_config_file(
    start_daemon: Callable[..., DaemonProcess], tmp_path: Path
) -> None:
    config = tmp_path / "vqpoold.toml"
    config.write_text("[vqpoold]\nn_blocks = 32\nmetrics_port = 0\n")
    daemon = start_daemon("--config", str(config))
    _, samples = scrape(metrics_url(daemon))
    assert value(samples, "veloxquant_block_pool_blocks_total") == 32


def test_a_port_in_use_fails_start_up(
    start_daemon: Callable[..., DaemonProcess], run_dir: Path
) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(RuntimeError, match=f"cannot serve metrics on 127.0.0.1:{port}"):
            start_daemon("--metrics-port", str(port), run_dir=run_dir)
