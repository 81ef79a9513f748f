"""Access control: who may reach vqpoold's sockets, and what reaches its request handlers.

* Peers of another user id are refused on the worker and the admin socket by the ZAP handler
  (daemon/net/peer_auth.py), even when they can reach the socket file. Tested with real users: when
  the suite runs as root, the test creates temporary users, runs the daemon as one of them and
  connects as root (root can enter any directory, so only the peer-uid check stops it), as the
  same user (served) and as a third user (stopped by the 0700 run directory). Skipped otherwise.
* Connections that never complete a ZMTP 3 handshake (random bytes, other protocols, another
  security mechanism) never reach the request handler: its counters do not move.

The run directory checks (0700, ours) and "admin ops only on the admin socket" are tested in
test_daemon_startup.py and test_daemon_ownership.py.
"""

from __future__ import annotations

import os
import pwd
import random
import secrets
import shutil
import socket
import subprocess
import sys
import sysconfig
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from daemon_harness import RawClient, remove_tree, short_tmpdir
from vqpool.daemon.net.peer_auth import peer_pid, peer_uid
from vqpool.shared.admin_client import AdminClient
from vqpool.shared.config import ADMIN_SOCKET_NAME, WORKER_SOCKET_NAME
from vqpool.shared.errors import DaemonUnavailableError, ErrorCode
from vqpool.worker import PoolClient
from vqpool.worker.testing.launch import DaemonProcess

needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("useradd") is None,
    reason="creating temporary users to connect as another uid needs root and useradd",
)

# Code run by other users' processes starts by adding this venv's packages: the venv's own
# interpreter may live where other users cannot execute it (e.g. under a 0700 /root).
ADD_VENV = f"import site; site.addsitedir({sysconfig.get_paths()['purelib']!r})\n"
DAEMON_MAIN = ADD_VENV + "import sys\nfrom vqpool.daemon.__main__ import main\nsys.exit(main())"

CLIENT_SCRIPT = ADD_VENV + textwrap.dedent(
    """
    import sys
    from vqpool.shared.admin_client import AdminClient
    from vqpool.shared.errors import DaemonUnavailableError, ErrorCode
    from vqpool.worker import PoolClient
    try:
        with PoolClient(sys.argv[1], name="peer", timeout=2.0) as pool:
            ids = [b.block_id for b in pool.allocate("k", 16, "peer-owner")]
        with AdminClient(sys.argv[1], timeout=2.0) as admin:
            admin.call("ping")
        print("served", ids)
    except DaemonUnavailableError:
        print("refused")
    """
)


def as_user(uid: int, gid: int) -> Callable[[], None]:
    def drop() -> None:
        os.setgroups([])
        os.setgid(gid)
        os.setuid(uid)

    return drop


@pytest.fixture
def temporary_users() -> Iterator[list[pwd.struct_passwd]]:
    """Two fresh system users without home directories, deleted afterwards."""
    names = [f"vqt{secrets.token_hex(3)}" for _ in range(2)]
    for name in names:
        subprocess.run(
            ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", name],
            check=True,
            capture_output=True,
        )
    try:
        yield [pwd.getpwnam(name) for name in names]
    finally:
        for name in names:
            subprocess.run(["userdel", name], check=False, capture_output=True)


def interpreter_for(user: pwd.struct_passwd) -> str:
    """A Python of this version that ``user`` may run with this venv's packages (or skip)."""
    minor = f"python{sys.version_info.major}.{sys.version_info.minor}"
    candidates = (
        sys.executable,
        os.path.realpath(sys.executable),
        f"/usr/bin/{minor}",
        f"/usr/local/bin/{minor}",
        shutil.which(minor),
    )
    for candidate in candidates:
        if candidate is None:
            continue
        try:
            probe = subprocess.run(
                [candidate, "-c", ADD_VENV + "import zmq, msgpack, psutil, vqpool.worker"],
                preexec_fn=as_user(user.pw_uid, user.pw_gid),
                env={"PATH": os.environ.get("PATH", ""), "HOME": "/tmp"},
                capture_output=True,
                timeout=60,
            )
        except OSError:
            continue
        if probe.returncode == 0:
            return candidate
    pytest.skip(f"no {minor} that user {user.pw_name} may run with this venv's packages")


