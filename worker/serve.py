"""``vqpool-worker``: serve one mlx-lm model over HTTP with its KV cache drawn from vqpoold's pool.

    vqpool-worker --model MODEL --port PORT [--served-model-name NAME] [--run-dir DIR]
                  [--max-concurrent N] [--queue-timeout S] [--max-queue N] [--no-pool]
                  [--prompt-cache-bytes SIZE] [--mlx-cache-limit SIZE] [--charge-mlx-cache]
                  [--exit-on-stdin-eof] [--kv-bits 4|8 [--kv-group-size N] [--quantized-kv-start T]]

``MODEL`` is a Hugging Face id or a local path (``mlx_lm.load``), or ``builtin:NAME`` for a tiny
offline model (see :mod:`vqpool.worker.models.loading`). The pool is a ``PoolClient`` session on the
daemon of ``--run-dir`` / ``VQPOOL_RUN_DIR`` / the default run directory; ``--no-pool`` serves
from stock mlx-lm caches through the same code path instead (the benchmark's baseline).
``--served-model-name`` is the id clients see and send (default: ``MODEL`` as given).

The options and the model argument are checked and the daemon's socket looked for before
mlx-lm is imported (seconds), and the port is bound before the model loads (minutes), so each
of those mistakes is one line at once, not found after a long load; ``--help`` is quick.
Serving itself is :mod:`vqpool.worker.run_worker`.

Once it serves, it prints one line to stdout, ``vqpool-worker: serving NAME on
http://HOST:PORT (...)``, with the real port when ``--port 0``. SIGTERM or SIGINT stops it
cleanly: the server stops accepting, every running or queued request ends (its blocks go
back), the pool session says goodbye, MLX's streams are destroyed, exit status 0. Exit status
2 for bad options, a ``--model`` that names no model (one line: what is wrong, what to pass) or
a model the pooled cache cannot serve; 1 when the daemon is not running or does not answer, or
the port is taken.

``--exit-on-stdin-eof`` is for a supervisor (``vqpool serve``) that starts the worker with stdin
a pipe only it holds: when the supervisor dies, even by SIGKILL, the kernel closes the pipe, and
the worker stops just as on SIGTERM, so no orphan keeps a model's memory and a restarted
supervisor never finds a model loaded twice. Anything written to that pipe is read and ignored.
Without the option stdin is never read (a worker started from a terminal leaves it alone).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from collections.abc import Sequence
from types import FrameType

from vqpool.shared.byte_sizes import parse_bytes
from vqpool.shared.config import WORKER_SOCKET_NAME, resolve_run_dir, socket_path
from vqpool.shared.kv_formats import DEFAULT_GROUP_SIZE, QUANTIZED_BITS, QUANTIZED_GROUP_SIZES
from vqpool.shared.tiny_configs import builtin_names
from vqpool.worker.defaults import (
    DEFAULT_GROWTH_WAIT,
    DEFAULT_MLX_CACHE_LIMIT,
    DEFAULT_NUM_DRAFT_TOKENS,
    DEFAULT_PREFILL_STEP_SIZE,
    DEFAULT_PROMPT_CACHE_BYTES,
    DEFAULT_RESERVE,
    MAX_GROWTH_WAIT,
    MAX_NUM_DRAFT_TOKENS,
    RESERVE_MODES,
)
from vqpool.worker.models.loading import adapter_dir_problem, model_spec_problem

log = logging.getLogger("vqpool.worker")


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
        "--adapter-path",
        metavar="DIR",
        help="LoRA adapters (adapter_config.json and adapters.safetensors, as mlx-lm's "
        "trainer writes them) applied to the model at load, as mlx_lm.server's",
    )
    parser.add_argument(
        "--draft-model",
        metavar="MODEL",
        help="a small model with the same tokenizer for speculative decoding, as "
        "mlx_lm.server's: requests are then decoded one at a time (--max-concurrent 1), "
        "and its KV shares each request's pool blocks",
    )
    parser.add_argument(
        "--num-draft-tokens",
        type=int,
        default=DEFAULT_NUM_DRAFT_TOKENS,
        metavar="N",
        help="tokens the draft model proposes per round unless a request says (0.."
        f"{MAX_NUM_DRAFT_TOKENS}; default: %(default)s)",
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
        default=DEFAULT_RESERVE,
        help="blocks reserved when a request starts: per request (auto: as full while the "
        "worker's requests are measured to use at least 90%% of their max_tokens, else as "
        "on-demand), its prompt's plus one block (on-demand), plus one token (prompt), or for "
        "prompt + max_tokens (full); requests grow at block boundaries, and when the pool "
        "refuses, the request cheapest to recompute is preempted and resumed later with its "
        "tokens recomputed, never ended (default: %(default)s)",
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
        "--kv-bits",
        type=int,
        choices=QUANTIZED_BITS,
        metavar="BITS",
        help="quantize the KV cache to 4 or 8 bits, as mlx_lm.server's --kv-bits (mlx-lm's "
        "QuantizedKVCache): the pool's blocks then hold packed values with a scale and a bias "
        "per group, two to four times the context per byte; batched decoding too; with "
        "--no-pool, mlx-lm's own cache, one request at a time as mlx_lm.server (default: "
        "full precision)",
    )
    parser.add_argument(
        "--kv-group-size",
        type=int,
        default=DEFAULT_GROUP_SIZE,
        metavar="N",
        help="values per scale and bias with --kv-bits: "
        f"{', '.join(map(str, QUANTIZED_GROUP_SIZES))}, dividing the model's head dimension "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--quantized-kv-start",
        type=int,
        default=0,
        metavar="T",
        help="with --kv-bits, a sequence's cache stays in full precision until it holds T "
        "tokens after a forward pass, then all of it is quantized (mlx-lm's meaning; "
        "mlx_lm.server's default is 5000) (default: %(default)s: quantized after the first "
        "forward pass)",
    )
    parser.add_argument(
        "--prompt-cache-bytes",
        type=_cache_bytes,
        default=DEFAULT_PROMPT_CACHE_BYTES,
        metavar="SIZE",
        help="most bytes of pool blocks the prompt cache keeps (ended requests' KV, reused by "
        "requests with the same prefix; e.g. 512MiB; 0: no prompt cache; needs the pool) "
        "(default: 1GiB)",
    )
    parser.add_argument(
        "--kv-disk-bytes",
        type=_kv_disk_bytes,
        default=0,
        metavar="SIZE",
        help="most bytes of prompt-cache entries kept on disk: entries evicted from the pool are "
        "written there instead of dropped, and a prompt found there is read back instead of "
        "recomputed, across unloads and restarts (e.g. 20GiB; default 0: no disk tier)",
    )
    parser.add_argument(
        "--kv-disk-dir",
        metavar="DIR",
        help="this model's directory for --kv-disk-bytes (default: RUN_DIR/kv-disk/NAME, NAME "
        "the served model name)",
    )
    parser.add_argument(
        "--mlx-cache-limit",
        type=_mlx_cache_limit,
        default=DEFAULT_MLX_CACHE_LIMIT,
        metavar="SIZE",
        help="most bytes of freed buffers MLX keeps for reuse (mx.set_cache_limit, applied "
        "before the model loads), so idle buffers cannot grow the worker past its model's "
        "weights, KV and this (e.g. 256MiB; 0: no buffer cache) (default: 64MiB)",
    )
    parser.add_argument(
        "--charge-mlx-cache",
        action="store_true",
        help="declare --mlx-cache-limit plus 8 MiB for the runtime's growth while serving to "
        "vqpoold as this model's overhead, charged to the budget beside its weights (vqpool "
        "serve passes it to its workers); without it that memory is not counted",
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
        "--allowed-origins",
        type=_origins,
        default=("*",),
        metavar="ORIGINS",
        help="comma-separated origins browsers may call the API from, as mlx_lm.server's "
        "(CORS; default: * = any)",
    )
    parser.add_argument(
        "--exit-on-stdin-eof",
        action="store_true",
        help="stop as on SIGTERM when stdin reaches end of file: for a supervisor holding a "
        "pipe to it, so the supervisor's death (even by SIGKILL) stops the worker",
    )
    parser.add_argument(
        "--log-level",
        default="INFO",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        type=str.upper,
        help="stderr log level (default: %(default)s)",
    )
    return parser


def _origins(text: str) -> tuple[str, ...]:
    return tuple(text.split(","))


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


def _kv_disk_bytes(text: str) -> int:
    try:
        return parse_bytes(text, what="--kv-disk-bytes", allow_zero=True)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _mlx_cache_limit(text: str) -> int:
    try:
        return parse_bytes(text, what="--mlx-cache-limit", allow_zero=True)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


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
    if not 0 <= args.num_draft_tokens <= MAX_NUM_DRAFT_TOKENS:
        log.error("--num-draft-tokens must be in 0..%d", MAX_NUM_DRAFT_TOKENS)
        return 2
    quantization_problem = _quantization_problem(args)
    if quantization_problem is not None:
        log.error("%s", quantization_problem)
        return 2

    stop = threading.Event()

    def record_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, record_signal)
    signal.signal(signal.SIGINT, record_signal)
    if args.exit_on_stdin_eof:
        if sys.stdin is None:
            log.error("--exit-on-stdin-eof needs a stdin to watch, and this process has none")
            return 2
        threading.Thread(
            target=_stop_at_stdin_eof,
            args=(sys.stdin.fileno(), stop),
            daemon=True,
            name="vqpool-stdin-eof",
        ).start()

    # Everything that can fail in a moment is checked before mlx-lm is imported and the model
    # loads: the model argument, the daemon's socket, then (run_worker) the port.
    problem = model_spec_problem(args.model)
    if problem is None and args.draft_model is not None:
        problem = model_spec_problem(args.draft_model, "--draft-model")
    if problem is None and args.adapter_path is not None:
        problem = adapter_dir_problem(args.adapter_path)
    if problem is not None:
        log.error("%s", problem)
        return 2
    if not args.no_pool:
        missing = _daemon_missing(args.run_dir)
        if missing is not None:
            log.error("%s", missing)
            return 1
    from vqpool.worker.run_worker import run_worker  # imports mlx-lm: after the checks above

    return run_worker(args, stop)


def _quantization_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with ``--kv-bits`` / ``--kv-group-size`` / ``--quantized-kv-start`` before
    the model loads (its head dimension is checked once it has: ``KVQuantization.layout``)."""
    if args.kv_group_size not in QUANTIZED_GROUP_SIZES:
        return (
            f"--kv-group-size must be one of {', '.join(map(str, QUANTIZED_GROUP_SIZES))}, got "
            f"{args.kv_group_size}"
        )
    if args.quantized_kv_start < 0:
        return f"--quantized-kv-start must be >= 0, got {args.quantized_kv_start}"
    if args.kv_bits is None:
        return None
    if args.draft_model is not None and not args.no_pool:
        return (
            "--kv-bits with --draft-model needs --no-pool: the pool keeps a model's and its "
            "draft's KV in the same blocks, one format per block, and mlx-lm quantizes the two "
            "caches at different passes (the draft's prefill runs first, and a rejection trims "
            "the draft's cache one token less), so a block would hold a quantized half and a "
            "full-precision one, which no format of the ledger prices"
        )
    return None


def _stop_at_stdin_eof(fd: int, stop: threading.Event) -> None:
    """Read ``fd`` (discarding what comes) until end of file, then set ``stop``."""
    try:
        while os.read(fd, 4096):
            pass
    except OSError as exc:  # a broken link to the supervisor means it is gone, as EOF does
        log.warning("reading stdin failed (%s): taken as end of file", exc)
    log.info("stdin reached end of file (--exit-on-stdin-eof): stopping")
    stop.set()


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


if __name__ == "__main__":
    sys.exit(main())
