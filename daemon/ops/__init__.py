"""The requests of the two sockets: each op's handler (``admin/``, ``worker/``), the table that
maps op names to handlers and parameters, and each socket's dispatcher. See docs/protocol.md.
"""
