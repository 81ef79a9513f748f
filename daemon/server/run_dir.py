"""The run directory vqpoold serves from: created private or checked to be, its lock file held
for the daemon's life (one daemon per directory), and sockets a killed daemon left replaced."""

from __future__ import annotations

import errno
import fcntl
import os
import stat
from datetime import datetime
from pathlib import Path

from vqpool.daemon.server.exit_status import ExitStatus, StartupError


def prepare_run_dir(run_dir: Path) -> None:
    """Create ``run_dir`` 0700, or check that an existing one is ours and private.

    Raises:
        StartupError: It is not a directory, belongs to another user, or others can enter it.
    """
    try:
        run_dir.mkdir(mode=0o700, parents=True)
        os.chmod(run_dir, 0o700)  # mkdir's mode is filtered by the umask
    except FileExistsError:
        pass
    except OSError as exc:
        raise StartupError(
            f"cannot create run directory {run_dir}: {exc}", ExitStatus.BAD_RUN_DIR
        ) from exc
    info = os.lstat(run_dir)
    if not stat.S_ISDIR(info.st_mode):
        raise StartupError(
            f"run directory {run_dir} is not a directory (or is a symlink)", ExitStatus.BAD_RUN_DIR
        )
    if info.st_uid != os.getuid():
        raise StartupError(
            f"run directory {run_dir} belongs to uid {info.st_uid}, not to you "
            f"(uid {os.getuid()}); choose another --run-dir",
            ExitStatus.BAD_RUN_DIR,
        )
    mode = stat.S_IMODE(info.st_mode)
    if mode & 0o077:
        raise StartupError(
            f"run directory {run_dir} has mode {mode:04o}: other users could reach the sockets. "
            f"Run `chmod 700 {run_dir}` or choose another --run-dir",
            ExitStatus.BAD_RUN_DIR,
        )


def remove_stale_socket(path: Path) -> None:
    """Unlink the socket a killed daemon left at ``path``; refuse to delete anything else.

    Raises:
        StartupError: Something other than a socket is at ``path`` (status 3).
    """
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(info.st_mode):
        raise StartupError(
            f"{path} is not a socket (a {_file_kind(info.st_mode)}); it is where the daemon binds: "
            "remove it or choose another --run-dir",
            ExitStatus.BAD_RUN_DIR,
        )
    path.unlink(missing_ok=True)


_FILE_KINDS = (
    (stat.S_ISREG, "regular file"),
    (stat.S_ISDIR, "directory"),
    (stat.S_ISLNK, "symlink"),
    (stat.S_ISFIFO, "FIFO"),
    (stat.S_ISSOCK, "socket"),
)


def _file_kind(mode: int) -> str:
    return next((kind for is_kind, kind in _FILE_KINDS if is_kind(mode)), "device")


def take_lock(lock_path: Path, boot_id: str) -> int:
    """Hold an exclusive flock on ``lock_path`` for the life of the process; return its fd.

    The lock is taken before binding because libzmq deletes an existing ipc socket file when it
    binds: without it a second daemon would silently steal the first one's endpoint.

    The file is opened without following a symlink and must be a plain file with one link:
    the daemon truncates and writes it, so it must never reach a file elsewhere.

    Raises:
        StartupError: Another vqpoold holds the lock (status 1; its lock file names it), or the
            lock file is unusable (status 4).
    """
    fd = open_lock_file(lock_path)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        holder = os.pread(fd, 512, 0).decode(errors="replace").strip().replace("\n", ", ")
        os.close(fd)
        if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise StartupError(f"cannot lock {lock_path}: {exc}", ExitStatus.BAD_LOCK_FILE) from exc
        raise StartupError(
            f"another vqpoold is already serving {lock_path.parent} "
            f"({holder or 'it is starting'}); stop it first or use another --run-dir",
            ExitStatus.ALREADY_RUNNING,
        ) from None
    os.ftruncate(fd, 0)
    started = datetime.now().isoformat(timespec="seconds")
    os.pwrite(fd, f"pid {os.getpid()}\nboot {boot_id}\nstarted {started}\n".encode(), 0)
    return fd


def open_lock_file(lock_path: Path) -> int:
    """Open (creating) the lock file as a plain file of its own, never through a symlink.

    Raises:
        StartupError: It is a symlink, not a plain file, has other hard links, or cannot be
            opened (status 4).
    """
    # O_NONBLOCK: a FIFO put there must not hang the start-up.
    flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
    try:
        fd = os.open(lock_path, flags, 0o600)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            reason = "is a symlink (it is never followed)"
        else:
            reason = f"cannot be opened ({exc.strerror})"
        raise StartupError(
            f"lock file {lock_path} {reason}; remove it or choose another --run-dir",
            ExitStatus.BAD_LOCK_FILE,
        ) from None
    info = os.fstat(fd)
    if stat.S_ISREG(info.st_mode) and info.st_nlink == 1:
        return fd
    os.close(fd)
    kind = _file_kind(info.st_mode)
    reason = f"is a {kind}" if kind != "regular file" else f"has {info.st_nlink} hard links"
    raise StartupError(
        f"lock file {lock_path} {reason}, not a plain file of its own; remove it or choose "
        "another --run-dir",
        ExitStatus.BAD_LOCK_FILE,
    )
