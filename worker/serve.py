"""``vqpool-worker``: serve one mlx-lm model over HTTP with its KV cache drawn from vqpoold's pool.

    vqpool-worker --model MODEL --port PORT [--served-model-name NAME] [--run-dir DIR]
                  [--max-concurrent N] [--queue-timeout S] [--max-queue N] [--no-pool]
                  [--prompt-cache-bytes SIZE]

``MODEL`` is a Hugging Face id or a local path (``mlx_lm.load``), or ``builtin:NAME`` for a tiny
offline model (see :mod:`vqpool.worker.models`). The pool is a ``PoolClient`` session on the
daemon of ``--run-dir`` / ``VQPOOL_RUN_DIR`` / the default run directory; ``--no-pool`` serves
from stock mlx-lm caches through the same code path instead (the benchmark's baseline).
``--served-model-name`` is the id clients see and send (default: ``MODEL`` as given).

The port is bound, the model argument checked and the daemon's socket looked for before the
model loads, so each of those mistakes is one line at once, not found after a long load.

Once it serves, it prints one line to stdout, ``vqpool-worker: serving NAME on
http://HOST:PORT (...)``, with the real port when ``--port 0``. SIGTERM or SIGINT stops it
cleanly: the server stops accepting, every running or queued request ends (its blocks go
back), the pool session says goodbye, MLX's streams are destroyed, exit status 0. Exit status
2 for bad options, a ``--model`` that names no model (one line: what is wrong, what to pass) or
a model the pooled cache cannot serve; 1 when the daemon is not running or does not answer, or
the port is taken.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from types import FrameType
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from vqpool.shared.byte_sizes import parse_bytes
from vqpool.shared.config import WORKER_SOCKET_NAME, resolve_run_dir, socket_path
from vqpool.shared.errors import DaemonUnavailableError
from vqpool.shared.protocol import session_label
from vqpool.worker.batch_cache import DEFAULT_GROWTH_WAIT, MAX_GROWTH_WAIT
from vqpool.worker.batch_probe import batching_problem
from vqpool.worker.cache_source import CacheSource, PooledCacheSource, StockCacheSource
from vqpool.worker.client import PoolClient
from vqpool.worker.http_api import ServingApp, ServingServer, make_server
from vqpool.worker.models import builtin_names, load_model, model_spec_problem
from vqpool.worker.prompt_cache import DEFAULT_MAX_BYTES, PromptCache
from vqpool.worker.scheduler import DEFAULT_PREFILL_STEP_SIZE, RESERVE_MODES, Scheduler
from vqpool.worker.storage import KVLayout

log = logging.getLogger("vqpool.worker")

MAX_OWNER_PREFIX_CHARS = 96
"""Owner ids are ``{model}-{pid}-{n}`` and the daemon takes ids of up to 128 characters."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vqpool-worker",
        description="Serve one mlx-lm model (OpenAI-style HTTP API) with its KV cache drawn "
        "from the shared vqpoold pool.",
        epilog="built-in models: " + ", ".join(f"builtin:{n}" for n in builtin_names()),
    )
    parser.add_argument(
        "--model", required=True, help="Hugging Face id, local path, or builtin:NAME"
    )
    parser.add_argument(
        "--served-model-name",
        metavar="NAME",
        help="the model id clients see in /v1/models and send as model (default: --model as "
        "given; requests naming that are accepted too)",
    )
    parser.add_argument("--port", type=int, required=True, help="HTTP port (0: any free port)")
    parser.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default: %(default)s)"
    )
    parser.add_argument(
        "--run-dir", help="vqpoold's run directory (env VQPOOL_RUN_DIR; default as for vqpoold)"
    )
    parser.add_argument(
        "--max-concurrent",
        type=int,
        default=4,
        metavar="N",
        help="requests decoding at once (default: %(default)s), in one batch",
    )
    parser.add_argument(
        "--prefill-step-size",
        type=int,
        default=DEFAULT_PREFILL_STEP_SIZE,
        metavar="N",
        help="prompt tokens per prefill chunk, as mlx-lm's: the longest a newcomer's prefill "
        "delays the running requests' next tokens (default: %(default)s)",
    )
    parser.add_argument(
        "--queue-timeout",
        type=float,
        default=30.0,
        metavar="S",
        help="seconds a request may wait for a slot or for blocks before 503 (default: "
        "%(default)g)",
    )
    parser.add_argument(
        "--max-queue",
        type=int,
        default=64,
        metavar="N",
        help="requests waiting at once (default: %(default)s)",
    )
    parser.add_argument(
        "--reserve",
        choices=list(RESERVE_MODES),
        default="on-demand",
        help="blocks reserved when a request starts: its prompt's plus one block (on-demand), "
        "plus one token (prompt), or for prompt + max_tokens (full); requests grow at block "
        "boundaries, and when the pool refuses, the newest request is preempted and resumed "
        "later with its tokens recomputed, never ended (default: %(default)s)",
    )
    parser.add_argument(
        "--growth-wait",
        type=_growth_wait,
        default=DEFAULT_GROWTH_WAIT,
        metavar="S",
        help="seconds a step's growths may wait at the daemon while the model is below its fair "
        "share of the budget (reclaim may take bytes back for them meanwhile) before the newest "
        "request is preempted; the generation thread blocks at most this long per step "
        f"(0..{MAX_GROWTH_WAIT:g}; default: %(default)g)",
    )
    parser.add_argument(
        "--no-pool", action="store_true", help="stock mlx-lm KV caches, no daemon (a baseline)"
    )
    parser.add_argument(
        "--prompt-cache-bytes",
        type=_cache_bytes,
        default=DEFAULT_MAX_BYTES,
        metavar="SIZE",
        help="most bytes of pool blocks the prompt cache keeps (ended requests' KV, reused by "
        "requests with the same prefix; e.g. 512MiB; 0: no prompt cache; needs the pool) "
        "(default: 1GiB)",
    )
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=256,
        metavar="N",
        help="max_tokens of a request that gives none (default: %(default)s)",
    )
    parser.add_argument(
        "--max-tokens-limit",
        type=int,
        default=32768,
        metavar="N",
        help="the largest max_tokens accepted (default: %(default)s)",
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="weights seed of a builtin model (default: %(default)s)"
    )
    parser.add_argument(
        "--pool-timeout",
        type=float,
        default=10.0,
        metavar="S",
        help="seconds each daemon call may take (default: %(default)g)",
    )
    parser.add_argument(
        "--log-level",
        default="INFO",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        type=str.upper,
        help="stderr log level (default: %(default)s)",
    )
    return parser


