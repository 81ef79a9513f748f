"""vqpoold: the coordinator daemon that owns the block bookkeeping.

Its layers, each importing only those below it: ``server/`` (the process and its poll loop),
``ops/`` (each socket's ops), ``budget/`` (the memory budget), ``core/`` (the pool, sessions and
owners); ``net/`` (who is connected) serves the first two. ``ctl/`` is vqpoolctl, apart.
"""
