"""One unit per display: on a pool whose K and V blocks have different sizes, what `status`,
`watch` and the demo's live line show as held and as cached are both bytes of K and V together
(and blocks of all streams together), so cached is never shown above held. A real vqpoold, a
session declaring 4 KiB K blocks and 1 KiB V blocks whose prompt cache holds all it holds, read
through the real vqpoolctl and the demo's own functions."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
from ctl_harness import ctl_json, run_ctl
from daemon_harness import wait_until
from vqpool.shared.admin_client import AdminClient
from vqpool.shared.byte_sizes import parse_bytes
from vqpool.worker import PoolClient
from vqpool.worker.testing.launch import DaemonProcess

K_BYTES, V_BYTES = 4096, 1024
HELD = 2 * K_BYTES + 2 * V_BYTES  # 32 tokens of k and of v: 2 blocks each
MODEL = "org/uneven"


@pytest.fixture
def uneven(start_daemon) -> Iterator[DaemonProcess]:
    daemon = start_daemon("--n-blocks", "64", "--budget", "1MiB")
    client = PoolClient(
        daemon.run_dir, name=MODEL, bytes_per_block={"k": K_BYTES, "v": V_BYTES}, timeout=5.0
    )
    client.allocate("k", 32, "r1")
    client.allocate("v", 32, "r1")
    # Its prompt cache holds all of it (K and V bytes, as a worker's cache reports them).
    client.report_prompt_cache({"bytes": HELD, "blocks": 4, "entries": 1})
    client.report_load(0, 0)

    def reported() -> bool:
        sessions = daemon.admin("sessions")
        return bool(sessions) and sessions[0]["prompt_cache"] is not None

    wait_until(reported, timeout=5.0)
    yield daemon
    client.close()


def _bytes(text: str) -> int:
    """A size as vqpoolctl prints it ("10 KiB", "10.0 KiB") in bytes."""
    return parse_bytes(text.replace(" ", ""), allow_zero=True)


def test_status_shows_cached_and_held_in_one_unit(uneven: DaemonProcess) -> None:
    status = ctl_json(uneven.run_dir, "status")
    model = status["models"][MODEL]
    assert model["bytes_total"] == HELD
    assert model["prompt_cache"]["bytes"] <= model["bytes_total"]
    text = run_ctl(uneven.run_dir, "status").stdout
    row = next(line for line in text.splitlines() if line.startswith(MODEL + " "))
    cells = re.split(r"\s{2,}", row.strip())
    assert [_bytes(c) for c in cells[-2:]] == [HELD, HELD], row  # bytes held, of which cached


def test_watch_shows_cached_and_held_in_one_unit(uneven: DaemonProcess) -> None:
    frame = run_ctl(uneven.run_dir, "watch", "--count", "1").stdout
    label = MODEL.split("/")[-1]  # as watch shows it
    lines = [line for line in frame.splitlines() if line.startswith(label + " ")]
    assert lines, frame
    sizes = r"([\d.]+ [KMG]?i?B)"
    held = [m.group(1) for line in lines for m in re.finditer(rf"held {sizes}", line)]
    cached = [m.group(1) for line in lines for m in re.finditer(rf"cached {sizes}", line)]
    assert held and all(_bytes(h) == HELD for h in held), frame
    assert [_bytes(c) for c in cached] == [HELD], frame
    # No per-stream byte figure beside them: K alone (8 KiB) would read as less than cached.
    shown = {_bytes(m.group(1)) for line in lines for m in re.finditer(sizes, line)}
    assert 2 * K_BYTES not in shown and 2 * V_BYTES not in shown, frame
    record = json.loads(run_ctl(uneven.run_dir, "watch", "--count", "1", "--json").stdout)
    model = record["models"][MODEL]
    assert model["prompt_cache"]["bytes"] <= model["bytes_total"] == HELD


def _demo() -> ModuleType:
    path = Path(__file__).resolve().parent.parent / "scripts" / "demo.py"
    spec = importlib.util.spec_from_file_location("vqpool_demo_script", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_the_demo_live_line_counts_the_pool_and_the_models_alike(uneven: DaemonProcess) -> None:
    demo = _demo()
    with AdminClient(uneven.run_dir, timeout=5.0) as admin:
        line = demo.render_line(demo.pool_snapshot(admin))
    pool = re.search(r"^pool (\d+)/(\d+) blocks in use \(k\+v\), ([\d.]+ \w+) \|", line)
    model = re.search(rf"{MODEL}: blocks (\d+), ([\d.]+ \w+), running", line)
    assert pool and model, line
    assert pool.group(1) == model.group(1) == "4", line  # K+V blocks on both sides
    assert _bytes(pool.group(3)) == _bytes(model.group(2)) == HELD, line  # K+V bytes alike
