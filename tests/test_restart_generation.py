"""An mlx-lm generation over pooled caches keeps going through a vqpoold SIGKILL and restart,
token for token and logprob for logprob the same as with mlx-lm's stock KVCache."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache
from vqpool.shared.admin_client import AdminClient
from vqpool.worker import PoolClient, make_pooled_cache
from vqpool.worker.models.tiny_models import build_tiny_model
from vqpool.worker.testing.launch import DaemonProcess

StartDaemon = Callable[..., DaemonProcess]
OPTIONS = ("--n-blocks", "512", "--lease", "1", "--claim-grace", "5")
# A budget and no --n-blocks: 1,024 ids at first (512 per stream), grown under load.
GROWN_OPTIONS = ("--budget", "8MiB", "--lease", "1", "--claim-grace", "5")
BLOCK_BYTES = 4096  # the tiny llama's, per stream and block of 16 slots (fp32)
N_NEW_TOKENS = 120
KILL_AT_STEP = 30


def generate(
    model: object, prompt: mx.array, cache: list[object], on_step: Callable[[int], None]
) -> tuple[list[int], mx.array]:
    tokens: list[int] = []
    logprobs: list[mx.array] = []
    for step, (token, lp) in enumerate(
        generate_step(prompt, model, max_tokens=N_NEW_TOKENS, prompt_cache=cache)  # type: ignore[arg-type]
    ):
        tokens.append(int(token))
        logprobs.append(lp)
        on_step(step)
    return tokens, mx.stack(logprobs)


@pytest.mark.parametrize("grown", [False, True], ids=["fixed-pool", "grown-pool"])
def test_pooled_caches_generate_through_a_daemon_restart(
    start_daemon: StartDaemon, grown: bool
) -> None:
    model = build_tiny_model("llama", seed=0)[0]
    prompt = mx.array([(i * 37 + 11) % 256 for i in range(40)])
    reference = generate(model, prompt, make_prompt_cache(model), lambda step: None)

    options = GROWN_OPTIONS if grown else OPTIONS
    daemon = start_daemon(*options)
    run_dir = daemon.run_dir
    restarted: list[DaemonProcess] = []

    def kill_and_restart_later(step: int) -> None:
        # Killed mid-generation; back only after a while, so the cache's next pool call (at a
        # block boundary) waits for it, retrying, and then meets the new boot id.
        if step == KILL_AT_STEP:
            daemon.stop(signal.SIGKILL)
            timer = threading.Timer(
                0.4, lambda: restarted.append(start_daemon(*options, run_dir=run_dir, wait=False))
            )
            timer.start()

    with contextlib.ExitStack() as stack:
        bytes_per_block = BLOCK_BYTES if grown else None
        pool = stack.enter_context(
            PoolClient(
                run_dir, name="through-restart", bytes_per_block=bytes_per_block, timeout=10.0
            )
        )
        filled: list[int] = []
        if grown:  # another client takes the first id space: the caches' ids are grown ones
            filler = stack.enter_context(
                PoolClient(run_dir, name="filler", bytes_per_block=BLOCK_BYTES, timeout=10.0)
            )
            for stream in ("k", "v"):
                filled += [b.block_id for b in filler.allocate(stream, 600 * 16, f"fill-{stream}")]
        other = make_pooled_cache(model, pool, "other")  # a second sequence, idle meanwhile
        generate(model, prompt[:20], other, lambda step: None)
        cache = make_pooled_cache(model, pool, "gen")
        tokens, logprobs = generate(model, prompt, cache, kill_and_restart_later)
        assert tokens == reference[0], "tokens differ from stock KVCache across the restart"
        assert len(set(tokens)) > len(tokens) // 4
        assert mx.array_equal(logprobs, reference[1]).item()
        assert len(pool.resyncs) == 1 and pool.resyncs[0]["owners_refused"] == 0
        assert pool.resyncs[0]["owners_claimed"] == 2
        if grown:
            assert min(b.block_id for b in cache.sequence.blocks()) >= 1024
            held = [b.block_id for owner in ("fill-k", "fill-v") for b in filler.blocks_for(owner)]
            assert held == filled and filler.lost_owners() == {}
        assert pool.boot_id == restarted[0].admin("ping")["boot_id"]
        # The restarted daemon holds exactly what the caches hold.
        for held in (cache, other):
            in_daemon = sorted(b.block_id for b in pool.blocks_for(held.owner))
            assert in_daemon == sorted(b.block_id for b in held.sequence.blocks())
        restarted[0].audit()
        cache.release()
        other.release()
    with AdminClient(run_dir) as admin:
        assert admin.call("audit")["blocks_in_use"] == 0
