"""vqpoolctl's read commands against a live vqpoold with two worker processes holding blocks:
text and --json output checked against the daemon's real state."""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path

import pytest
from ctl_harness import LivePool, ctl_json, run_ctl, run_ctl_each, session_hex


@pytest.fixture(scope="module")
def pool() -> Iterator[LivePool]:
    live = LivePool.start("--n-blocks", "256", "--lease", "5", spread=True)
    yield live
    live.stop()


def test_status_json_matches_the_daemon(pool: LivePool) -> None:
    status = ctl_json(pool.run_dir, "status")
    stats = pool.daemon.admin("stats")
    assert status["pid"] == pool.daemon.pid == stats["pid"]
    assert status["boot_id"] == stats["boot_id"]
    assert status["in_use"] == {"k": 3 + 1 + 7, "v": 3 + 7}
    assert status["streams"] == {"k": {"free": 117, "total": 128}, "v": {"free": 118, "total": 128}}
    assert status["stats"]["blocks_in_use"] == 21
    assert status["stats"]["fragmented_count"] == stats["stats"]["fragmented_count"] == 4
    assert status["models"] == {
        "alpha": {
            "sessions": 1,
            "blocks": {"k": 4, "v": 3},
            "bytes": {"k": 4 * 4096, "v": 3 * 4096},
            "bytes_total": 7 * 4096,
            "formats": {"fp16": {"blocks": 7, "bytes": 7 * 4096}},
            "running": None,  # the test workers never report their requests
            "queued": None,
            "prompt_cache": None,  # nor a prompt cache
        },
        "beta": {
            "sessions": 1,
            "blocks": {"k": 7, "v": 7},
            "bytes": {"k": 7 * 4096, "v": 7 * 4096},
            "bytes_total": 14 * 4096,
            "formats": {"fp16": {"blocks": 14, "bytes": 14 * 4096}},
            "running": None,
            "queued": None,
            "prompt_cache": None,
        },
    }
    assert status["uptime_s"] > 0


def test_status_text(pool: LivePool) -> None:
    result = run_ctl(pool.run_dir, "status")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    stats = pool.daemon.admin("stats")
    assert f"pid {pool.daemon.pid}" in out
    assert f"boot {stats['boot_id']}" in out
    assert str(pool.run_dir) in out
    assert "256 blocks x 16 tokens, streams k+v, no growth; lease 5s" in out
    rows = {
        line.split()[0]: line.split()[1:] for line in out.splitlines() if line[:2] in ("k ", "v ")
    }
    assert rows["k"] == ["11", "117", "128", "8.6%"]
    assert rows["v"] == ["10", "118", "128", "7.8%"]
    lines = out.splitlines()
    blocks_table = next(i for i, line in enumerate(lines) if line.startswith("MODEL  SESSIONS"))
    models = {line.split()[0]: line.split()[1:] for line in lines[blocks_table + 1 :][:2]}
    assert models == {
        "alpha": ["1", "4", "3", "28.0", "KiB", "-"],  # "-": no prompt cache reported
        "beta": ["1", "7", "7", "56.0", "KiB", "-"],
    }
    assert "fragmentation" in out and "4 partly filled blocks" in out