def run_client_as(user: pwd.struct_passwd, run_dir: Path) -> str:
    result = subprocess.run(
        [interpreter_for(user), "-c", CLIENT_SCRIPT, str(run_dir)],
        preexec_fn=as_user(user.pw_uid, user.pw_gid),
        env={"PATH": os.environ.get("PATH", ""), "HOME": "/tmp"},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


@needs_root
def test_peers_of_another_uid_are_refused_on_both_sockets(
    temporary_users: list[pwd.struct_passwd],
) -> None:
    owner, stranger = temporary_users
    base = short_tmpdir()
    os.chown(base, owner.pw_uid, owner.pw_gid)
    run_dir = base / "run"
    log_path = base.parent / f"{base.name}.log"
    python = interpreter_for(owner)
    with open(log_path, "wb") as log:
        daemon = subprocess.Popen(
            [python, "-c", DAEMON_MAIN, "--run-dir", str(run_dir), "--n-blocks", "64"],
            preexec_fn=as_user(owner.pw_uid, owner.pw_gid),
            env={"PATH": os.environ.get("PATH", ""), "HOME": "/tmp"},
            stdout=log,
            stderr=log,
        )
    try:
        deadline = time.monotonic() + 15
        while "listening on" not in log_path.read_text():
            assert daemon.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.05)
        assert os.stat(run_dir).st_uid == owner.pw_uid

        # Root reaches the socket files (it ignores directory permissions): the ZAP handler
        # refuses its connections, so no request of it is ever answered.
        with pytest.raises(DaemonUnavailableError):
            PoolClient(run_dir, name="root", timeout=1.0)
        with AdminClient(run_dir, timeout=1.0) as admin, pytest.raises(DaemonUnavailableError):
            admin.call("ping")
        log_text = log_path.read_text()
        for name in ("worker", "admin"):
            assert f"refused a connection to the {name} socket" in log_text
        assert "peer runs as uid 0" in log_text

        # The daemon's own user is served on both sockets; a third user cannot even connect.
        assert run_client_as(owner, run_dir).startswith("served")
        assert run_client_as(stranger, run_dir) == "refused"
    finally:
        daemon.terminate()
        daemon.wait(10)
        remove_tree(base)
        log_path.unlink(missing_ok=True)


def test_peer_uid_is_read_from_the_zap_address() -> None:
    assert peer_uid(b"localhost:1000:1000:4242") == 1000
    assert peer_uid(b"") is None  # a platform that gives no credentials
    assert peer_uid(b"tcp://127.0.0.1:5555") is None
    assert peer_pid(b"localhost:1000:1000:4242") == 4242
    assert peer_pid(b"") is None
    assert peer_pid(b"tcp://127.0.0.1:5555") is None


@pytest.mark.skipif(
    sys.platform != "linux", reason="only Linux tells libzmq the pid of an ipc peer"
)
def test_hello_naming_another_process_is_refused(daemon: DaemonProcess) -> None:
    # A live process of the daemon's user, and pid 1: today's uid check alone let a client
    # borrow either (its session then lived and died with that process, not with the client).
    bystander = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
    )
    client = RawClient(daemon.run_dir)
    try:
        for pid in (bystander.pid, 1):
            reply = client.call("hello", {"pid": pid, "model": "liar", "nonce": f"n{pid}"})
            assert reply["error"]["code"] == ErrorCode.UNAUTHORIZED, reply
            if pid == bystander.pid or os.geteuid() == 0:  # else pid 1 is another user's
                assert f"not the process connected ({os.getpid()})" in reply["error"]["message"]
        assert daemon.admin("stats")["sessions"] == 0
        session = client.hello()  # the truth is served, and the session follows this process
        assert daemon.admin("sessions")[0]["pid"] == os.getpid()
        assert session["sid"] == daemon.admin("sessions")[0]["sid"]
    finally:
        client.close()
        bystander.communicate()


def zmtp3_greeting(mechanism: bytes) -> bytes:
    return b"\xff" + bytes(8) + b"\x7f" + b"\x03\x00" + mechanism.ljust(20, b"\0") + bytes(32)


def test_connections_without_a_zmtp3_handshake_never_reach_the_handler(
    daemon: DaemonProcess,
) -> None:
    before = daemon.admin("stats")
    rng = random.Random(7)
    payloads = [
        *(rng.randbytes(rng.randint(1, 2048)) for _ in range(40)),
        b"GET / HTTP/1.1\r\nHost: localhost\r\n\r\n",
        b"\x05\x00hello" * 20,  # ZMTP 1.0 framing: length, flags, body
        b"\x01\x00" + b"\x05\x00hello",  # ZMTP 1.0 identity frame, then a message
        zmtp3_greeting(b"PLAIN") + b"\x04\x1a\x05HELLO\x04user\x08password",
        zmtp3_greeting(b"CURVE"),
        zmtp3_greeting(b"NULL")[:30],  # truncated
    ]
    for name in (WORKER_SOCKET_NAME, ADMIN_SOCKET_NAME):
        for payload in payloads:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.connect(str(daemon.run_dir / name))
                sock.settimeout(0.5)
                try:
                    sock.sendall(payload)
                    sock.recv(64)
                except OSError:
                    pass  # the daemon may hang up first
    time.sleep(0.3)
    after = daemon.admin("stats")
    assert after["requests"] == before["requests"], "garbage reached the worker handler"
    assert after["bad_requests"] == before["bad_requests"], "garbage reached a handler"
    # Still serving.
    with PoolClient(daemon.run_dir, name="after-garbage", timeout=3.0) as pool:
        assert len(pool.allocate("k", 16, "ok")) == 1
    daemon.audit()
