"""Fixtures shared by the test suite: a real vqpoold, worker processes, and pools of both kinds.

* ``run_dir``: a fresh short run directory (removed afterwards).
* ``daemon``: a vqpoold on ``run_dir`` with a 256-block pool and a 1 s lease.
* ``start_daemon``: a factory for daemons with other options (stopped afterwards).
* ``start_worker``: a factory for worker processes on a run directory (stopped afterwards).
* ``pooled``: a factory of pooled caches of ``builtin:llama``: ``pooled(n_blocks)`` gives a
  ``PooledCacheSource`` on a fresh daemon with that many blocks, and the daemon.
* ``make_pool``: parametrized over "local" and "remote": ``make_pool(PoolConfig(...))`` gives a
  BlockPoolAllocator or a PoolClient on a fresh daemon with that configuration, so one test
  checks that both behave the same.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from daemon_harness import AgentProcess, daemon_args_for, remove_tree, short_tmpdir
from vqpool.shared import BlockPool, BlockPoolAllocator, PoolConfig
from vqpool.worker.kv.cache_source import PooledCacheSource
from vqpool.worker.models.loading import LoadedModel, load_model
from vqpool.worker.pool.client import PoolClient
from vqpool.worker.run_worker import open_pool
from vqpool.worker.testing.launch import DaemonProcess
from vqpool.worker.testing.model_dirs import write_model_dir

DEFAULT_DAEMON_ARGS = ("--n-blocks", "256", "--lease", "1", "--log-level", "INFO")


@pytest.fixture
def run_dir() -> Iterator[Path]:
    base = short_tmpdir()
    yield base / "run"
    remove_tree(base)


@pytest.fixture
def start_daemon() -> Iterator[Callable[..., DaemonProcess]]:
    started: list[tuple[DaemonProcess, Path | None]] = []

    def start(*args: str, run_dir: Path | None = None, wait: bool = True) -> DaemonProcess:
        base = None
        if run_dir is None:
            base = short_tmpdir()
            run_dir = base / "run"
        daemon = DaemonProcess(run_dir, *args).start(wait=wait)
        started.append((daemon, base))
        return daemon

    yield start
    for daemon, base in started:
        daemon.stop()
        if base is not None:
            remove_tree(base)


@pytest.fixture
def pooled(
    start_daemon: Callable[..., DaemonProcess],
) -> Iterator[Callable[[int], tuple[PooledCacheSource, DaemonProcess]]]:
    model = load_model("builtin:llama").model
    pools: list[PoolClient] = []

    def make(n_blocks: int) -> tuple[PooledCacheSource, DaemonProcess]:
        daemon = start_daemon("--n-blocks", str(n_blocks))
        pool, source = open_pool(str(daemon.run_dir), "pooled", model, 5.0)
        pools.append(pool)
        return source, daemon

    yield make
    for pool in pools:
        pool.close()


@pytest.fixture
def daemon(start_daemon: Callable[..., DaemonProcess]) -> DaemonProcess:
    return start_daemon(*DEFAULT_DAEMON_ARGS)


@pytest.fixture
def start_worker() -> Iterator[Callable[[Path, str], AgentProcess]]:
    workers: list[AgentProcess] = []

    def start(run_dir: Path, name: str = "worker") -> AgentProcess:
        worker = AgentProcess(run_dir, name)
        workers.append(worker)
        return worker

    yield start
    for worker in workers:
        worker.stop()


@pytest.fixture(params=["local", "remote"])
def make_pool(
    request: pytest.FixtureRequest, start_daemon: Callable[..., DaemonProcess]
) -> Iterator[Callable[[PoolConfig], BlockPool]]:
    from vqpool.worker import PoolClient

    clients: list[PoolClient] = []

    def make(config: PoolConfig) -> BlockPool:
        if request.param == "local":
            return BlockPoolAllocator(config)
        daemon = start_daemon(*daemon_args_for(config))
        client = PoolClient(daemon.run_dir, name="test")
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.close()


@pytest.fixture(scope="module")
def tool_chat_dir() -> Iterator[Path]:
    """A test-written model directory whose tokenizer marks thinking and tool calls."""
    base = short_tmpdir("vqc")
    yield write_model_dir(base / "tools", "llama", tool_chat=True)
    remove_tree(base)


@pytest.fixture(scope="module")
def tool_chat_model(tool_chat_dir: Path) -> LoadedModel:
    return load_model(str(tool_chat_dir))
