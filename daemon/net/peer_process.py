"""The process behind the connection a request came on, as the kernel tells it.

A hello names the worker's pid, and the session lives and dies with that process. A client must
not be able to name another one: a session tied to a bystander is reaped when the bystander
exits (taking the blocks the client still uses), and one tied to pid 1 outlives the client.
Where the platform tells libzmq the peer's credentials (Linux: ``SO_PEERCRED``), every message
of an ipc connection carries them in its ``Peer-Address`` property, ``localhost:uid:gid:pid``;
the hello's pid must be that pid. macOS gives libzmq no pid: there the declared pid is only
checked to be a live process of the daemon's user.

Only ``hello`` needs this, but a property can only be read from a message received zero-copy.
The server loop therefore receives each request's routing-id frame (the first, a few bytes)
zero-copy, its other frames as bytes, and leaves the routing-id frame here while the request
is handled: one attribute store per request, and the property is read on hello only.
"""

from __future__ import annotations

import zmq
from vqpool.daemon.net.peer_auth import peer_pid

PEER_ADDRESS = "Peer-Address"


class RequestPeer:
    """The connection of the request being handled.

    Attributes:
        frame: The request's routing-id frame, received zero-copy (it carries the connection's
            properties), set by the server loop before each request; None outside one.
    """

    __slots__ = ("frame",)

    def __init__(self) -> None:
        self.frame: zmq.Frame | None = None

    def pid(self) -> int | None:
        """The pid of the connected process, or None where the platform does not tell it."""
        frame = self.frame
        if frame is None:
            return None
        try:
            address = frame.get(PEER_ADDRESS)
        except zmq.ZMQError:  # no such property: no credentials on this platform or transport
            return None
        return peer_pid(str(address).encode())
