"""Admin commands of vqpoold, one module each.

Every module defines ``PARAMS`` (its op's arguments, their checks and help, as
:mod:`vqpool.shared.protocol.admin_ops` declares them with what the op does) and
``run(state, args)`` returning a msgpack-able result (``state``: the
:class:`~vqpool.daemon.ops.state.DaemonState`). :data:`COMMANDS` maps each admin op name to its
module; :data:`ADMIN_TABLE` is the admin socket's op table (see ``ops/op_table.py``), built the
same way as the worker socket's.
"""

from types import ModuleType

from vqpool.daemon.ops.admin import (
    audit,
    budget,
    cache_drop,
    evict_session,
    fit,
    history,
    load_release,
    load_reserve,
    metrics,
    model_list,
    model_set,
    model_unset,
    owners,
    ping,
    sessions,
    shrink,
    stats,
)
from vqpool.daemon.ops.op_table import AdminHandler, Op, op_table
from vqpool.shared.protocol import ADMIN_OPS

COMMANDS: dict[str, ModuleType] = {
    module.__name__.rsplit(".", 1)[-1]: module
    for module in (
        shrink,
        sessions,
        owners,
        evict_session,
        stats,
        history,
        metrics,
        audit,
        ping,
        budget,
        model_set,
        model_unset,
        model_list,
        fit,
        cache_drop,
        load_reserve,
        load_release,
    )
}

ADMIN_TABLE: dict[str, Op[AdminHandler]] = op_table(
    ADMIN_OPS,
    {name: module.PARAMS for name, module in COMMANDS.items()},
    {name: module.run for name, module in COMMANDS.items()},
)
