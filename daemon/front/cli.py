"""``vqpool serve``: one OpenAI-style endpoint for every model, each loaded when a request names
it and unloaded when idle.

    vqpool serve [--config FILE] [--model PATH ...] [--port 8080] [--host 127.0.0.1]
                 [--max-loaded N] [--keep-alive 5m] [--api-key KEY] [--run-dir DIR] ...

Models come from the settings file's ``[models."NAME"]`` tables that have a ``path`` (see
:mod:`vqpool.daemon.front.catalog`) and from ``--model PATH`` (served under its own name). The
file's ``[serve]`` table may hold any of the options below (``max_loaded = 2``); the command
line wins. vqpoold is the one running on the run directory, or one started with the same file
and stopped on exit.

It prints one line once it serves, ``vqpool serve: serving N models (...) on URL``. SIGTERM or
SIGINT stops it: no new connections, every worker stopped (each ends its running requests
first), the daemon it started stopped, exit status 0. Exit status 2 for bad options or a bad
settings file, 1 when it cannot serve (the port is taken, another ``vqpool serve`` runs on the
run directory, vqpoold does not start).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import fcntl
import logging
import os
import resource
import signal
import sys
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from aiohttp import web
from vqpool.daemon.front.catalog import Catalog, catalog_from_config, parse_keep_alive
from vqpool.daemon.front.client_limits import (
    BODY_TIMEOUT,
    HEAD_TIMEOUT,
    LINGERING_TIME,
    WRITE_TIMEOUT,
    CappedTCPSite,
    connection_cap,
)
from vqpool.daemon.front.control_api import build_control_app
from vqpool.daemon.front.daemon_child import DaemonChild, DaemonStartError
from vqpool.daemon.front.ledger_calls import DEFAULT_LOAD_KV_TOKENS, MAX_LOAD_KV_TOKENS
from vqpool.daemon.front.metrics import FrontMetrics
from vqpool.daemon.front.public_api import build_public_app
from vqpool.daemon.front.supervisor import (
    DEFAULT_CONVERSATION_GAP,
    DEFAULT_MIN_RESIDENCY,
    DEFAULT_SWAP_GRACE,
    Supervisor,
)
from vqpool.daemon.server.exit_status import ExitStatus, StartupError
from vqpool.daemon.server.machine_memory import DefaultBudget, machine_default_budget
from vqpool.daemon.server.run_dir import open_lock_file, prepare_run_dir
from vqpool.daemon.server.settings import load_settings_file
from vqpool.shared.byte_sizes import format_bytes
from vqpool.shared.config import (
    FRONT_LOCK_FILE_NAME,
    FRONT_SOCKET_NAME,
    resolve_run_dir,
    socket_path,
)
from vqpool.shared.errors import VqpoolError

log = logging.getLogger("vqpool.serve")

API_KEY_ENV = "VQPOOL_API_KEY"
LOOPBACK = ("127.0.0.1", "::1", "localhost")
SHUTDOWN_GRACE = 5.0
"""Seconds the server waits for its handlers once the workers have stopped."""
MAX_SWAP_GRACE = 60.0
MAX_MIN_RESIDENCY = 3600.0
MAX_OPEN_FILES = 65536
"""File descriptors asked for: thousands of idle client connections must not starve it."""

SERVE_DEFAULTS: dict[str, Any] = {
    "host": "127.0.0.1",
    "port": 8080,
    "api_key": None,
    "allowed_origins": "*",
    "max_loaded": None,
    "keep_alive": "5m",
    "queue_timeout": 120.0,
    "max_queue": 128,
    "load_timeout": 600.0,
    "swap_grace": DEFAULT_SWAP_GRACE,
    "min_residency": DEFAULT_MIN_RESIDENCY,
    "conversation_gap": DEFAULT_CONVERSATION_GAP,
    "load_kv_tokens": DEFAULT_LOAD_KV_TOKENS,
    "kv_disk_bytes": None,
    "budget": None,
    "log_level": "INFO",
    # Bounds on client connections (client_limits.py says why these values); hidden options.
    "head_timeout": HEAD_TIMEOUT,
    "body_timeout": BODY_TIMEOUT,
    "write_timeout": WRITE_TIMEOUT,
    "max_connections": None,
}
_SERVE_TYPES: dict[str, tuple[type, ...]] = {
    "host": (str,),
    "port": (int,),
    "api_key": (str,),
    "allowed_origins": (str,),
    "max_loaded": (int,),
    "keep_alive": (int, float, str),
    "queue_timeout": (int, float),
    "max_queue": (int,),
    "load_timeout": (int, float),
    "swap_grace": (int, float),
    "min_residency": (int, float),
    "conversation_gap": (int, float),
    "load_kv_tokens": (int,),
    "kv_disk_bytes": (int, str),
    "budget": (int, str),
    "log_level": (str,),
    "head_timeout": (int, float),
    "body_timeout": (int, float),
    "write_timeout": (int, float),
    "max_connections": (int,),
}


class UsageError(ValueError):
    """Bad options or settings (exit status 2)."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vqpool",
        description="Serve several mlx-lm models behind one OpenAI-style endpoint, their "
        "memory in one vqpoold pool.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    serve = commands.add_parser(
        "serve",
        help="serve every configured model on one port",
        description=(__doc__ or "").strip(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        argument_default=argparse.SUPPRESS,
    )
    serve.add_argument("--config", metavar="FILE", help="settings file (TOML), as vqpoold's")
    serve.add_argument(
        "--model",
        action="append",
        metavar="PATH",
        help="serve this model (a directory, a hub id, builtin:NAME); repeatable",
    )
    serve.add_argument("--host", help="address to listen on (default: 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port to listen on (default: 8080; 0: any)")
    serve.add_argument(
        "--api-key",
        help=f"require Authorization: Bearer KEY on every route but /health (env {API_KEY_ENV}); "
        "needed to listen on an address other than loopback",
    )
    serve.add_argument(
        "--allowed-origins",
        metavar="ORIGINS",
        help="comma-separated origins browsers may call the API from, as mlx_lm.server's "
        "(CORS; default: * = any); preflight OPTIONS is answered here",
    )
    serve.add_argument("--run-dir", help="vqpoold's run directory (as vqpoold's --run-dir)")
    serve.add_argument(
        "--budget",
        metavar="SIZE",
        help="the budget of a vqpoold started here (as vqpoold's: 8GiB, 40%%) (default: the "
        "settings file's, else 75%% of Metal's recommended working set on macOS, of physical "
        "memory less 2 GiB on Linux; see docs/operations.md)",
    )
    serve.add_argument(
        "--max-loaded",
        type=int,
        metavar="N",
        help="the most models loaded at once, a cap beside the budget's bytes: a load beyond "
        "it waits for the least recently used idle model to unload (default: no cap)",
    )
    serve.add_argument(
        "--min-residency",
        type=float,
        metavar="S",
        help="seconds a model stays loaded at least before a load short of memory may unload "
        f"it, so two models do not unload each other in turn (default: {DEFAULT_MIN_RESIDENCY:g})",
    )
    serve.add_argument(
        "--conversation-gap",
        type=float,
        metavar="S",
        help="seconds after its last request during which a model counts as mid-conversation "
        "(its chat's next turn likely soon): a load short of memory unloads such a model only "
        "when no other idle model makes room (default: "
        f"{DEFAULT_CONVERSATION_GAP:g})",
    )
    serve.add_argument(
        "--load-kv-tokens",
        type=int,
        metavar="N",
        help="tokens of KV a load asks room for beside the model's weights (at most its limit; "
        "its reserve if larger): a load that leaves less free waits, or unloads an idle model "
        f"(default: {DEFAULT_LOAD_KV_TOKENS})",
    )
    serve.add_argument(
        "--kv-disk-bytes",
        metavar="SIZE",
        help="each model's prompt-cache disk tier, in RUN_DIR/kv-disk/NAME, unless its table "
        "sets kv_disk_bytes (a vqpool-worker option): entries evicted from memory, an unloaded "
        "model's included, are kept there and read back instead of recomputed (default: none)",
    )
    serve.add_argument(
        "--keep-alive",
        metavar="DURATION",
        help="how long a model stays loaded after its last request ends, for models whose "
        "table gives none: seconds or 30s, 5m, 1h; -1 never (default: 5m)",
    )
    serve.add_argument(
        "--queue-timeout",
        type=float,
        metavar="S",
        help="seconds a request may wait for its model to load before 503 (default: 120)",
    )
    serve.add_argument(
        "--max-queue",
        type=int,
        metavar="N",
        help="requests that may wait for one model to load (default: 128)",
    )
    serve.add_argument(
        "--load-timeout",
        type=float,
        metavar="S",
        help="seconds a model's worker may take to start serving (default: 600)",
    )
    for bound in ("--head-timeout", "--body-timeout", "--write-timeout"):
        serve.add_argument(bound, type=float, help=argparse.SUPPRESS)
    serve.add_argument("--max-connections", type=int, help=argparse.SUPPRESS)
    serve.add_argument(
        "--swap-grace",
        type=float,
        metavar="S",
        help="seconds after its last request before a model may be unloaded to make room for "
        f"another (requests sent together arrive in any order) (default: {DEFAULT_SWAP_GRACE})",
    )
    serve.add_argument(
        "--log-level",
        type=str.upper,
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="stderr log level (default: INFO)",
    )
    return parser