def test_sessions(pool: LivePool) -> None:
    sessions = {s["model"]: s for s in ctl_json(pool.run_dir, "sessions")}
    assert set(sessions) == {"alpha", "beta"}
    alpha, beta = sessions["alpha"], sessions["beta"]
    assert alpha["pid"] == pool.alpha.pid and beta["pid"] == pool.beta.pid
    assert alpha["session"] == session_hex(pool.alpha)
    assert alpha["blocks"] == {"k": 4, "v": 3} and beta["blocks"] == {"k": 7, "v": 7}
    assert alpha["bytes"] == {"k": 16384, "v": 12288} and beta["bytes_total"] == 14 * 4096
    assert alpha["n_owners"] == 2 and beta["n_owners"] == 1
    # Tokens per sequence: K and V hold the same 40 (a1) and 100 (7) tokens, counted once.
    assert alpha["tokens"] == 40 + 16 and beta["tokens"] == 100
    assert alpha["lease"]["state"] == "ok"

    result = run_ctl(pool.run_dir, "sessions")
    assert result.returncode == 0, result.stderr
    rows, legend = result.stdout.split("\n\n")
    assert legend.startswith("TOKENS: token slots per sequence marked used (K and V count once)")
    header, *lines = rows.splitlines()
    assert header.split()[:8] == [
        "SESSION",
        "PID",
        "MODEL",
        "PROCESS",
        "BLOCKS",
        "K",
        "BLOCKS",
        "V",
    ]
    by_model = {line.split()[2]: line.split() for line in lines}
    assert by_model["alpha"][:2] == [session_hex(pool.alpha), str(pool.alpha.pid)]
    assert by_model["alpha"][4:8] == ["4", "3", "28.0", "KiB"]
    assert by_model["beta"][4:10] == ["7", "7", "56.0", "KiB", "1", "100"]
    assert by_model["beta"][-1] == "ok"


def test_owners_all_and_per_session(pool: LivePool) -> None:
    owners = {o["owner"]: o for o in ctl_json(pool.run_dir, "owners")}
    assert set(owners) == {"a1", "a2", 7}
    assert owners["a1"]["blocks"] == {"k": 3, "v": 3} and owners["a1"]["tokens"] == 40
    assert owners["a1"]["fill"] == pytest.approx(40 / (3 * 16))
    assert owners["a2"]["fill"] == 1.0
    assert owners[7]["session"] == session_hex(pool.beta) and owners[7]["model"] == "beta"

    prefix = session_hex(pool.alpha)[:8]
    mine = ctl_json(pool.run_dir, "owners", "--session", prefix)
    assert sorted(o["owner"] for o in mine) == ["a1", "a2"]

    result = run_ctl(pool.run_dir, "owners", "--session", session_hex(pool.beta))
    assert result.returncode == 0, result.stderr
    rows, legend = result.stdout.split("\n\n")
    assert legend.startswith("TOKENS: token slots per sequence marked used")
    assert "\nFILL: TOKENS / the slots of the blocks held" in legend
    header, row = rows.splitlines()
    assert header.split() == [
        "OWNER",
        "SESSION",
        "PID",
        "MODEL",
        "BLOCKS",
        "K",
        "BLOCKS",
        "V",
        "TOKENS",
        "FILL",
    ]
    beta = [session_hex(pool.beta), str(pool.beta.pid), "beta"]
    assert row.split() == ["7", *beta, "7", "7", "100", "89.3%"]


def test_owners_of_an_unknown_session_is_refused(pool: LivePool) -> None:
    result = run_ctl(pool.run_dir, "owners", "--session", "fffffffffffffffff")
    assert result.returncode == 4
    assert result.stderr.strip() == (
        "vqpoolctl: no session fffffffffffffffff (see `vqpoolctl sessions`)"
    )
    result = run_ctl(pool.run_dir, "owners", "--session", "not-hex")
    assert result.returncode == 2 and "not a session id" in result.stderr


