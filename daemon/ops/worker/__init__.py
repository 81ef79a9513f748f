"""Worker ops of vqpoold: their handlers, grouped by concern (``sessions``, ``blocks``,
``budget``, ``pool_stats``), and :data:`WORKER_TABLE`, the worker socket's op table (see
``ops/op_table.py``; the parameters are :data:`vqpool.shared.WORKER_ARGS`).

``hello`` is not in the table: it is served before any session exists (it opens one), so the
dispatcher calls :func:`sessions.hello` with the connection instead of a session.
"""

from vqpool.daemon.ops.op_table import Op, WorkerHandler, op_table
from vqpool.daemon.ops.worker import blocks, budget, pool_stats, sessions
from vqpool.shared.protocol import (
    ALLOCATE,
    ALLOCATE_MANY,
    BLOCKS_FOR,
    CANCEL,
    CLAIM,
    FIT,
    FREE,
    FREE_ALL,
    GOODBYE,
    HELLO,
    HISTORY,
    MARK_USED,
    METRICS,
    N_FREE,
    PING,
    RECLAIM_DONE,
    RECLAIM_POLL,
    REGISTER_OWNER,
    RELEASE_OWNER,
    STATS,
    WORKER_ARGS,
    WORKER_OPS,
)

WORKER_TABLE: dict[str, Op[WorkerHandler]] = op_table(
    WORKER_OPS - {HELLO},
    WORKER_ARGS,
    {
        GOODBYE: sessions.goodbye,
        PING: sessions.ping,
        ALLOCATE: blocks.allocate,
        ALLOCATE_MANY: blocks.allocate_many,
        FREE: blocks.free,
        FREE_ALL: blocks.free_all,
        REGISTER_OWNER: blocks.register_owner,
        RELEASE_OWNER: blocks.release_owner,
        BLOCKS_FOR: blocks.blocks_for,
        MARK_USED: blocks.mark_used,
        CLAIM: blocks.claim,
        CANCEL: blocks.cancel,
        FIT: budget.fit,
        RECLAIM_POLL: budget.reclaim_poll,
        RECLAIM_DONE: budget.reclaim_done,
        N_FREE: pool_stats.n_free,
        STATS: pool_stats.stats,
        HISTORY: pool_stats.history,
        METRICS: pool_stats.metrics,
    },
)
