"""Admin commands of vqpoold, one module each.

Every module defines ``PARAMS`` (its op's arguments, their checks and help, as
:mod:`vqpool.shared.protocol.admin_ops` declares them with what the op does) and
``run(coord, args)`` returning a msgpack-able result. :data:`COMMANDS` maps each admin op name to
its module.
"""

from types import ModuleType

from vqpool.daemon.commands import (
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
