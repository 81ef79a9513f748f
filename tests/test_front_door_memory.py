"""vqpool serve loading models by bytes (issue 25), through real processes: three test-written
models of different sizes, a budget computed from their real weights (their safetensors headers)
and KV (their configs), never guessed.

A running request is held open deterministically: a stream of far more tokens than the test
waits for, its first chunk read (so it runs at its worker), read further or closed by the test.
Its KV is bounded all the same (prompt plus max_tokens), and the budgets leave room for it.
"""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from ctl_harness import run_ctl
from daemon_harness import remove_tree, short_tmpdir, wait_until
from front_harness import FrontDoor
from test_front_door_swaps import Stream, gone, open_stream
from vqpool.daemon.ctl.exits import Exit
from vqpool.daemon.front.load_wait import (
    LOAD_WAIT_HEADER,
    MEMORY_WAIT_HEADER,
    RESIDENCY_WAIT_HEADER,
    LoadWait,
)
from vqpool.shared.byte_sizes import format_bytes
from vqpool.shared.kv_size import kv_token_bytes
from vqpool.shared.model_weights import estimate_weights, serve_cache_limit, worker_overhead
from vqpool.shared.pool import DEFAULT_BLOCK_SIZE
from vqpool.worker.testing.model_dirs import write_config_dir

HELD_TOKENS = 20000
"""max_tokens of a stream the test holds open: it never ends by itself within a test."""
PROMPT_TOKENS = 64
"""More than the held streams' prompt takes in tokens (a byte-level tokenizer: at most one per
byte)."""
LOAD_KV_TOKENS = 2 * DEFAULT_BLOCK_SIZE
"""The KV room each load asks for here (``load_kv_tokens``): two blocks, far below the
weights, so a budget's arithmetic is the weights'."""
SLACK = 1 << 20
"""Room in a budget beyond what the test counts (a prompt cache's partial blocks): far less than
the smallest model's weights, so a budget for two models never holds three."""

_ARGS = {
    "model_type": "llama",
    "hidden_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 32768,
    "tie_word_embeddings": False,
}
SIZES = {"small": 2048, "medium": 3072, "large": 4096}
"""Each model's MLP width: weights of about 14, 20 and 26 MiB in fp16, with the same small KV
per token (one KV head of 16 in two layers), so a held stream's KV is far below any weights."""


@pytest.fixture(scope="module")
def models() -> Iterator[dict[str, Path]]:
    base = short_tmpdir("vqw")
    yield {
        name: write_config_dir(
            base / name, {**_ARGS, "intermediate_size": width}, seed=i, dtype=mx.float16
        )
        for i, (name, width) in enumerate(SIZES.items())
    }
    remove_tree(base)


def weights(path: Path) -> int:
    estimate = estimate_weights(str(path))
    assert estimate is not None
    return estimate.nbytes


def kv_bytes(path: Path, tokens: int) -> int:
    """The KV of ``tokens`` tokens of the model at ``path``, in whole blocks."""
    per_token = kv_token_bytes(str(path))
    assert per_token is not None
    return math.ceil(tokens / DEFAULT_BLOCK_SIZE) * DEFAULT_BLOCK_SIZE * per_token


def overhead(path: Path) -> int:
    """The overhead the front door charges beside the weights: its worker's MLX buffer-cache
    limit and its runtime's growth."""
    return worker_overhead(serve_cache_limit(weights(path)))


def load_need(path: Path) -> int:
    """What a load of the model at ``path`` asks the ledger for: its weights, its worker's
    overhead and its KV minimum (no reserve configured)."""
    return weights(path) + overhead(path) + kv_bytes(path, LOAD_KV_TOKENS)


def held_stream_kv(path: Path) -> int:
    return kv_bytes(path, PROMPT_TOKENS + HELD_TOKENS + DEFAULT_BLOCK_SIZE)


def config_for(
    models: dict[str, Path],
    budget: int,
    queue_timeout: float = 120,
    conversation_gap: float | None = None,
) -> str:
    """A settings file serving ``models`` under ``budget``; an idle model may be unloaded for
    bytes as soon as it is loaded (no minimum residency)."""
    tables = "".join(f'[models."{name}"]\npath = "{path}"\n\n' for name, path in models.items())
    serve = (
        f"budget = {budget}\nmin_residency = 0\nqueue_timeout = {queue_timeout}\n"
        f"load_kv_tokens = {LOAD_KV_TOKENS}\n"
    )
    if conversation_gap is not None:
        serve += f"conversation_gap = {conversation_gap}\n"
    return f"[serve]\n{serve}\n{tables}"


