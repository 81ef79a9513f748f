"""vqpoolctl ps, load and unload, and the front door in status, against a real `vqpool serve`
(its vqpoold and workers real processes) and the real vqpoolctl console script."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from ctl_harness import ctl_json, run_ctl
from front_harness import FrontDoor
from vqpool.shared.model_weights import serve_cache_limit, worker_overhead
from vqpool.worker.testing.launch import DaemonProcess
from vqpool.worker.testing.model_dirs import write_model_dir

CONFIG = """
[serve]
max_loaded = 2

[models."tiny/llama"]
path = "builtin:llama"
keep_alive = "5m"

[models."qwen"]
path = "builtin:qwen3"
pinned = true
"""


@pytest.fixture(scope="module")
def front() -> Iterator[FrontDoor]:
    with FrontDoor(config=CONFIG) as front_door:
        yield front_door


def _ps_rows(text: str) -> dict[str, list[str]]:
    """``vqpoolctl ps`` table rows by model label (the cells after it)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("MODEL "))
    rows = {}
    for line in lines[start + 1 :]:
        if not line:
            break
        label, *cells = re.split(r" {2,}", line.strip())  # cells are two spaces apart
        rows[label] = cells
    return rows


def test_ps_load_and_unload_by_hand(front: FrontDoor) -> None:
    before = run_ctl(front.run_dir, "ps")
    assert before.returncode == 0, before.stderr
    assert before.stdout.splitlines()[0] == (
        f"vqpool serve on {front.url}, pid {front.pid}, at most 2 models loaded"
    )
    # state, pid, port, running, queued, weights, kv held, cached, measured, share, idle,
    # keep-alive left, loads, unloads, crashes, failed loads
    memory_not_loaded = ["0 B", "0 B", "-", "0.0%"]
    never_loaded = [*memory_not_loaded, "-", "-", "0", "0", "0", "0"]
    assert _ps_rows(before.stdout) == {
        "llama": ["not_loaded", "-", "-", "0", "0", "417.2 KiB", *never_loaded],
        "qwen": ["not_loaded", "-", "-", "0", "0", "481.8 KiB", *never_loaded],
    }

    loaded = run_ctl(front.run_dir, "load", "llama", "--wait", "120", timeout=150)
    assert loaded.returncode == 0, loaded.stderr
    row = front.row("tiny/llama")
    port = int(row["url"].rsplit(":", 1)[1])
    assert loaded.stdout == f"tiny/llama: loaded, pid {row['pid']}, port {port}\n"

    after = _ps_rows(run_ctl(front.run_dir, "ps").stdout)
    state, pid, shown_port, running, queued, weights, *memory, idle, left, loads, unloads = after[
        "llama"
    ][:14]
    assert (state, pid, shown_port) == ("loaded", str(row["pid"]), str(port))
    # The weights its worker reports (exactly its parameters' bytes) count in its share.
    kv_held, cached, measured, share = memory
    assert weights == "417.2 KiB" and measured.endswith("iB") and share.endswith("%")
    assert (kv_held, cached) == ("0 B", "0 B")
    llama_json = next(
        r for r in ctl_json(front.run_dir, "ps")["models"] if r["name"] == "tiny/llama"
    )
    budget = ctl_json(front.run_dir, "budget")["budget"]
    assert llama_json["memory"]["weights"] == llama_json["weights_bytes"]
    # Its worker's overhead (its MLX buffer-cache limit) is charged, and counts, beside them.
    overhead = llama_json["memory"]["overhead"]
    assert overhead == llama_json["overhead_bytes"]
    assert overhead == worker_overhead(serve_cache_limit(llama_json["weights_bytes"]))
    assert llama_json["memory"]["share"] == (llama_json["memory"]["weights"] + overhead) / budget
    assert (running, queued, loads, unloads) == ("0", "0", "1", "0")
    assert idle.endswith("s") and left.startswith(("4m", "5m00s"))  # keep_alive = "5m"
    assert after["qwen"][0] == "not_loaded"

    pinned = run_ctl(front.run_dir, "load", "qwen", "--json", "--wait", "120", timeout=150)
    assert pinned.returncode == 0, pinned.stderr
    assert json.loads(pinned.stdout)["state"] == "loaded"
    assert _ps_rows(run_ctl(front.run_dir, "ps").stdout)["qwen"][11] == "pinned"

    unloaded = run_ctl(front.run_dir, "unload", "tiny/llama")
    assert unloaded.returncode == 0, unloaded.stderr
    assert unloaded.stdout == "tiny/llama: unloaded\n"
    again = run_ctl(front.run_dir, "unload", "tiny/llama")
    assert again.stdout == "tiny/llama: was not loaded\n"

    answer = ctl_json(front.run_dir, "ps")
    assert answer["pid"] == front.pid and answer["url"] == front.url
    assert answer["max_loaded"] == 2
    llama = next(r for r in answer["models"] if r["name"] == "tiny/llama")
    assert llama["state"] == "not_loaded"
    assert (llama["loads"], llama["unloads"]) == (1, {"operator": 1})
    assert _ps_rows(run_ctl(front.run_dir, "ps").stdout)["llama"][:14] == [
        "not_loaded", "-", "-", "0", "0", "417.2 KiB", *memory_not_loaded, "-", "-", "1", "1"
    ]  # fmt: skip


