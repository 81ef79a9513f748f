"""``vqpoold``: the coordinator daemon. Stays in the foreground and logs to stderr.

Settings come from, in rising priority: built-in defaults, ``--config FILE`` (TOML), the
``VQPOOL_RUN_DIR`` environment variable, and the command line.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from vqpool.daemon.server.exit_status import ExitStatus, StartupError, exit_status_help
from vqpool.daemon.server.server import Server
from vqpool.daemon.server.settings import DaemonSettings, load_settings_file
from vqpool.shared.config import RUN_DIR_ENV


def build_parser() -> argparse.ArgumentParser:
    """The vqpoold command line (every option defaults to "not given")."""
    parser = argparse.ArgumentParser(
        prog="vqpoold",
        description="Coordinator daemon: one pool of KV-cache blocks shared by mlx-lm workers.",
        argument_default=argparse.SUPPRESS,
        epilog=exit_status_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", metavar="FILE", help="TOML file with any of these settings")
    parser.add_argument(
        "--run-dir",
        metavar="DIR",
        help=f"directory for the sockets and lock file (env {RUN_DIR_ENV}; default "
        "$XDG_RUNTIME_DIR/vqpool on Linux, $TMPDIR/vqpool on macOS)",
    )
    parser.add_argument(
        "--n-blocks",
        type=int,
        metavar="N",
        help="blocks in the pool at start, half for keys and half for values unless --shared-kv",
    )
    parser.add_argument(
        "--budget",
        metavar="SIZE",
        help="bytes of KV cache all models may hold together: a size (8GiB, 512MiB) or a share "
        "of physical memory (40%%); default: no budget (see docs/budget.md)",
    )
    parser.add_argument(
        "--lend-reserves",
        action=argparse.BooleanOptionalAction,
        help="let models borrow other models' unused reserves, taken back by reclaim when the "
        "owner needs them (see docs/budget.md)",
    )
    parser.add_argument(
        "--reclaim-deadline",
        type=float,
        metavar="SECONDS",
        help="how long a worker has to give bytes back when asked (default 1)",
    )
    parser.add_argument("--block-size", type=int, metavar="TOKENS", help="token slots per block")
    parser.add_argument(
        "--shared-kv",
        action=argparse.BooleanOptionalAction,
        help='one free list for keys and values (stream "kv") instead of "k" and "v"',
    )
    parser.add_argument(
        "--grow",
        action=argparse.BooleanOptionalAction,
        help="grow the pool when an allocation would fail (see --max-blocks)",
    )
    parser.add_argument("--max-blocks", type=int, metavar="N", help="cap on blocks when growing")
    parser.add_argument(
        "--lease",
        type=float,
        metavar="SECONDS",
        help="how long a stopped worker keeps its blocks after it was last heard from",
    )
    parser.add_argument(
        "--claim-grace",
        type=float,
        metavar="SECONDS",
        help="after a restart, the longest to wait for the previous workers to re-declare their "
        "blocks before serving new allocations (default 5; see docs/reliability.md)",
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        metavar="PORT",
        help="serve Prometheus metrics at http://127.0.0.1:PORT/metrics (0: any free port; "
        "default: off)",
    )
    parser.add_argument(
        "--log-level",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        type=str.upper,
        help="stderr log level (default INFO)",
    )
    return parser


def settings_from(options: dict[str, Any]) -> DaemonSettings:
    """Defaults, then the TOML file, then the environment, then the command line."""
    settings = DaemonSettings()
    config_file = options.pop("config", None)
    if config_file is not None:
        settings = replace(settings, **load_settings_file(config_file))
    if os.environ.get(RUN_DIR_ENV):
        settings = replace(settings, run_dir=os.environ[RUN_DIR_ENV])
    if "n_blocks" in options:
        options["n_blocks_given"] = True
    return replace(settings, **options)


def main(argv: Sequence[str] | None = None) -> int:
    """Run vqpoold; returns the exit status (0 after a clean stop)."""
    options = vars(build_parser().parse_args(argv))
    try:
        settings = settings_from(options)
    except (OSError, ValueError) as exc:
        print(f"vqpoold: {exc}", file=sys.stderr)
        return ExitStatus.BAD_SETTINGS
    logging.basicConfig(
        stream=sys.stderr,
        level=settings.log_level,
        format="%(asctime)s vqpoold[%(process)d] %(levelname)s %(message)s",
    )
    if not settings.shared_kv and settings.n_blocks % 2:
        half = settings.n_blocks // 2
        logging.getLogger("vqpoold").warning(
            "--n-blocks %d is split between keys and values: %d each, %d in all (give an even "
            "count, or --shared-kv for one free list)",
            settings.n_blocks,
            half,
            2 * half,
        )
    try:
        return Server(settings).run()
    except StartupError as exc:
        logging.getLogger("vqpoold").error("%s", exc)
        return exc.status


if __name__ == "__main__":
    sys.exit(main())
