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
from daemon_harness import RawClient, wait_until
from serving_harness import ServingStack
from vqpool.shared.errors import VqpoolError
from vqpool.shared.protocol import MAX_LOAD_RESERVATIONS
from vqpool.worker.models.memory import weights_bytes
from vqpool.worker.models.tiny_models import build_tiny_model
from vqpool.worker.testing.launch import DaemonProcess

KIB = 1 << 10
MIB = 1 << 20
REFUSED = (VqpoolError, ValueError)  # bad arguments; a value the daemon cannot take


def llama_weights() -> int:
    """builtin:llama's parameters' bytes, as the worker builds it (seed 0)."""
    model, _ = build_tiny_model("llama", seed=0)
    return weights_bytes(model)


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