def test_unknown_model_is_refused(front: FrontDoor) -> None:
    for command in ("load", "unload"):
        result = run_ctl(front.run_dir, command, "mistral")
        assert result.returncode == 4
        assert result.stdout == ""
        assert result.stderr.startswith("vqpoolctl: refused by vqpool serve (404): model 'mistral'")
        assert "tiny/llama" in result.stderr and "qwen" in result.stderr
        assert result.stderr.count("\n") == 1


def test_status_shows_the_front_door(front: FrontDoor) -> None:
    status = ctl_json(front.run_dir, "status")
    assert status["front_door"]["pid"] == front.pid
    assert [r["name"] for r in status["front_door"]["models"]] == ["tiny/llama", "qwen"]
    text = run_ctl(front.run_dir, "status")
    assert text.returncode == 0, text.stderr
    assert f"vqpool serve on {front.url}, pid {front.pid}" in text.stdout
    assert "MODEL  STATE" in text.stdout
    watch = run_ctl(front.run_dir, "watch", "--count", "1", "--json")
    assert json.loads(watch.stdout)["front_door"]["url"] == front.url
    frame = run_ctl(front.run_dir, "watch", "--count", "1")
    assert f"vqpool serve on {front.url}, pid {front.pid}" in frame.stdout


def test_without_a_front_door(start_daemon: Callable[..., DaemonProcess], run_dir: Path) -> None:
    for command in (["ps"], ["load", "x"], ["unload", "x"]):
        result = run_ctl(run_dir, *command)
        assert result.returncode == 3
        assert result.stdout == ""
        assert result.stderr == (
            f"vqpoolctl: vqpool serve is not running (no {run_dir / 'front.sock'}); start it "
            f"with `vqpool serve --run-dir {run_dir}`\n"
        )
    daemon = start_daemon(run_dir=run_dir)
    status = ctl_json(run_dir, "status")
    assert status["pid"] == daemon.pid
    assert status["front_door"] is None
    assert "vqpool serve" not in run_ctl(run_dir, "status").stdout


def test_a_failed_load_is_refused_with_the_workers_reason(tmp_path: Path) -> None:
    not_a_model = tmp_path / "not-a-model"
    not_a_model.mkdir()
    with FrontDoor("--model", str(not_a_model)) as front:
        result = run_ctl(front.run_dir, "load", "not-a-model", "--wait", "120", timeout=150)
        assert result.returncode == 4
        assert result.stderr.startswith("vqpoolctl: refused by vqpool serve (502): ")
        assert "no config.json" in result.stderr
        assert result.stderr.count("\n") == 1
        ps = run_ctl(front.run_dir, "ps")
        # Not loading again: the request that asked for the load has had its answer.
        state, *_, crashes, failed_loads = _ps_rows(ps.stdout)["not-a-model"]
        assert (state, crashes, failed_loads) == ("not_loaded", "0", "1")
        assert "not-a-model: last error: the worker of " in ps.stdout


def test_weights_are_known_before_any_load(tmp_path: Path) -> None:
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from vqpool.worker.models.tiny_models import build_tiny_model

    directory = write_model_dir(tmp_path / "dir-qwen3", "qwen3")
    on_disk = mx.load(str(directory / "model.safetensors"))
    assert isinstance(on_disk, dict)
    builtin = tree_flatten(build_tiny_model("llama")[0].parameters())
    expected = {
        str(directory): sum(a.nbytes for a in on_disk.values()),
        "builtin:llama": sum(a.nbytes for _, a in builtin),
        "tiny-org/not-downloaded": None,  # not in the (empty) hub cache: unknown
    }
    env = {"HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    args = [arg for model in expected for arg in ("--model", model)]
    with FrontDoor(*args, env=env) as front:
        rows = {row["path"]: row for row in front.models().values()}
        assert {path: row["weights_bytes"] for path, row in rows.items()} == expected
        assert rows["builtin:llama"]["weights_source"] == "built-in config"
        assert rows[str(directory)]["weights_source"] == "safetensors headers"
        assert all(row["state"] == "not_loaded" for row in rows.values())
        ps = _ps_rows(run_ctl(front.run_dir, "ps").stdout)
        assert (ps["dir-qwen3"][5], ps["builtin:llama"][5], ps["not-downloaded"][5]) == (
            "580.8 KiB",
            "417.2 KiB",
            "?",
        )
