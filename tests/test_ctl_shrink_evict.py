"""vqpoolctl shrink and evict against a live vqpoold with two worker processes holding blocks:
shrink retires exactly the free blocks asked for and never one in use; evict frees a session's
blocks only when confirmed."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from ctl_harness import LivePool, ctl_json, run_ctl, run_ctl_each, session_hex
from daemon_harness import AgentError


@pytest.fixture
def pool() -> Iterator[LivePool]:
    live = LivePool.start("--n-blocks", "64", "--lease", "5")
    yield live
    live.stop()


def _held(pool: LivePool) -> dict[object, list[list[object]]]:
    return {
        "a1": pool.alpha.call("blocks_for", "a1"),
        "a2": pool.alpha.call("blocks_for", "a2"),
        7: pool.beta.call("blocks_for", 7),
    }


def test_shrink_retires_exactly_the_free_blocks_asked_for(pool: LivePool) -> None:
    held_before = _held(pool)
    # k: 32 blocks, 11 in use (alpha 4, beta 7), 21 free.
    result = run_ctl(pool.run_dir, "shrink", "--only-stream", "k", "--target-free", "5")
    assert result.returncode == 0, result.stderr
    assert (
        result.stdout.strip() == "stream k: retired 16 free block(s); now 5 free of 16 (11 in use)"
    )
    assert "warning: only stream k shrunk" in result.stderr
    streams = pool.daemon.admin("stats")["streams"]
    assert streams == {"k": {"free": 5, "total": 16}, "v": {"free": 22, "total": 32}}

    # Down to zero free: every remaining free block goes, no block in use does.
    results = ctl_json(pool.run_dir, "shrink", "--only-stream", "k", "--target-free", "0")
    assert results == [{"stream": "k", "retired": 5, "n_free": 0, "n_total": 11}]
    assert _held(pool) == held_before
    pool.daemon.audit()

    # Asking again retires nothing; asking for more free than there are retires nothing.
    assert (
        ctl_json(pool.run_dir, "shrink", "--only-stream", "k", "--target-free", "0")[0]["retired"]
        == 0
    )
    assert (
        ctl_json(pool.run_dir, "shrink", "--only-stream", "k", "--target-free", "50")[0]["retired"]
        == 0
    )

    # The workers still own and use their blocks: filling and freeing them works.
    pool.alpha.call("mark_used", [[pool.alpha.call("blocks_for", "a1")[2][0], 16]])
    pool.alpha.call("free_all", "a2")
    assert pool.daemon.admin("stats")["streams"]["k"] == {"free": 1, "total": 11}
    with pytest.raises(AgentError, match="BlockPoolExhaustedError"):
        pool.beta.call("allocate", "k", 32, 8)
    pool.daemon.audit()


def test_shrink_kv_shrinks_both_streams_of_a_split_pool(pool: LivePool) -> None:
    results = ctl_json(pool.run_dir, "shrink", "--stream", "kv", "--target-free", "2")
    assert results == [
        {"stream": "k", "retired": 19, "n_free": 2, "n_total": 13},
        {"stream": "v", "retired": 20, "n_free": 2, "n_total": 12},
    ]
    stats = pool.daemon.admin("stats")
    assert stats["stats"]["n_retired"] == 39 and stats["stats"]["blocks_in_use"] == 21
    pool.daemon.audit()


def test_shrink_one_stream_of_a_split_pool_shrinks_k_and_v_together(pool: LivePool) -> None:
    # A V block without its K block can never be used: --stream k shrinks both, and says so.
    result = run_ctl(pool.run_dir, "shrink", "--stream", "k", "--target-free", "2")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "stream k: retired 19 free block(s); now 2 free of 13 (11 in use)",
        "stream v: retired 20 free block(s); now 2 free of 12 (10 in use)",
    ]
    assert "shrinking k and v together" in result.stderr and "--only-stream" in result.stderr
    streams = pool.daemon.admin("stats")["streams"]
    assert streams == {"k": {"free": 2, "total": 13}, "v": {"free": 2, "total": 12}}
    pool.daemon.audit()


def test_shrink_bad_arguments_change_nothing(pool: LivePool) -> None:
    before = pool.daemon.admin("stats")["streams"]
    commands = [
        ["--stream", "x", "--target-free", "1"],
        ["--stream", "k", "--target-free", "-1"],
        ["--stream", "k", "--target-free", "many"],
        ["--stream", "k"],
        ["--stream", "k", "--only-stream", "k", "--target-free", "1"],
        ["--only-stream", "kv", "--target-free", "1"],
    ]
    results = run_ctl_each(pool.run_dir, [["shrink", *args] for args in commands])
    for args, result in zip(commands, results, strict=True):
        assert result.returncode == 2, (args, result.stderr)
        assert "Traceback" not in result.stderr
    assert pool.daemon.admin("stats")["streams"] == before


def test_evict_asks_first_and_frees_only_when_confirmed(pool: LivePool) -> None:
    beta = session_hex(pool.beta)
    declined = run_ctl(pool.run_dir, "evict", "--session", beta, stdin="n\n")
    assert declined.returncode == 5
    assert f"Evict session {beta} (pid {pool.beta.pid}, model 'beta'" in declined.stderr
    assert "free 14 block(s) (56.0 KiB) of 1 owner(s)? [y/N]" in declined.stderr
    no_answer = run_ctl(pool.run_dir, "evict", "--session", beta, stdin="")
    assert no_answer.returncode == 5
    assert len(pool.daemon.admin("sessions")) == 2

    confirmed = run_ctl(pool.run_dir, "evict", "--session", beta[:6], stdin="y\n")
    assert confirmed.returncode == 0, confirmed.stderr
    assert confirmed.stdout.strip() == (
        f"evicted session {beta} (pid {pool.beta.pid}): freed 14 block(s) of 1 owner(s)"
    )
    # Only the evicted session is gone: beta's heartbeat may already have opened a new (empty)
    # one, if it pinged between the eviction and this line.
    sessions = pool.daemon.admin("sessions")
    assert pool.beta.session_id not in {s["sid"] for s in sessions}
    assert [s["model"] for s in sessions if s["n_blocks"]] == ["alpha"]
    assert pool.daemon.admin("stats")["stats"]["blocks_in_use"] == 7
    # The evicted worker opens a new session by itself; its old owner is lost to it.
    with pytest.raises(AgentError, match="ClaimConflictError"):
        pool.beta.call("blocks_for", 7)
    pool.beta.call("allocate", "k", 16, 9)
    # The evicted owner id is free for another worker now.
    pool.alpha.call("allocate", "k", 16, 7)

    again = run_ctl(pool.run_dir, "evict", "--session", beta, "--yes")
    assert again.returncode == 4 and "no session" in again.stderr
    pool.daemon.audit()


def test_evict_yes_json(pool: LivePool) -> None:
    result = ctl_json(pool.run_dir, "evict", "--session", session_hex(pool.alpha), "--yes")
    assert result == {
        "sid": pool.alpha.session_id,
        "session": session_hex(pool.alpha),
        "pid": pool.alpha.pid,
        "owners_freed": 2,
        "blocks_freed": 7,
    }
    assert pool.daemon.admin("stats")["stats"]["blocks_in_use"] == 14