def serve_options(args: argparse.Namespace, file_table: dict[str, Any]) -> dict[str, Any]:
    """The front door's options: defaults, then the file's ``[serve]`` table, then the command
    line.

    Raises:
        UsageError: An unknown or wrongly typed option, or a bad value.
    """
    options = dict(SERVE_DEFAULTS)
    for raw_key, value in file_table.items():
        key = raw_key.replace("-", "_")
        if key not in _SERVE_TYPES:
            known = sorted(_SERVE_TYPES)
            raise UsageError(f"[serve]: unknown setting {raw_key!r} (known: {known})")
        types = _SERVE_TYPES[key]
        if isinstance(value, bool) or not isinstance(value, types):
            names = " or ".join(t.__name__ for t in types)
            raise UsageError(f"[serve]: {raw_key} must be {names}, got {value!r}")
        options[key] = value
    if os.environ.get(API_KEY_ENV):
        options["api_key"] = os.environ[API_KEY_ENV]
    for key in _SERVE_TYPES:
        if hasattr(args, key):
            options[key] = getattr(args, key)
    for key in ("max_loaded", "max_queue", "max_connections"):
        if options[key] is not None and options[key] < 1:
            raise UsageError(f"--{key.replace('_', '-')} must be >= 1")
    for key in ("queue_timeout", "load_timeout", "head_timeout", "body_timeout", "write_timeout"):
        if not options[key] > 0:
            raise UsageError(f"--{key.replace('_', '-')} must be > 0")
    if not 0 <= options["min_residency"] <= MAX_MIN_RESIDENCY:
        raise UsageError(f"--min-residency must be 0..{MAX_MIN_RESIDENCY:g} seconds")
    if not 0 <= options["conversation_gap"] <= MAX_MIN_RESIDENCY:
        raise UsageError(f"--conversation-gap must be 0..{MAX_MIN_RESIDENCY:g} seconds")
    if not 1 <= options["load_kv_tokens"] <= MAX_LOAD_KV_TOKENS:
        raise UsageError(f"--load-kv-tokens must be 1..{MAX_LOAD_KV_TOKENS}")
    if not 0 <= options["swap_grace"] <= MAX_SWAP_GRACE:
        raise UsageError(f"--swap-grace must be 0..{MAX_SWAP_GRACE:g} seconds")
    if not 0 <= options["port"] <= 65535:
        raise UsageError("--port must be 0..65535")
    if options["host"] not in LOOPBACK and not options["api_key"]:
        raise UsageError(
            f"listening on {options['host']} (not loopback) needs --api-key (or {API_KEY_ENV}): "
            "anyone who reaches the port could use the models"
        )
    try:
        options["keep_alive"] = parse_keep_alive(options["keep_alive"], "--keep-alive")
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    return options


