"""What vqpoold can be told: defaults, the TOML settings file, and the pool they describe.

The environment and the command line are applied on top by ``daemon/__main__.py``.
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, field, fields
from typing import Any

from vqpool.shared.pool import DEFAULT_BLOCK_SIZE, PoolConfig

# A session whose process is stopped (SIGSTOP, a debugger) keeps its blocks for this long after
# it was last heard from. Long enough for a Ctrl-Z/fg or a debugger breakpoint, short enough that
# a frozen worker does not starve the others for minutes.
DEFAULT_LEASE_SECONDS = 10.0
DEFAULT_N_BLOCKS = 1024

# With a budget and no --n-blocks, the id space is sized from the budget: one id per 4 KiB of
# it per stream, at most 2^24 ids per stream and at least the default pool's. 4 KiB is the
# smallest block of the built-in tiny models (fp32 keys or values of 2 layers x 16 slots x 32
# dims); a real model's is tens to hundreds of KiB (Qwen2.5-0.5B at fp16: 24 layers x 2 heads x
# 64 dims x 16 slots x 2 bytes = 96 KiB), so the budget binds before the ids for any of them.
# Each id the pool grows to costs the daemon about 90 bytes of bookkeeping: a 512 MiB budget
# allows 262,144 ids (about 23 MiB), not the 1,048,576 (90 MiB) of one id per KiB.
BUDGET_BYTES_PER_ID = 4096
MAX_IDS_PER_STREAM = 2**24
MIN_IDS_PER_STREAM = DEFAULT_N_BLOCKS // 2

# After a restart, how long the daemon waits for its previous workers to re-declare their blocks
# before it serves new allocations (it stops waiting as soon as all of them have). Four heartbeats
# of a client at the default heartbeat (1.25 s): an idle worker notices the restart by its next
# heartbeat; and shorter than PoolClient's 10 s call deadline, so a call that waits it out
# still succeeds.
DEFAULT_CLAIM_GRACE_SECONDS = 5.0


@dataclass
class DaemonSettings:
    """Everything vqpoold can be told, from defaults, a TOML file, the environment and the CLI.

    Attributes:
        run_dir: Directory holding the sockets and the lock file; None means the default.
        n_blocks: Blocks in the pool at start (split between "k" and "v" unless ``shared_kv``).
        block_size: Token slots per block.
        shared_kv: One free list for keys and values (the seed's ``separate_kv=False``).
        grow: Grow the pool on exhaustion instead of failing the allocation.
        max_blocks: Cap on total blocks when growing; None means no cap.
        lease: Seconds a stopped worker keeps its blocks after it was last heard from.
        claim_grace: After a restart, the longest the daemon takes claims from its previous
            workers before serving new allocations (0: no claim period).
        log_level: Python logging level name for the daemon's stderr log.
        metrics_port: Serve Prometheus metrics at http://127.0.0.1:PORT/metrics (0: any free
            port, logged at start); None (the default) serves none.
        budget: Bytes of KV cache all models may hold together: a size (``"8GiB"``, an int of
            bytes) or a share of physical memory (``"40%"``); None: no budget (docs/budget.md).
        models: Per-model budget settings as written in the TOML ``[models."NAME"]`` tables
            (``reserve``, ``limit``, ``weight``), checked by the daemon at start.
        lend_reserves: Let a model borrow other models' unused reserves; a model that needs
            its reserve back gets it by reclaim from the workers that poll for asks.
        reclaim_deadline: Seconds a worker has to give bytes back when asked.
    """

    run_dir: str | None = None
    n_blocks: int = DEFAULT_N_BLOCKS
    block_size: int = DEFAULT_BLOCK_SIZE
    shared_kv: bool = False
    grow: bool = False
    max_blocks: int | None = None
    lease: float = DEFAULT_LEASE_SECONDS
    claim_grace: float = DEFAULT_CLAIM_GRACE_SECONDS
    log_level: str = "INFO"
    metrics_port: int | None = None
    budget: str | int | None = None
    models: dict[str, Any] = field(default_factory=dict)
    lend_reserves: bool = False
    reclaim_deadline: float = 1.0
    n_blocks_given: bool = field(default=False, repr=False)
    """Whether ``n_blocks`` was set by the file or the command line (else a budget sizes the id
    space)."""

    def pool_config(self, budget_bytes: int | None = None) -> PoolConfig:
        """The allocator configuration these settings describe (validated by PoolConfig).

        With a budget of ``budget_bytes`` and no ``n_blocks`` given, the pool grows on demand up
        to ``budget // 4 KiB`` blocks per stream (at least 512, at most 2^24): the budget binds,
        not the ids, for every real model's block size (``BUDGET_BYTES_PER_ID``).
        """
        if budget_bytes is not None and not self.n_blocks_given:
            n_streams = 1 if self.shared_kv else 2
            per_stream = budget_bytes // BUDGET_BYTES_PER_ID
            per_stream = max(MIN_IDS_PER_STREAM, min(per_stream, MAX_IDS_PER_STREAM))
            return PoolConfig(
                block_size=self.block_size,
                n_blocks=min(self.n_blocks, per_stream * n_streams),
                separate_kv=not self.shared_kv,
                grow_on_exhaustion=True,
                max_blocks=per_stream * n_streams,
            )
        return PoolConfig(
            block_size=self.block_size,
            n_blocks=self.n_blocks,
            separate_kv=not self.shared_kv,
            grow_on_exhaustion=self.grow,
            max_blocks=self.max_blocks,
        )


_SETTING_TYPES: dict[str, tuple[type, ...]] = {
    "run_dir": (str,),
    "n_blocks": (int,),
    "block_size": (int,),
    "shared_kv": (bool,),
    "grow": (bool,),
    "max_blocks": (int,),
    "lease": (int, float),
    "claim_grace": (int, float),
    "log_level": (str,),
    "metrics_port": (int,),
    "budget": (str, int),
    "models": (dict,),
    "lend_reserves": (bool,),
    "reclaim_deadline": (int, float),
}


def load_settings_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read daemon settings from a TOML file: top-level keys named like the CLI options
    (``n_blocks`` or ``n-blocks``), optionally inside a ``[vqpoold]`` table.

    Raises:
        ValueError: The file is not valid TOML, or has an unknown key or a wrongly typed value.
    """
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{path}: not valid TOML: {exc}") from exc
    table = data.get("vqpoold", data)
    if not isinstance(table, dict):
        raise ValueError(f"{path}: [vqpoold] must be a table")
    if table is not data and "models" in data:  # [models."NAME"] tables beside [vqpoold]
        table = {**table, "models": data["models"]}
    table = {k: v for k, v in table.items() if k != "serve"}  # vqpool serve's own table
    known = {f.name for f in fields(DaemonSettings)} - {"n_blocks_given"}
    settings: dict[str, Any] = {}
    for raw_key, value in table.items():
        key = raw_key.replace("-", "_")
        if key not in known:
            raise ValueError(f"{path}: unknown setting {raw_key!r} (known: {sorted(known)})")
        types = _SETTING_TYPES[key]
        if (isinstance(value, bool) and bool not in types) or not isinstance(value, types):
            names = " or ".join(t.__name__ for t in types)
            raise ValueError(f"{path}: {raw_key} must be {names}, got {value!r}")
        settings[key] = value
    if "n_blocks" in settings:
        settings["n_blocks_given"] = True
    return settings
