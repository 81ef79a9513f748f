"""``vqpoolctl``: inspect and steer a running vqpoold through its admin socket.

One module per command in :mod:`vqpool.daemon.ctl.commands` (its docstring is its help); the
argument parser, exit codes and error reporting in :mod:`vqpool.daemon.ctl.cli`. It imports only
:mod:`vqpool.shared` (the admin ops' declarations and client) and itself: neither the daemon's
modules nor the worker package nor mlx, so it starts fast and runs wherever the daemon does.
"""