def read_config(path: str | None) -> dict[str, Any]:
    if path is None:
        return {}
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"{path}: not valid TOML: {exc}") from None


def lock_front_door(run_dir: Path) -> int:
    """Hold the run directory's front-door lock: one ``vqpool serve`` per run directory, so a
    model is never started twice by two of them.

    Raises:
        StartupError: Another one holds it (its pid in the message) or the lock file is bad.
    """
    lock_path = run_dir / FRONT_LOCK_FILE_NAME
    fd = open_lock_file(lock_path)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder = os.pread(fd, 64, 0).decode(errors="replace").strip()
        os.close(fd)
        raise StartupError(
            f"another vqpool serve already runs on {run_dir} ({holder or 'starting'}); stop it "
            "or use another --run-dir",
            ExitStatus.ALREADY_RUNNING,
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()}\n".encode(), 0)
    return fd


def raise_open_files_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = MAX_OPEN_FILES if hard == resource.RLIM_INFINITY else min(hard, MAX_OPEN_FILES)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))


def budget_in_file(config: str | None) -> bool:
    """Whether the settings file gives vqpoold a budget (its ``[vqpoold]`` table, or its top
    level, as vqpoold reads it).

    Raises:
        ValueError: The file is not a valid vqpoold settings file.
    """
    return config is not None and load_settings_file(config).get("budget") is not None


def budget_line(budget: int | None, started: bool, default: DefaultBudget | None) -> str:
    """What the start says of the budget: the default and how it was found, or the budget the
    daemon has when it is not the default (given, kept from ``vqpoolctl budget``, or the
    running daemon's)."""
    text = "none" if budget is None else format_bytes(budget)
    if not started:
        return f"budget: {text}, the running vqpoold's (vqpoolctl budget SIZE changes it)"
    if default is None:
        return f"budget: {text}"
    if budget == default.nbytes:
        return f"budget: {text} ({default.basis}); --budget to choose"
    return (
        f"budget: {text}, set by vqpoolctl budget and kept in the run directory (the default "
        f"would be {format_bytes(default.nbytes)})"
    )


