"""The protocol's bounds: every size, count and range a message may reach.

Decoding never trusts a length the sender claims: msgpack runs with explicit ``max_*_len``
limits (:mod:`vqpool.shared.protocol.codec`), the frame size is capped by ``ZMQ_MAXMSGSIZE``
(:data:`MAX_MESSAGE_BYTES`), and every field is checked for type and range
(:mod:`vqpool.shared.protocol.checks`) before the daemon acts on it.
"""

from __future__ import annotations

INT64_MIN = -(1 << 63)
INT64_MAX = (1 << 63) - 1

MAX_MESSAGE_BYTES = 1 << 20
"""Largest request frame the daemon accepts (``ZMQ_MAXMSGSIZE``); larger ones drop the peer's
connection inside libzmq before any byte is buffered."""

MAX_REPLY_BYTES = 256 << 20
"""Largest reply a client accepts (blocks_for of a huge owner, history, metrics)."""

MAX_ITEMS = 65536
"""Longest array in a request: block ids of one free, updates of one mark_used."""

MAX_MAP_LEN = 64
"""Most pairs of one map in a request."""

MAX_BATCH = 4096
"""Most allocations in one allocate_many."""

MAX_BLOCKS_PER_ALLOCATE = 65536
"""Most blocks one allocation may ask for (bounds growth and the reply size)."""

MAX_BLOCKS_PER_REQUEST = 65536
"""Most blocks one request may ask for, all items of an allocate_many together: without it,
4,096 items of MAX_BLOCKS_PER_ALLOCATE could grow a growable pool by 268 M blocks at once."""

MAX_BYTES_PER_BLOCK = 1 << 32
"""Largest ``bytes_per_block`` a hello may announce (4 GiB: a block of 16 tokens of a
405B-parameter model holds ~4 MiB per stream). The admin views multiply it by the blocks a
session holds: with this bound no product or sum reaches 2**63 before the pool holds 2**31
blocks, far more than a daemon can track."""

MAX_FIT_CONTEXT = 1 << 24
"""Most tokens per sequence a ``fit`` may ask about (16,777,216): past the longest context
window of any model today (10 M tokens, Llama 4 Scout)."""

MAX_FIT_CONCURRENCY = 1 << 16
"""Most sequences at once a ``fit`` may ask about (65,536): past any worker's batch (a Mac's
memory holds a few thousand sequences of a few hundred tokens of the smallest models). With
MAX_FIT_CONTEXT a fit prices at most 2**40 token slots: at 4 MiB per 16-token block and stream
(a 405B-parameter model) its byte counts stay below 2**60. Only a worker declaring bytes per
block far past any model's could ask for more than the reply's integers carry (2**63): the
daemon refuses that fit with INVALID_VALUE."""

MAX_ERROR_MESSAGE_LEN = 256
"""Longest error message the daemon sends; longer ones are cut (a message may quote an owner id
and a model name, each a few hundred characters at most)."""

MAX_OWNER_LEN = 128
"""Longest string owner id, in characters."""

MAX_TAG_LEN = 32
"""Longest stream or format tag."""

MAX_TEXT_LEN = 256
"""Longest free text in a request (model name, client version, boot id, nonce)."""

MAX_LOAD = (1 << 31) - 1
"""Largest running or queued request count a worker may report in ``ping``."""

MAX_CLAIM_GROUPS = 16
"""Most (stream, format) groups of blocks one owner may claim."""

MAX_WAIT_SECONDS = 60.0
"""Longest an allocation may wait at the daemon for memory (``wait``)."""

MAX_RECLAIM_POLL_SECONDS = 30.0
"""Longest a ``reclaim_poll`` may wait at the daemon for an ask."""

MAX_RECLAIM_BYTES = 1 << 50
"""Largest byte count a ``reclaim_done`` may claim (the budget's own bound)."""

MAX_MEMORY_BYTES = 1 << 50
"""Largest byte count of a worker's memory report (``ping``'s ``memory``; 1 PiB, the budget's
own bound): the daemon sums reports over at most MAX_SESSIONS sessions, far below 2**63."""
