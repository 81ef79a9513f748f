"""Admin commands of vqpoold, one module each (the module docstring is its help).

Every module defines ``PARAMS`` (a tuple of :class:`vqpool.shared.protocol.Field`: the op's
arguments, their checks and help) and ``run(state, args)`` returning a msgpack-able result
(``state``: the :class:`~vqpool.daemon.ops.state.DaemonState`).
:data:`COMMANDS` maps each admin op name to its module; ``vqpoolctl`` can build its sub-commands
and their help from it.
"""

from types import ModuleType

from vqpool.daemon.ops.admin import (
    audit,
    budget,
    cache_drop,
    evict_session,
    fit,
    history,
    metrics,
    model_list,
    model_set,
    owners,
    ping,
    sessions,
    shrink,
    stats,
)

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
        model_list,
        fit,
        cache_drop,
    )
}