def _growth_wait(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not 0.0 <= value <= MAX_GROWTH_WAIT:
        raise argparse.ArgumentTypeError(f"must be in 0..{MAX_GROWTH_WAIT:g} seconds")
    return value


def _cache_bytes(text: str) -> int:
    try:
        return parse_bytes(text, what="--prompt-cache-bytes", allow_zero=True)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _bytes_per_block(layout: KVLayout) -> dict[str, int]:
    return {s: layout.bytes_per_block(s) for s in ("k", "v", "kv")}


def open_pool(
    run_dir: str | None,
    name: str,
    model: nn.Module,
    timeout: float,
    growth_wait: float = DEFAULT_GROWTH_WAIT,
) -> tuple[PoolClient, PooledCacheSource]:
    """A daemon session reporting this model's bytes per block, and its cache source."""
    layout = KVLayout.from_model(model)  # ValueError for a model of another shape
    pool = PoolClient(run_dir, name=name, bytes_per_block=_bytes_per_block(layout), timeout=timeout)
    if pool.config.block_size != layout.block_size:
        # Bytes per block depend on the daemon's block size, known only after hello.
        pool.close()
        layout = KVLayout.from_model(model, block_size=pool.config.block_size)
        pool = PoolClient(
            run_dir, name=name, bytes_per_block=_bytes_per_block(layout), timeout=timeout
        )
    try:
        return pool, PooledCacheSource(model, pool, growth_wait)
    except BaseException:
        pool.close()
        raise


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level,
        stream=sys.stderr,
        format="%(asctime)s vqpool-worker[%(process)d] %(levelname)s %(message)s",
    )
    for name in (
        "max_concurrent",
        "max_queue",
        "max_tokens",
        "max_tokens_limit",
        "prefill_step_size",
    ):
        if getattr(args, name) < 1:
            log.error("--%s must be >= 1", name.replace("_", "-"))
            return 2
    if args.queue_timeout <= 0:
        log.error("--queue-timeout must be > 0")
        return 2

    stop = threading.Event()

    def record_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, record_signal)
    signal.signal(signal.SIGINT, record_signal)

    # Everything that can fail in a moment is checked before the model loads, which can take
    # minutes: the port, the model argument, the daemon's socket.
    try:
        server = make_server(args.host, args.port)
    except OSError as exc:
        log.error("cannot listen on %s:%d: %s", args.host, args.port, exc)
        return 1
    problem = model_spec_problem(args.model)
    if problem is not None:
        server.server_close()
        log.error("%s", problem)
        return 2
    try:
        return _serve(args, server, stop)
    finally:
        server.server_close()
        mx.clear_streams()  # the main thread's too (mlx-lm made its stream here at import)


