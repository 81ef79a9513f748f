#!/usr/bin/env python3
"""Speculative decoding: vqpool-worker with and without ``--draft-model`` against mlx_lm.server
with and without the same draft model, in one run.

Builds the medium model directory of ``bench_vs_mlx_server.py`` (hidden 1024 x 8 layers, bf16,
random weights, its EOS never emitted) and a draft model directory with the same tokenizer
(``--draft small``: hidden 256 x 4 layers, fp32; ``--draft self``: the medium model itself,
whose drafts are all accepted: an upper bound for the acceptance, not a useful draft). Each
round starts the four servers (vqpool-worker on a private vqpoold, mlx_lm.server; each with and
without the draft), warms each up with a short request, then sends them the same prompts one
request at a time (mlx_lm.server serves draft requests one at a time, and so does the worker),
the order of the four rotating from prompt to prompt so that the four answers to one prompt come
within seconds of each other on this shared machine, and stops them.

Per request, client side: decode tokens/s (completion tokens after the first / time from the
first token to the last) and the text (greedy: all four must give the same text for a prompt).
Reported: medians over requests per server with min to max, and the ratios draft / no draft of
each server and vqpool / mlx_lm.server with the draft (medians of the per-prompt ratios, min to
max), with the worker's share of tokens that came from accepted drafts (``/v1/stats``).

    .venv/bin/python scripts/bench_draft.py                    # small draft, 2 rounds x 3 prompts
    .venv/bin/python scripts/bench_draft.py --draft self --rounds 1
    .venv/bin/python scripts/bench_draft.py --quick            # a smoke run on tiny models
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bench_vs_mlx_server import (
    MODELS,
    READY_TIMEOUT,
    REQUEST_TIMEOUT,
    MlxLmServer,
    make_prompts,
    never_emit_eos,
)
from vqpool.worker.testing.http_client import request_json, stream_events
from vqpool.worker.testing.launch import DaemonProcess, WorkerProcess
from vqpool.worker.testing.model_dirs import write_config_dir

SERVERS = ("vqpool", "vqpool + draft", "mlx_lm.server", "mlx_lm.server + draft")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--draft", choices=["small", "self"], default="small",
        help="the draft model: the small model directory, or the medium model itself",
    )  # fmt: skip
    parser.add_argument("--rounds", type=int, default=2, help="rounds (default: 2)")
    parser.add_argument("--prompts", type=int, default=3, help="prompts per round (default: 3)")
    parser.add_argument(
        "--max-tokens", type=int, default=32, help="tokens generated per request (default: 32)"
    )
    parser.add_argument(
        "--num-draft-tokens", type=int, default=3, help="draft tokens per round (default: 3)"
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="prompts of round r are drawn with seed + r"
    )
    parser.add_argument(
        "--quick", action="store_true",
        help="a smoke run: tiny model, itself as the draft, 1 round of 1 prompt, 8 tokens",
    )  # fmt: skip
    args = parser.parse_args()
    args.model = "medium"
    if args.quick:
        args.model, args.draft, args.rounds, args.prompts, args.max_tokens = (
            "tiny", "self", 1, 1, 8
        )  # fmt: skip
    if min(args.rounds, args.prompts, args.max_tokens) < 1 or args.num_draft_tokens < 0:
        parser.error("--rounds, --prompts and --max-tokens must be >= 1")
    return args


# -- servers --------------------------------------------------------------------------------------


def start_servers(
    model_dir: Path, draft_dir: Path, n_draft: int, base: Path, run_dir: Path
) -> dict[str, tuple[str, Callable[[], object]]]:
    """The four servers, started at once, then awaited: name -> (url, stop)."""
    draft_args = ["--draft-model", str(draft_dir), "--num-draft-tokens", str(n_draft)]
    mlx = {
        "mlx_lm.server": MlxLmServer(model_dir, base / "mlx.log"),
        "mlx_lm.server + draft": MlxLmServer(model_dir, base / "mlx-d.log", draft_args),
    }
    workers = {
        "vqpool": WorkerProcess(
            str(model_dir), base / "w.log", run_dir=run_dir, args=["--log-level", "WARNING"]
        ),
        "vqpool + draft": WorkerProcess(
            str(model_dir),
            base / "w-d.log",
            run_dir=run_dir,
            args=[*draft_args, "--log-level", "WARNING"],
        ),
    }
    servers: dict[str, tuple[str, Callable[[], object]]] = {}
    try:
        for worker in workers.values():
            worker.start(wait=False)
        for name, worker in workers.items():
            worker.wait_ready(READY_TIMEOUT)
            servers[name] = (worker.url, worker.stop)
        for name, server in mlx.items():
            server.wait_ready()
            servers[name] = (server.url, server.stop)
    except BaseException:
        for worker in workers.values():
            worker.stop()
        for server in mlx.values():
            server.stop()
        raise
    return servers


# -- requests -------------------------------------------------------------------------------------


@dataclass
class Answer:
    """One streamed request: its text and its decode rate."""

    text: str
    completion_tokens: int
    decode_tokens_per_s: float


def ask(url: str, prompt: str, max_tokens: int) -> Answer:
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    first: float | None = None
    pieces: list[str] = []
    usage: dict[str, int] = {}
    for event in stream_events(url, "/v1/completions", body, timeout=REQUEST_TIMEOUT):
        for choice in event.get("choices") or []:
            if choice.get("text"):
                first = first if first is not None else time.perf_counter()
                pieces.append(choice["text"])
        usage = event.get("usage") or usage
    done = time.perf_counter()
    n = usage["completion_tokens"]
    rate = (n - 1) / (done - first) if first is not None and n > 1 and done > first else 0.0
    return Answer("".join(pieces), n, rate)


def accepted_share(url: str) -> float:
    stats = request_json(url, "GET", "/v1/stats").body
    return stats["draft_accepted"] / max(1, stats["completion_tokens"])


# -- report ---------------------------------------------------------------------------------------


def spread(values: list[float], digits: int = 2) -> str:
    return (
        f"{statistics.median(values):.{digits}f} "
        f"({min(values):.{digits}f} to {max(values):.{digits}f})"
    )


def report(answers: dict[str, list[Answer]], shares: list[float], args: argparse.Namespace) -> None:
    print(
        f"\n{args.model} model, draft {args.draft}, {args.num_draft_tokens} draft tokens per "
        f"round, {args.max_tokens} tokens per request, {len(answers['vqpool'])} requests per "
        "server\n"
    )
    print("| server | decode tok/s, median (min to max) |")
    print("|---|---|")
    for name in SERVERS:
        print(f"| {name} | {spread([a.decode_tokens_per_s for a in answers[name]])} |")

    def ratios(top: str, bottom: str) -> list[float]:
        return [
            a.decode_tokens_per_s / b.decode_tokens_per_s
            for a, b in zip(answers[top], answers[bottom], strict=True)
            if b.decode_tokens_per_s > 0
        ]

    print("\n| ratio (per prompt) | median (min to max) |")
    print("|---|---|")
    print(f"| vqpool + draft / vqpool | {spread(ratios('vqpool + draft', 'vqpool'))}x |")
    mlx_gain = ratios("mlx_lm.server + draft", "mlx_lm.server")
    print(f"| mlx_lm.server + draft / mlx_lm.server | {spread(mlx_gain)}x |")
    print(
        "| vqpool + draft / mlx_lm.server + draft | "
        f"{spread(ratios('vqpool + draft', 'mlx_lm.server + draft'))}x |"
    )
    print(f"| vqpool / mlx_lm.server | {spread(ratios('vqpool', 'mlx_lm.server'))}x |")
    same = sum(
        len({answers[name][i].text for name in SERVERS}) == 1 for i in range(len(answers["vqpool"]))
    )
    print(f"\nidentical text on all four servers: {same}/{len(answers['vqpool'])} prompts")
    for i in range(len(answers["vqpool"])):
        groups: dict[str, list[str]] = {}
        for name in SERVERS:
            groups.setdefault(answers[name][i].text, []).append(name)
        if len(groups) > 1:
            print(f"request {i + 1}: texts differ: " + " | ".join(map(", ".join, groups.values())))
            for text, names in groups.items():
                print(f"  {', '.join(names)}: {text!r}")
    print(
        f"tokens from accepted drafts (vqpool + draft, per round): {[round(s, 3) for s in shares]}"
    )


def main() -> int:
    args = parse_args()
    base = Path(tempfile.mkdtemp(prefix="vqdraft", dir="/tmp"))
    try:
        model_args, dtype = MODELS[args.model]
        model_dir = write_config_dir(base / args.model, model_args, 0, dtype)
        never_emit_eos(model_dir)
        if args.draft == "self":
            draft_dir = model_dir
        else:
            draft_args, draft_dtype = MODELS["small"]
            draft_dir = write_config_dir(base / "draft", draft_args, 1, draft_dtype)
        answers: dict[str, list[Answer]] = {name: [] for name in SERVERS}
        shares: list[float] = []
        for round_index in range(args.rounds):
            prompts = make_prompts(model_dir, args.prompts, 32, seed=args.seed + round_index)
            logs = base / f"round{round_index}"  # new logs: a worker's ready line is read there
            logs.mkdir()
            with DaemonProcess(logs / "run") as daemon:  # entering starts it
                servers = start_servers(
                    model_dir, draft_dir, args.num_draft_tokens, logs, daemon.run_dir
                )
                try:
                    for url, _ in servers.values():
                        ask(url, "warm up", 2)
                    for i, prompt in enumerate(prompts):
                        order = SERVERS[i % 4 :] + SERVERS[: i % 4]
                        for name in order:
                            answers[name].append(ask(servers[name][0], prompt, args.max_tokens))
                        print(
                            f"round {round_index + 1} prompt {i + 1}: "
                            + ", ".join(
                                f"{n} {answers[n][-1].decode_tokens_per_s:.2f}" for n in SERVERS
                            ),
                            flush=True,
                        )
                    shares.append(accepted_share(servers["vqpool + draft"][0]))
                finally:
                    for _, stop in servers.values():
                        stop()
        report(answers, shares, args)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
