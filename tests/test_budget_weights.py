"""Weights in the daemon's budget ledger, over the wire: a worker's hello charges its model's
weights to its session and its end removes them; ``load_reserve`` charges a model's weights
before its worker exists, the worker's hello takes the reservation over (never counted twice),
``load_release`` gives it back, and an unclaimed one expires; a load that can never fit is
refused with the numbers. Real daemon, real workers or raw clients speaking the protocol."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any, cast

import pytest
from ctl_harness import run_ctl
from daemon_harness import RawClient, scrape_metrics, wait_until
from serving_harness import ServingStack, builtin_weights
from vqpool.shared.errors import VqpoolError
from vqpool.shared.protocol import MAX_LOAD_RESERVATIONS
from vqpool.worker.testing.launch import DaemonProcess

KIB = 1 << 10
MIB = 1 << 20
REFUSED = (VqpoolError, ValueError)  # bad arguments; a value the daemon cannot take


def llama_weights() -> int:
    return builtin_weights("builtin:llama")


def model_row(daemon: DaemonProcess, model: str) -> dict[str, Any] | None:
    rows = [v for v in daemon.admin("model_list")["models"] if v["model"] == model]
    return rows[0] if rows else None


def total_weights(daemon: DaemonProcess) -> int:
    return cast(int, daemon.admin("budget")["total_weights"])


@pytest.fixture
def daemon(start_daemon: Any) -> DaemonProcess:
    return cast(
        DaemonProcess, start_daemon("--n-blocks", "64", "--lease", "30", "--budget", "4MiB")
    )


@pytest.fixture
def raw(daemon: DaemonProcess) -> Iterator[RawClient]:
    client = RawClient(daemon.run_dir)
    yield client
    client.close()


def test_a_real_workers_hello_charges_its_weights_and_its_exit_removes_them() -> None:
    stack = ServingStack(
        ["builtin:llama"], daemon_args=("--n-blocks", "256", "--lease", "1", "--budget", "8MiB")
    ).start()
    try:
        weights = llama_weights()
        row = model_row(stack.daemon, "builtin:llama")
        assert row is not None and row["weights"] == weights
        budget = stack.daemon.admin("budget")
        assert budget["total_weights"] == weights
        assert budget["free"] == 8 * MIB - weights - budget["total_held"]
        reply = stack.complete("builtin:llama", {"prompt": "hello there", "max_tokens": 4})
        assert reply.status == 200, reply
        assert stack.workers["builtin:llama"].stop() == 0
        wait_until(lambda: total_weights(stack.daemon) == 0, timeout=10)
        stack.daemon.audit()
    finally:
        stack.stop()


def test_a_reservation_is_taken_over_by_the_hello_never_counted_twice(
    daemon: DaemonProcess, raw: RawClient
) -> None:
    first = daemon.admin("load_reserve", model="m", weights=MIB, kv_min=64 * KIB, ttl=60)
    second = daemon.admin("load_reserve", model="m", weights=MIB, kv_min=64 * KIB, ttl=60)
    assert first["granted"] and second["granted"] and first["ticket"] != second["ticket"]
    assert first["free"] == 4 * MIB - MIB
    assert second["free"] == 4 * MIB - 2 * MIB
    assert total_weights(daemon) == 2 * MIB
    raw.hello(model="m", weights=MIB, bytes_per_block=4096)  # takes the oldest reservation over
    assert total_weights(daemon) == 2 * MIB
    row = model_row(daemon, "m")
    assert row is not None and row["weights"] == 2 * MIB
    assert daemon.admin("load_release", ticket=first["ticket"]) == {"released": False}
    assert daemon.admin("load_release", ticket=second["ticket"]) == {"released": True}
    assert total_weights(daemon) == MIB
    # The heartbeat's measurement moves the charge.
    memory = {"weights": MIB + KIB, "mlx_active": 0, "mlx_cache": 0, "mlx_peak": 0, "rss": 1}
    assert raw.call("ping", {"memory": memory})["ok"]
    assert total_weights(daemon) == MIB + KIB
    assert raw.call("goodbye")["ok"]
    assert total_weights(daemon) == 0
    assert model_row(daemon, "m") is None  # forgotten: nothing held, nobody serves it
    daemon.audit()


def test_an_overhead_is_charged_beside_the_weights_and_shown_apart(
    daemon: DaemonProcess, raw: RawClient
) -> None:
    """A worker's declared overhead (its MLX buffer-cache limit) is part of its model's fixed
    cost: reserved with the weights, taken over by the hello, kept when the heartbeat's
    measurement moves the weights, and shown apart from them."""
    reserved = daemon.admin(
        "load_reserve", model="m", weights=MIB, overhead=256 * KIB, kv_min=64 * KIB, ttl=60
    )
    assert reserved["granted"] and reserved["free"] == 4 * MIB - MIB - 256 * KIB
    budget = daemon.admin("budget")
    assert (budget["total_weights"], budget["total_overhead"]) == (MIB, 256 * KIB)
    assert budget["free"] == 4 * MIB - MIB - 256 * KIB
    raw.hello(model="m", weights=MIB, overhead=256 * KIB, bytes_per_block=4096)
    row = model_row(daemon, "m")
    assert row is not None and (row["weights"], row["overhead"]) == (MIB, 256 * KIB)
    assert daemon.admin("budget")["free"] == 4 * MIB - MIB - 256 * KIB  # taken over, once
    memory = {"weights": MIB + KIB, "mlx_active": 0, "mlx_cache": 0, "mlx_peak": 0, "rss": 1}
    assert raw.call("ping", {"memory": memory})["ok"]
    budget = daemon.admin("budget")
    assert (budget["total_weights"], budget["total_overhead"]) == (MIB + KIB, 256 * KIB)
    assert budget["free"] == 4 * MIB - MIB - KIB - 256 * KIB
    # A load whose weights fit but not with its overhead is short by the overhead.
    short = daemon.admin("load_reserve", model="b", weights=2 * MIB, overhead=MIB, kv_min=0, ttl=60)
    assert not short["granted"] and short["short"] == 2 * MIB + MIB - budget["free"]
    assert short["overhead"] == MIB
    assert raw.call("goodbye")["ok"]
    budget = daemon.admin("budget")
    assert (budget["total_weights"], budget["total_overhead"], budget["free"]) == (0, 0, 4 * MIB)
    daemon.audit()


def test_a_load_short_of_bytes_says_by_how_much_and_charges_nothing(
    daemon: DaemonProcess,
) -> None:
    granted = daemon.admin("load_reserve", model="a", weights=3 * MIB, kv_min=0, ttl=60)
    assert granted["granted"]
    short = daemon.admin("load_reserve", model="b", weights=MIB, kv_min=512 * KIB, ttl=60)
    assert short == {
        "granted": False,
        "short": MIB + 512 * KIB - MIB,
        "free": MIB,
        "weights": MIB,
        "overhead": 0,
        "kv_min": 512 * KIB,
        "cached": 0,  # no worker holds a prompt cache
    }
    assert total_weights(daemon) == 3 * MIB
    assert daemon.admin("load_release", ticket=granted["ticket"]) == {"released": True}
    assert total_weights(daemon) == 0


def test_a_load_that_can_never_fit_is_refused_with_the_numbers(daemon: DaemonProcess) -> None:
    daemon.admin("model_set", model="other", create=True, reserve=MIB)
    with pytest.raises(REFUSED) as refused:
        daemon.admin("load_reserve", model="big", weights=3 * MIB, kv_min=512 * KIB, ttl=60)
    message = str(refused.value)
    assert "loading big needs 3 MiB of weights and 512 KiB of KV" in message, message
    assert "the budget is 4 MiB and other models reserve 1 MiB" in message, message
    assert total_weights(daemon) == 0
    assert model_row(daemon, "big") is None


def test_an_unclaimed_reservation_expires(daemon: DaemonProcess) -> None:
    taken = daemon.admin("load_reserve", model="m", weights=MIB, kv_min=0, ttl=0.05)
    assert taken["granted"]
    wait_until(lambda: total_weights(daemon) == 0, timeout=10)
    assert f"load reservation {taken['ticket']} of model 'm' (1 MiB) expired" in daemon.log()
    assert daemon.admin("load_release", ticket=taken["ticket"]) == {"released": False}


def test_pending_reservations_are_bounded(daemon: DaemonProcess) -> None:
    tickets = [
        daemon.admin("load_reserve", model=f"m{i}", weights=1, kv_min=0, ttl=60)["ticket"]
        for i in range(MAX_LOAD_RESERVATIONS)
    ]
    with pytest.raises(REFUSED, match="64 load reservations are pending"):
        daemon.admin("load_reserve", model="one-more", weights=1, kv_min=0, ttl=60)
    assert total_weights(daemon) == MAX_LOAD_RESERVATIONS
    for ticket in tickets:
        assert daemon.admin("load_release", ticket=ticket)["released"]
    assert total_weights(daemon) == 0


@pytest.mark.parametrize(
    ("args", "error"),
    [
        ({"weights": -1, "kv_min": 0, "ttl": 1}, "weights must be an integer"),
        ({"weights": 1, "kv_min": 0, "ttl": 0}, "ttl must be a number"),
        ({"weights": 1, "kv_min": 0, "ttl": 601}, "ttl must be a number"),
        ({"weights": 1.5, "kv_min": 0, "ttl": 1}, "weights must be an integer"),
    ],
)
def test_a_bad_reservation_is_refused_and_changes_nothing(
    daemon: DaemonProcess, args: dict[str, Any], error: str
) -> None:
    with pytest.raises(REFUSED, match=error):
        daemon.admin("load_reserve", model="m", **args)
    assert total_weights(daemon) == 0


def test_a_hello_with_bad_weights_is_refused(daemon: DaemonProcess, raw: RawClient) -> None:
    args = {"pid": os.getpid(), "model": "m", "nonce": "ab" * 8, "weights": -5}
    args["bytes_per_block"] = 4096
    reply = raw.call("hello", args)
    assert not reply["ok"] and "weights must be an integer" in reply["error"]["message"]
    assert total_weights(daemon) == 0


def test_fit_counts_the_weights_of_a_model_not_loaded_and_names_the_idle_ones(
    start_daemon: Any,
) -> None:
    daemon = start_daemon("--n-blocks", "64", "--lease", "30", "--budget", "4MiB")
    client = RawClient(daemon.run_dir)
    try:
        client.hello(model="loaded", weights=2 * MIB, bytes_per_block=4096)
        # 16 tokens: one block of 64 KiB (all streams) a sequence; 1.5 MiB of weights.
        ask = {"model": "new", "context": 16, "weights": 3 * MIB // 2, "bytes_per_block": 64 * KIB}
        fits = daemon.admin("fit", concurrency=8, **ask)
        assert fits["verdict"] == "now"
        assert fits["need"] == 512 * KIB and fits["available_now"] == 512 * KIB
        assert fits["weights"] == 3 * MIB // 2 and fits["free"] == 2 * MIB
        assert fits["models"] == {
            "loaded": {"weights": 2 * MIB, "overhead": 0, "held": 0, "cached": 0, "idle": True}
        }
        more = daemon.admin("fit", concurrency=9, **ask)
        assert more["verdict"] == "after_others_return"
        assert more["most_ever"] == 4 * MIB - 3 * MIB // 2
        by_token = daemon.admin(
            "fit",
            model="new",
            context=16,
            concurrency=8,
            weights=3 * MIB // 2,
            bytes_per_token=4 * KIB,
        )
        assert by_token["need"] == fits["need"] and by_token["verdict"] == "now"
        with pytest.raises(REFUSED, match="give bytes_per_token or bytes_per_block"):
            daemon.admin("fit", model="new", context=16, weights=MIB)
        # A loaded model's fit is priced by its worker, its weights already charged.
        loaded = daemon.admin("fit", model="loaded", context=16)
        assert loaded["weights"] == 2 * MIB and loaded["available_now"] == 2 * MIB
    finally:
        client.close()


def test_status_model_list_and_metrics_show_weights_beside_kv(start_daemon: Any) -> None:
    daemon = start_daemon(
        "--n-blocks", "64", "--lease", "30", "--budget", "4MiB", "--metrics-port", "0"
    )
    client = RawClient(daemon.run_dir)
    try:
        client.hello(model="loaded", weights=2 * MIB, bytes_per_block=4096)
        daemon.admin("load_reserve", model="coming", weights=MIB, kv_min=0, ttl=60)
        status = run_ctl(daemon.run_dir, "status")
        assert status.returncode == 0, status.stderr
        assert "held 0 B KV + 3 MiB weights, free 1 MiB" in status.stdout, status.stdout
        listing = run_ctl(daemon.run_dir, "model", "list")
        rows = {line.split()[0]: line.split() for line in listing.stdout.splitlines() if line}
        assert rows["loaded"][1:4] == ["0", "B", "2"], listing.stdout  # HELD 0 B, WEIGHTS 2 MiB
        assert rows["coming"][3:5] == ["1", "MiB"], listing.stdout
        watch = run_ctl(daemon.run_dir, "watch", "--interval=0.1", "--count=1")
        assert watch.returncode == 0, watch.stderr
        assert "held 0 B KV + 3 MiB weights" in watch.stdout, watch.stdout
        assert "weights 2 MiB" in watch.stdout and "weights 1 MiB" in watch.stdout, watch.stdout
        samples = scrape_metrics(daemon.log())
        assert samples[("vqpool_budget_weights_bytes", ())] == 3 * MIB
        assert samples[("vqpool_budget_free_bytes", ())] == MIB
        assert samples[("vqpool_model_weights_bytes", (("model", "loaded"),))] == 2 * MIB
        assert samples[("vqpool_model_weights_bytes", (("model", "coming"),))] == MIB
    finally:
        client.close()


def test_a_short_load_asks_the_least_recently_used_prompt_caches_and_they_give_back() -> None:
    block_bytes = 4096  # builtin:llama, per stream and block
    kv = 64 * block_bytes
    stack = ServingStack(
        ["builtin:llama"],
        daemon_args=("--n-blocks", "256", "--lease", "1", "--budget", f"{kv + llama_weights()}B"),
    ).start()
    try:
        # Two prompts of 150 tokens + 4 generated: two cache entries of 10 blocks a stream
        # (80 KiB each), the first the least recently used.
        for first in (0, 100):
            body = {"prompt": [first + i for i in range(150)], "max_tokens": 4}
            assert stack.complete("builtin:llama", body).status == 200

        def cached() -> int:
            (session,) = stack.daemon.admin("sessions")
            return int((session["prompt_cache"] or {}).get("bytes", 0))

        wait_until(lambda: cached() == 160 * KIB, timeout=10)
        in_cache = cached()
        free = stack.daemon.admin("budget")["free"]
        assert free == kv - in_cache
        # Short by 16 KiB: the cache is asked for exactly that much, and gives it back.
        ask = {"model": "next", "weights": free + 16 * KIB, "kv_min": 0, "ttl": 60}
        short = stack.daemon.admin("load_reserve", **ask)
        assert short["granted"] is False
        assert short["short"] == 16 * KIB and short["cached"] == 16 * KIB
        wait_until(lambda: stack.daemon.admin("budget")["free"] >= free + 16 * KIB, timeout=10)
        wait_until(lambda: cached() < in_cache, timeout=10)
        assert cached() == 80 * KIB  # the least recently used entry, not the whole cache
        granted = stack.daemon.admin("load_reserve", **ask)
        assert granted["granted"]
        assert total_weights(stack.daemon) == llama_weights() + ask["weights"]
        assert stack.daemon.admin("load_release", ticket=granted["ticket"]) == {"released": True}
        stack.daemon.audit()
    finally:
        stack.stop()


def test_a_budget_lowered_below_the_weights_grants_nothing_and_audit_says_by_how_much(
    daemon: DaemonProcess, raw: RawClient
) -> None:
    raw.hello(model="m", weights=2 * MIB, bytes_per_block=4096)
    daemon.admin("budget", bytes=MIB + 512 * KIB)
    budget = daemon.admin("budget")
    assert budget["over_budget"] is True and budget["free"] == 0
    reply = raw.call("allocate", {"stream": "k", "n_tokens": 16, "owner": "r", "wait": 0})
    # Its own weights alone are over the budget: no KV could ever be granted to it.
    assert not reply["ok"] and "can never be granted" in reply["error"]["message"], reply
    assert "the budget 1.5 MiB minus its weights" in reply["error"]["message"], reply
    audit = daemon.admin("audit")
    assert audit["ok"], audit  # the books agree: the excess is a breach, not a bug
    breaches = audit["breaches"]
    assert any("2 MiB of weights held, 512 KiB over the budget" in b for b in breaches), audit
    # Its worker gone, the weights go with it: the budget holds again.
    assert raw.call("goodbye")["ok"]
    assert daemon.admin("budget")["over_budget"] is False
