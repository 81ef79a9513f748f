"""``vqpoolctl``: inspect and steer a running vqpoold through its admin socket.

One module per command in :mod:`vqpool.daemon.ctl.commands` (its docstring is its help); the
argument parser, exit codes and error reporting in :mod:`vqpool.daemon.ctl.cli`. Nothing here
imports mlx or the worker package: the tool runs wherever the daemon does.
"""
