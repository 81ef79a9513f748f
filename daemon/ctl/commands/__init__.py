"""vqpoolctl's commands, one module each.

Each module's docstring is the command's help (first line: the summary ``vqpoolctl --help``
lists), ``add_arguments(parser)`` declares its options, and ``run(ctl, args)`` does the work and
returns an exit status. :data:`COMMANDS` maps command names to modules, in help order.
"""

from types import ModuleType

from vqpool.daemon.ctl.commands import (
    budget,
    cache,
    evict,
    fit,
    history,
    load,
    metrics,
    model,
    owners,
    ps,
    sessions,
    shrink,
    status,
    unload,
    watch,
)

COMMANDS: dict[str, ModuleType] = {
    module.__name__.rsplit(".", 1)[-1]: module
    for module in (
        status,
        sessions,
        owners,
        budget,
        model,
        fit,
        cache,
        shrink,
        evict,
        history,
        metrics,
        watch,
        ps,
        load,
        unload,
    )
}