async def serve(
    catalog: Catalog,
    options: dict[str, Any],
    run_dir: Path,
    config: str | None,
    file_budget: bool = False,
) -> int:
    """Serve until SIGTERM or SIGINT; the exit status. ``file_budget``: the settings file gives
    vqpoold a budget (else, with no ``--budget``, a started daemon gets the machine's default)."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    daemon = DaemonChild(run_dir)
    budget, default = options["budget"], None
    if budget is not None:
        budget = str(budget)  # [serve] may give bytes as an int; vqpoold takes an argument
    if budget is None and not file_budget:
        default = await asyncio.to_thread(machine_default_budget)
        budget = str(default.nbytes)
    try:
        started_daemon = await daemon.ensure(config, budget)
        print(budget_line(await daemon.budget(), started_daemon, default), flush=True)
    except DaemonStartError as exc:
        log.error("%s", exc)
        return 1
    except VqpoolError as exc:
        log.error("vqpoold does not answer: %s", exc)
        await daemon.stop()
        return 1
    if not started_daemon:
        log.info("using the vqpoold running on %s", run_dir)
    metrics = FrontMetrics()
    supervisor = Supervisor(
        catalog,
        run_dir,
        max_loaded=options["max_loaded"],
        max_queue=options["max_queue"],
        load_timeout=options["load_timeout"],
        swap_grace=options["swap_grace"],
        min_residency=options["min_residency"],
        conversation_gap=options["conversation_gap"],
        load_kv_tokens=options["load_kv_tokens"],
        metrics=metrics,
    )
    await supervisor.start()
    public = web.AppRunner(
        build_public_app(
            supervisor,
            catalog,
            metrics,
            queue_timeout=options["queue_timeout"],
            api_key=options["api_key"],
            allowed_origins=tuple(options["allowed_origins"].split(",")),
            body_timeout=options["body_timeout"],
            write_timeout=options["write_timeout"],
        ),
        handler_cancellation=True,
        access_log=None,
        keepalive_timeout=options["head_timeout"],  # also the request head's deadline
        lingering_time=LINGERING_TIME,
        shutdown_timeout=SHUTDOWN_GRACE,
    )
    control = None
    try:
        await public.setup()
        site = CappedTCPSite(
            public,
            options["host"],
            options["port"],
            max_connections=connection_cap(options["max_connections"]),
        )
        try:
            await site.start()
        except OSError as exc:
            log.error("cannot listen on %s:%s: %s", options["host"], options["port"], exc.strerror)
            return 1
        host, port = public.addresses[0][:2]
        url = f"http://{host}:{port}" if ":" not in host else f"http://[{host}]:{port}"
        control_path = socket_path(run_dir, FRONT_SOCKET_NAME)
        control_path.unlink(missing_ok=True)  # a killed front door's (the lock says it is gone)
        control = web.AppRunner(
            build_control_app(supervisor, catalog, url), handler_cancellation=True, access_log=None
        )
        await control.setup()
        await web.UnixSite(control, str(control_path)).start()
        os.chmod(control_path, 0o600)
        names = ", ".join(catalog.names)
        print(f"vqpool serve: serving {len(catalog.names)} models ({names}) on {url}", flush=True)
        await stop.wait()
        log.info("stopping: no new requests; stopping the workers")
        await site.stop()
        return 0
    finally:
        # The workers first: each ends its running requests, so the handlers proxying them end.
        await supervisor.close()
        await public.cleanup()
        if control is not None:
            await control.cleanup()
            socket_path(run_dir, FRONT_SOCKET_NAME).unlink(missing_ok=True)
        await daemon.stop()


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command != "serve":
        parser.print_help(sys.stderr)
        return 2
    try:
        file = read_config(getattr(args, "config", None))
        options = serve_options(args, file.get("serve", {}))
        file_budget = budget_in_file(getattr(args, "config", None))
        disk = options["kv_disk_bytes"]
        catalog = catalog_from_config(
            file.get("models", {}),
            getattr(args, "model", []),
            options["keep_alive"],
            worker_defaults=None if disk is None else {"--kv-disk-bytes": str(disk)},
        )
        run_dir = resolve_run_dir(getattr(args, "run_dir", None))
        socket_path(run_dir, FRONT_SOCKET_NAME)  # refuses a path too long for a socket
    except ValueError as exc:
        print(f"vqpool serve: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=options["log_level"],
        stream=sys.stderr,
        format="%(asctime)s vqpool-serve[%(process)d] %(levelname)s %(message)s",
    )
    raise_open_files_limit()
    try:
        prepare_run_dir(run_dir)
        lock_fd = lock_front_door(run_dir)
    except StartupError as exc:
        log.error("%s", exc)
        return 1
    try:
        config = getattr(args, "config", None)
        return asyncio.run(serve(catalog, options, run_dir, config, file_budget))
    finally:
        os.close(lock_fd)


if __name__ == "__main__":
    sys.exit(main())