def hold(front: FrontDoor, model: str) -> Stream:
    """A stream that runs until the test closes it: the model may not end it with its EOS."""
    eos = json.loads((Path(front.row(model)["path"]) / "config.json").read_text())["eos_token_id"]
    return open_stream(front, model, HELD_TOKENS, logit_bias={str(eos): -100})


def read_on(stream: Stream, chunks: int) -> None:
    """Read ``chunks`` more chunks of a held stream: it still generates, with no error."""
    _, events = stream
    for _ in range(chunks):
        event = next(events)
        assert "error" not in event and event["choices"][0]["finish_reason"] is None, event


def close(stream: Stream) -> None:
    stream[1].close()


class Sampler:
    """Samples, in a thread, the rows, the daemon's sessions, its budget's totals and
    ``probe()`` (read last) until stopped: what must hold at every moment is checked on every
    sample."""

    def __init__(self, front: FrontDoor, probe: Callable[[], Any] = lambda: None) -> None:
        self.front = front
        self.probe = probe
        self.samples: list[dict[str, Any]] = []
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run)

    def _run(self) -> None:
        while not self._done.is_set():
            self._sample()
        self._sample()  # one once stopped: after all the test waited for

    def _sample(self) -> None:
        rows = self.front.models()
        sessions = [s["model"] for s in self.front.admin("sessions")]
        totals = self.front.admin("budget")
        self.samples.append(
            {"rows": rows, "sessions": sessions, "totals": totals, "probe": self.probe()}
        )

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._done.set()
        self._thread.join()
        for sample in self.samples:
            totals = sample["totals"]
            assert totals["total_held"] + totals["total_weights"] <= totals["budget"], totals
            sessions = sample["sessions"]
            assert len(sessions) == len(set(sessions)), sessions  # never loaded twice


def test_a_load_that_can_never_fit_is_refused_at_once_with_the_numbers(
    models: dict[str, Path],
) -> None:
    budget = load_need(models["medium"]) + SLACK
    assert load_need(models["large"]) > budget
    with FrontDoor(config=config_for(models, budget)) as front:
        assert front.complete("medium").status == 200
        with ThreadPoolExecutor(3) as pool:
            replies = list(pool.map(lambda _: front.complete("large"), range(3)))
        for reply in replies:
            assert reply.status == 400, reply.body
            message = reply.body["error"]["message"]
            assert message.startswith("loading large needs") and "never fit" in message
        rows = front.models()
        assert rows["large"]["state"] == "not_loaded" and rows["large"]["loads"] == 0
        assert rows["large"]["load_failures"] == 0 and rows["large"]["refusals"] >= 1
        # Nothing was freed for it: the medium model stays loaded, no large worker started.
        assert rows["medium"]["state"] == "loaded" and rows["medium"]["unloads"] == {}
        assert [s["model"] for s in front.admin("sessions")] == ["medium"]


def test_a_load_short_of_bytes_unloads_the_idle_model_never_the_running_one(
    models: dict[str, Path],
) -> None:
    large, medium, small = models["large"], models["medium"], models["small"]
    budget = load_need(large) + held_stream_kv(large) + load_need(medium) + SLACK
    assert budget < load_need(large) + weights(medium) + load_need(small)
    with FrontDoor(config=config_for(models, budget)) as front:
        stream = hold(front, "large")
        large_pid = front.row("large")["pid"]
        assert front.complete("medium").status == 200
        medium_pid = front.row("medium")["pid"]
        with Sampler(front, probe=lambda: gone(medium_pid)) as sampler:
            reply = front.complete("small")
        assert reply.status == 200, reply.body
        read_on(stream, 20)  # the running stream kept going
        rows = front.models()
        assert rows["large"]["state"] == "loaded"
        assert rows["large"]["pid"] == large_pid
        assert rows["large"]["running"] == 1 and rows["large"]["unloads"] == {}
        assert rows["medium"]["state"] == "not_loaded"
        assert rows["medium"]["unloads"] == {"memory": 1}
        assert rows["small"]["state"] == "loaded" and rows["small"]["loads"] == 1
        # The unload counted only once its process had exited and its session had left: read
        # after the rows, both hold whenever the small model was seen loading.
        seen_loading = [
            sample
            for sample in sampler.samples
            if sample["rows"]["small"]["state"] in ("loading", "loaded")
        ]
        assert seen_loading
        for sample in seen_loading:
            assert "medium" not in sample["sessions"] and sample["probe"] is True, sample
        close(stream)