def test_history_table_json_and_plot(pool: LivePool, tmp_path: Path) -> None:
    png = tmp_path / "history.png"
    data = ctl_json(pool.run_dir, "history", "--plot", str(png))
    snapshots = data["snapshots"]
    assert snapshots == pool.daemon.admin("history")
    assert [s["n_allocations"] - s["n_frees"] for s in snapshots] == [3, 6, 7, 14, 21]
    timeline = data["timeline"]
    assert len(timeline) >= 3, timeline  # the pool grew over several 0.25 s ticks
    assert timeline[-1]["in_use"] == {"k": 11, "v": 10}
    assert timeline[-1]["total"] == {"k": 128, "v": 128}
    # Per model: blocks its workers hold, K and V counted apart (as the streams count them).
    assert timeline[-1]["models"] == {"alpha": 4 + 3, "beta": 7 + 7}
    held_by_beta = [t["models"].get("beta", 0) for t in timeline]
    assert held_by_beta[0] == 0 and held_by_beta == sorted(held_by_beta)  # beta came last
    in_use_totals = [sum(t["in_use"].values()) for t in timeline]
    assert in_use_totals == sorted(in_use_totals)  # only allocations happened
    assert [t["time"] for t in timeline] == sorted(t["time"] for t in timeline)

    raw = png.read_bytes()
    assert raw[:8] == b"\x89PNG\r\n\x1a\n" and raw[12:16] == b"IHDR"
    width, height = struct.unpack(">II", raw[16:24])
    assert (width, height) == (900, 450)
    import matplotlib.image

    pixels = matplotlib.image.imread(png)  # decodes the whole image
    assert pixels.shape[:2] == (450, 900) and pixels.std() > 0  # not a blank canvas

    result = run_ctl(pool.run_dir, "history", "--limit", "1", "--plot", str(png))
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == (
        f"wrote {png}: 1 samples over 0.0s; lines: k in use, k total, v in use, v total, "
        "alpha (blocks held), beta (blocks held)"
    )

    result = run_ctl(pool.run_dir, "history", "--limit", "2")
    assert result.returncode == 0, result.stderr
    header, *rows = result.stdout.splitlines()
    assert header.split()[:5] == ["#", "TIME", "BLOCKS", "IN", "USE"]
    cells = [row.split() for row in rows]
    assert [[c[0], *c[2:4]] for c in cells] == [["1", "256", "14"], ["2", "256", "21"]]


def test_metrics_text_and_json(pool: LivePool) -> None:
    result = run_ctl(pool.run_dir, "metrics")
    assert result.returncode == 0, result.stderr
    assert result.stdout == pool.daemon.admin("metrics")
    samples = ctl_json(pool.run_dir, "metrics")
    assert samples["veloxquant_block_pool_blocks_in_use"] == 21
    assert samples["veloxquant_block_pool_blocks_total"] == 256
    assert samples["veloxquant_block_pool_allocations_total"] == 21


def test_metrics_help_describes_the_metrics_in_the_users_terms(pool: LivePool) -> None:
    result = run_ctl(pool.run_dir, "help", "metrics")
    assert result.returncode == 0, result.stderr
    assert "seed" not in result.stdout
    for name in ("blocks_in_use", "allocations_total", "exhausted_total", "retired_total"):
        assert f"veloxquant_block_pool_{name}" in result.stdout


def test_metrics_help_says_why_two_name_prefixes_are_kept(tmp_path: Path) -> None:
    # Help needs no daemon: a run directory where none runs.
    result = run_ctl(tmp_path, "help", "metrics")
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())
    assert "Two name prefixes, on purpose" in text
    assert (
        "veloxquant_block_pool_* are the pool counters exactly as the VeloxQuant block pool" in text
    )
    assert (
        "everything vqpool adds (streams, models, budget, sessions, requests) is vqpool_*" in text
    )
    assert "Do not rename either set" in text


def test_help_comes_from_the_command_modules(pool: LivePool) -> None:
    from vqpool.daemon.ctl.commands import COMMANDS

    results = run_ctl_each(pool.run_dir, [["help", name] for name in COMMANDS] + [["help"]])
    for (name, module), result in zip(COMMANDS.items(), results, strict=False):
        assert result.returncode == 0, (name, result.stderr)
        first_line = (module.__doc__ or "").strip().splitlines()[0]
        assert first_line in result.stdout
        assert "exit codes:" in result.stdout
    listing = results[-1].stdout
    assert all(name in listing for name in COMMANDS)


def test_json_output_is_valid_for_every_read_command(pool: LivePool) -> None:
    commands = [["status"], ["sessions"], ["owners"], ["history"], ["metrics"], ["budget"]]
    for result in run_ctl_each(pool.run_dir, [[*command, "--json"] for command in commands]):
        assert result.returncode == 0, result.stderr
        json.loads(result.stdout)