def _daemon_missing(run_dir: str | None) -> str | None:
    """Why there is certainly no daemon to talk to (its socket file is absent), else None."""
    resolved = resolve_run_dir(run_dir)
    where = socket_path(resolved, WORKER_SOCKET_NAME)
    if where.exists():
        return None
    return (
        f"vqpoold is not running on {resolved} (no socket at {where}): start `vqpoold "
        f"--run-dir {resolved}` first (`vqpoolctl --run-dir {resolved} status` checks it), or "
        "pass --no-pool"
    )


def _serve(args: argparse.Namespace, server: ServingServer, stop: threading.Event) -> int:
    """Load the model, open the pool, serve on ``server`` until ``stop``; the exit status."""
    if not args.no_pool:
        missing = _daemon_missing(args.run_dir)
        if missing is not None:
            log.error("%s", missing)
            return 1
    try:
        loaded = load_model(args.model, seed=args.seed)
    except ValueError as exc:
        log.error("%s", exc)
        return 2
    served_name = args.served_model_name or loaded.name
    max_concurrent = args.max_concurrent
    batching = batching_problem(loaded.model)
    if batching is not None and max_concurrent > 1:
        log.warning("%s: decoding one request at a time (--max-concurrent 1)", batching)
        max_concurrent = 1
    pool: PoolClient | None = None
    source: CacheSource
    describe_pool: Callable[[], dict[str, Any]]
    if args.no_pool:
        source = StockCacheSource(loaded.model)

        def describe_pool() -> dict[str, Any]:
            return {"pool": "off"}
    else:
        try:
            pool, source = open_pool(
                args.run_dir, served_name, loaded.model, args.pool_timeout, args.growth_wait
            )
        except ValueError as exc:
            log.error("%s", exc)
            return 2
        except DaemonUnavailableError as exc:
            log.error("%s", exc)
            return 1
        session = pool

        def describe_pool() -> dict[str, Any]:
            sid = session.session_id
            described: dict[str, Any] = {
                "pool": "vqpoold",
                "run_dir": str(session.run_dir),
                "session": None if sid is None else session_label(sid),
                "block_size": session.config.block_size,
            }
            problem = session.session_problem()
            if problem is not None:
                described["pool_error"] = problem
            return described

    owner_prefix = f"{served_name[:MAX_OWNER_PREFIX_CHARS]}-{os.getpid()}"
    prompt_cache: PromptCache | None = None
    if pool is not None and isinstance(source, PooledCacheSource) and args.prompt_cache_bytes:
        pooled, client = source, pool

        def report_cache(counters: dict[str, int]) -> None:
            client.report_prompt_cache(counters)
            # Entries may go on another thread (the daemon's advice): /v1/stats follows.
            scheduler.stats.set_memory(pooled.n_blocks(), pooled.nbytes())

        prompt_cache = source.attach_prompt_cache(
            owner_prefix=owner_prefix,
            max_bytes=args.prompt_cache_bytes,
            report=report_cache,
            lost_owners=pool.lost_owners,
        )
        pool.on_advice = prompt_cache.follow_advice
    scheduler = Scheduler(
        loaded.model,
        source,
        owner_prefix=owner_prefix,
        eos_token_ids=loaded.tokenizer.eos_token_ids,
        max_concurrent=max_concurrent,
        max_queue=args.max_queue,
        queue_timeout=args.queue_timeout,
        reserve=args.reserve,
        headroom_slots=1 if pool is None else pool.config.block_size,
        lost_owners=None if pool is None else pool.lost_owners,
        prefill_step_size=args.prefill_step_size,
        prompt_cache=prompt_cache,
    )
    if prompt_cache is not None:
        prompt_cache.report()
    if pool is not None:
        # Reclaim asks from the daemon: the prompt cache, then requests preempted at the next
        # step boundary, give the bytes back.
        pool.set_reclaim_handler(scheduler.give_back)
    app = ServingApp(
        loaded, scheduler, args.max_tokens, args.max_tokens_limit, describe_pool, served_name
    )
    server.serve(app)
    scheduler.start()
    serving = threading.Thread(
        target=server.serve_forever, kwargs={"poll_interval": 0.2}, name="vqpool-http"
    )
    serving.start()
    host, port = str(server.server_address[0]), int(server.server_address[1])
    mode = "stock mlx-lm caches (--no-pool)" if pool is None else f"pool at {pool.run_dir}"
    # The ready line, on stdout whatever --log-level says: scripts wait for it (and learn the
    # port it chose with --port 0).
    print(f"vqpool-worker: serving {served_name} on http://{host}:{port} ({mode})", flush=True)
    try:
        while not stop.wait(0.5):
            pass
    finally:
        log.info("stopping")
        server.shutdown()
        serving.join()
        scheduler.stop()
        if pool is not None:  # its goodbye frees the prompt cache's blocks too
            pool.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