def test_a_load_unloads_only_an_idle_model_that_makes_room_and_charges_the_overhead(
    models: dict[str, Path],
) -> None:
    """An idle model whose unload could not make room stays loaded (unloaded, it would only be
    reloaded into the bytes it freed); the load waits until an idle model that covers what it
    lacks is there, unloads that one, and each worker's overhead is charged beside its
    weights."""
    large, medium, small = models["large"], models["medium"], models["small"]
    budget = max(load_need(large), load_need(medium) + held_stream_kv(medium))
    budget += load_need(small) + SLACK
    with FrontDoor(config=config_for(models, budget)) as front:
        assert front.complete("small").status == 200  # the least recently used
        stream = hold(front, "medium")
        for name, path in (("small", small), ("medium", medium)):
            assert front.row(name)["overhead_bytes"] == overhead(path)
            row = next(r for r in front.admin("model_list")["models"] if r["model"] == name)
            assert (row["weights"], row["overhead"]) == (weights(path), overhead(path))
        totals = front.admin("budget")
        assert totals["total_overhead"] == overhead(small) + overhead(medium)
        # The small model's unload frees less than the large one lacks.
        assert totals["free"] + load_need(small) < load_need(large)
        with ThreadPoolExecutor(1) as pool:
            reply = pool.submit(front.complete, "large")
            front.wait_state("large", "waiting_for_memory")
            read_on(stream, 5)
            close(stream)  # the medium model goes idle, and its unload covers the load
            assert reply.result(timeout=60).status == 200
        rows = front.models()
        assert rows["medium"]["state"] == "not_loaded"
        assert rows["medium"]["unloads"] == {"memory": 1}
        assert rows["small"]["state"] == "loaded" and rows["small"]["unloads"] == {}
        assert rows["small"]["loads"] == rows["large"]["loads"] == 1


def test_a_load_unloads_the_least_asked_for_idle_model_not_the_least_recently_used(
    models: dict[str, Path],
) -> None:
    """A model asked often stays loaded over one asked once, though it was used longer ago:
    by recency alone, a hot model idle between two bursts would go."""
    large, medium, small = models["large"], models["medium"], models["small"]
    budget = load_need(large) + max(load_need(small), load_need(medium)) + SLACK
    with FrontDoor(config=config_for(models, budget)) as front:
        for _ in range(3):
            assert front.complete("small").status == 200
        assert front.complete("medium").status == 200  # the most recently used
        assert front.complete("large").status == 200
        rows = front.models()
        assert rows["medium"]["state"] == "not_loaded"
        assert rows["medium"]["unloads"] == {"memory": 1}
        assert rows["small"]["state"] == "loaded" and rows["small"]["unloads"] == {}


def test_a_load_unloads_an_idle_model_out_of_conversation_before_one_mid_conversation(
    models: dict[str, Path],
) -> None:
    """A model whose last request ended within ``conversation_gap`` (its chat's next turn is
    likely soon) stays loaded over one idle for longer, though it is the less asked for."""
    large, medium, small = models["large"], models["medium"], models["small"]
    budget = load_need(large) + max(load_need(small), load_need(medium)) + SLACK
    gap = 15.0
    with FrontDoor(config=config_for(models, budget, conversation_gap=gap)) as front:
        for _ in range(3):
            assert front.complete("small").status == 200  # the more asked for
        wait_until(lambda: (front.row("small")["idle_s"] or 0.0) >= gap, timeout=60)
        assert front.complete("medium").status == 200  # mid-conversation from here
        reply = front.complete("large")
        assert reply.status == 200, reply.body
        rows = front.models()
        # It waited for its load, and before its worker started for an unload (no model was
        # inside a residency: there is none).
        waited = {h: float(reply.headers[h.lower()]) for h in LoadWait().headers()}
        assert waited[LOAD_WAIT_HEADER] >= waited[MEMORY_WAIT_HEADER] > 0, waited
        assert waited[RESIDENCY_WAIT_HEADER] == 0, waited
        loaded = front.complete("large")
        assert all(loaded.headers[h.lower()] == "0.000" for h in waited), loaded.headers
        # The premise: the unload for the large model was chosen within the gap after the
        # medium model's request ended (the unload starts after the choice).
        assert rows["small"]["unloaded_at"] - rows["medium"]["last_used"] < gap, rows
        assert rows["small"]["state"] == "not_loaded"
        assert rows["small"]["unloads"] == {"memory": 1}
        assert rows["medium"]["state"] == "loaded" and rows["medium"]["unloads"] == {}


