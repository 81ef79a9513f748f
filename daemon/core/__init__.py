"""The pool's bookkeeping: the coordinator (one allocator, the sessions, who holds which owner),
restart claims, the reply cache and error replies, the timeline, and the admin views of sessions
and owners.

The lowest layer of the daemon: it imports nothing of the budget, the ops or the server above it.
"""
