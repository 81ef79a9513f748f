"""Where vqpoold lives: the run directory and its socket paths.

The daemon, the worker client and ``vqpoolctl`` all resolve the run directory the same way, so
a worker finds the daemon without being told where it is:

1. an explicit ``run_dir`` (``--run-dir``),
2. the ``VQPOOL_RUN_DIR`` environment variable,
3. ``$XDG_RUNTIME_DIR/vqpool`` on Linux (the per-user runtime directory systemd provides),
4. ``$TMPDIR/vqpool`` on macOS (launchd's ``$TMPDIR`` is already per user),
5. ``<temp dir>/vqpool-<uid>`` otherwise.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

RUN_DIR_ENV = "VQPOOL_RUN_DIR"
WORKER_SOCKET_NAME = "worker.sock"
ADMIN_SOCKET_NAME = "admin.sock"
LOCK_FILE_NAME = "vqpoold.lock"
FRONT_SOCKET_NAME = "front.sock"
"""The front door's control socket (``vqpool serve``): vqpoolctl ps, load and unload."""
FRONT_LOCK_FILE_NAME = "front.lock"

# sockaddr_un.sun_path holds 108 bytes on Linux and 104 on macOS, including the trailing NUL.
MAX_SOCKET_PATH_BYTES = 103 if sys.platform == "darwin" else 107


def default_run_dir() -> Path:
    """The run directory to use when none is given (see the module docstring for the order)."""
    from_env = os.environ.get(RUN_DIR_ENV)
    if from_env:
        return Path(from_env)
    if sys.platform.startswith("linux"):
        xdg = os.environ.get("XDG_RUNTIME_DIR")
        if xdg:
            return Path(xdg) / "vqpool"
    elif sys.platform == "darwin":
        tmpdir = os.environ.get("TMPDIR")
        if tmpdir:
            return Path(tmpdir) / "vqpool"
    return Path(tempfile.gettempdir()) / f"vqpool-{os.getuid()}"


def resolve_run_dir(run_dir: str | os.PathLike[str] | None) -> Path:
    """``run_dir`` made absolute, or the default run directory when it is None."""
    return Path(run_dir).expanduser().absolute() if run_dir else default_run_dir().absolute()


def socket_path(run_dir: Path, name: str) -> Path:
    """The path of socket ``name`` in ``run_dir``, refused if the OS cannot bind that long a path.

    Raises:
        ValueError: The path is longer than a Unix socket address can hold.
    """
    path = run_dir / name
    n_bytes = len(os.fsencode(path))
    if n_bytes > MAX_SOCKET_PATH_BYTES:
        raise ValueError(
            f"socket path {str(path)!r} is {n_bytes} bytes; Unix sockets allow at most "
            f"{MAX_SOCKET_PATH_BYTES} on this platform. Choose a shorter --run-dir "
            f"(or {RUN_DIR_ENV})."
        )
    return path


def endpoint(run_dir: Path, name: str) -> str:
    """The ZeroMQ ipc endpoint of socket ``name`` in ``run_dir``."""
    return f"ipc://{socket_path(run_dir, name)}"