def test_a_load_spares_a_model_mid_conversation_for_as_long_as_its_reload_would_take(
    models: dict[str, Path],
) -> None:
    """While another loaded model may go idle instead (here a running stream), a load waits
    before unloading an idle model mid-conversation, at most as long as that model's last load
    took (what its chat's next turn would wait for its reload); then it unloads it, and never
    the model with the running request."""
    large, medium, small = models["large"], models["medium"], models["small"]
    budget = load_need(small) + held_stream_kv(small) + load_need(large) + SLACK
    assert budget < load_need(small) + load_need(medium) + load_need(large)
    config = config_for(models, budget, conversation_gap=3600)  # always mid-conversation
    with FrontDoor(config=config) as front:
        stream = hold(front, "small")
        assert front.complete("medium").status == 200
        reload_seconds = front.row("medium")["last_load_s"]
        reply = front.complete("large")
        assert reply.status == 200, reply.body
        assert float(reply.headers[MEMORY_WAIT_HEADER.lower()]) >= reload_seconds
        read_on(stream, 20)  # the running stream kept going
        rows = front.models()
        assert rows["medium"]["state"] == "not_loaded"
        assert rows["medium"]["unloads"] == {"memory": 1}
        assert rows["small"]["running"] == 1 and rows["small"]["unloads"] == {}
        close(stream)


def test_three_concurrent_loads_under_a_budget_for_two_load_two_and_queue_one(
    models: dict[str, Path],
) -> None:
    names = list(models)
    largest_two = sorted(load_need(p) + held_stream_kv(p) for p in models.values())[1:]
    budget = sum(largest_two) + SLACK
    assert budget < sum(load_need(p) for p in models.values())
    with FrontDoor(config=config_for(models, budget)) as front, Sampler(front) as sampler:
        with ThreadPoolExecutor(len(names)) as pool:
            opening: dict[str, Future[Stream]] = {n: pool.submit(hold, front, n) for n in names}

            def two_running_one_waiting() -> bool:
                rows = front.models()
                running = [n for n in names if rows[n]["state"] == "loaded" and rows[n]["running"]]
                waiting = [n for n in names if rows[n]["state"] == "waiting_for_memory"]
                return len(running) == 2 and len(waiting) == 1 and rows[waiting[0]]["queued"] == 1

            wait_until(two_running_one_waiting, timeout=60)
            rows = front.models()
            waiting = next(n for n in names if rows[n]["state"] == "waiting_for_memory")
            first, second = (n for n in names if n != waiting)
            assert rows[waiting]["memory_wait"].startswith(f"loading {waiting} needs")
            assert sorted(s["model"] for s in front.admin("sessions")) == sorted([first, second])
            assert not opening[waiting].done()
            ended = opening[first].result(timeout=5)
            close(ended)  # its model goes idle: the waiting load unloads it, not the other
            held = opening[waiting].result(timeout=60)
            kept = opening[second].result(timeout=5)
        read_on(kept, 20)
        read_on(held, 5)
        rows = front.models()
        assert rows[first]["state"] == "not_loaded" and rows[first]["unloads"] == {"memory": 1}
        assert rows[second]["unloads"] == {} and rows[second]["running"] == 1
        assert rows[waiting]["state"] == "loaded"
        assert [rows[n]["loads"] for n in names] == [1, 1, 1]  # none loaded twice
        close(kept)
        close(held)
    for sample in sampler.samples:
        loaded = [n for n, r in sample["rows"].items() if r["state"] in ("loading", "loaded")]
        assert len(loaded) <= 2, sample["rows"]


def test_a_lowered_budget_unloads_the_least_recently_used_idle_model(
    models: dict[str, Path],
) -> None:
    small, medium = models["small"], models["medium"]
    with FrontDoor(config=config_for({"small": small, "medium": medium}, 1 << 30)) as front:
        assert front.complete("small").status == 200
        assert front.complete("medium").status == 200
        front.admin("budget", bytes=load_need(medium) + SLACK)
        row = front.wait_state("small", "not_loaded", timeout=30)
        assert row["unloads"] == {"budget": 1}
        assert front.row("medium")["state"] == "loaded"
        totals = front.admin("budget")
        assert totals["total_held"] + totals["total_weights"] <= totals["budget"]


def test_a_request_waiting_for_kv_unloads_an_idle_model(models: dict[str, Path]) -> None:
    """Bytes are freed in the same order for a loaded model's request as for a load: a prompt
    whose KV the free bytes cannot hold waits at vqpoold, and the idle model goes for it."""
    small, medium = models["small"], models["medium"]
    room = kv_bytes(medium, 4 * DEFAULT_BLOCK_SIZE)
    budget = load_need(small) + load_need(medium) + room
    with FrontDoor(config=config_for({"small": small, "medium": medium}, budget)) as front:
        assert front.complete("small").status == 200
        assert front.complete("medium").status == 200
        prompt = "a" * 1024  # at most a token per byte: far more KV than the free room
        reply = front.complete("medium", prompt=prompt, max_tokens=2)
        assert reply.status == 200, reply.body
        assert kv_bytes(medium, reply.body["usage"]["prompt_tokens"]) > room + kv_bytes(
            medium, LOAD_KV_TOKENS
        )
        rows = front.models()
        assert rows["small"]["state"] == "not_loaded"
        assert rows["small"]["unloads"] == {"memory": 1}
        assert rows["medium"]["state"] == "loaded" and rows["medium"]["unloads"] == {}


def test_fit_counts_the_weights_of_a_model_not_loaded_and_names_the_unload(
    models: dict[str, Path],
) -> None:
    small, medium, large = models["small"], models["medium"], models["large"]
    budget = load_need(large) + load_need(medium) + SLACK
    with FrontDoor(config=config_for(models, budget)) as front:
        assert front.complete("small").status == 200
        assert front.complete("medium").status == 200
        fit = run_ctl(front.run_dir, "fit", "--model", "large", "--context", "32")
        as_json = run_ctl(front.run_dir, "fit", "--model", "large", "--context", "32", "--json")
        assert fit.returncode == as_json.returncode == Exit.FIT_AFTER_OTHERS_RETURN, fit.stderr
        answer = json.loads(as_json.stdout)
        assert answer["weights"] == weights(large)
        assert answer["need"] == kv_bytes(large, 32)
        assert set(answer["models"]) == {"small", "medium"}
        freed = answer["models"]["small"]
        assert freed["idle"] and freed["weights"] == weights(small)
        assert answer["overhead"] == overhead(large) and freed["overhead"] == overhead(small)
        # The least recently used idle model is the one named; its unload is enough.
        fb = format_bytes
        assert fit.stdout.splitlines()[-1] == (
            f"loading large needs {fb(weights(large))} of weights, {fb(overhead(large))} of "
            f"overhead and {fb(kv_bytes(large, 32))} of KV; {fb(answer['free'])} free now; "
            f"unloading idle small ({fb(freed['weights'] + freed['overhead'] + freed['held'])}) "
            "makes it fit"
        )
        # Asking loaded and unloaded nothing.
        assert sorted(s["model"] for s in front.admin("sessions")) == ["medium", "small"]


def test_a_load_waiting_for_memory_past_its_timeout_gets_a_503_with_the_numbers(
    models: dict[str, Path],
) -> None:
    small, medium = models["small"], models["medium"]
    budget = load_need(medium) + held_stream_kv(medium) + SLACK
    assert budget < load_need(medium) + load_need(small)
    config = config_for({"small": small, "medium": medium}, budget, queue_timeout=3)
    with FrontDoor(config=config) as front:
        front.control(timeout=90).load("medium", 60)  # its load outlasts the queue timeout
        stream = hold(front, "medium")
        reply = front.complete("small")
        assert reply.status == 503, reply.body
        message = reply.body["error"]["message"]
        assert message.startswith("small is still waiting for memory (loading small needs ")
        assert f"{format_bytes(weights(small))} of weights" in message
        read_on(stream, 5)  # never preempted for it
        assert front.wait_state("small", "not_loaded")["loads"] == 0  # its wait given up
        rows = front.models()
        assert rows["medium"]["running"] == 1 and rows["medium"]["unloads"] == {}
        close(stream)
