"""The two-way channel between the HTTP front and rank 0: whole messages (picklable tuples), in order.

With paradiff's own launcher the front is another process: messages are length-prefixed pickles over a
Unix socket in a private folder (only this user's processes can reach it, and both ends are paradiff).
Under ``torchrun`` the front runs in rank 0's process, and two queues do.
"""

from __future__ import annotations

import contextlib
import pickle
import queue
import select
import socket
import struct
import threading


class Closed(EOFError):
    """The other end has gone."""


class SocketLink:
    def __init__(self, connection: socket.socket):
        self.connection = connection
        self.sending = threading.Lock()

    @classmethod
    def connect(cls, address: str) -> SocketLink:
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        connection.connect(address)
        return cls(connection)

    def send(self, message: tuple) -> None:
        data = pickle.dumps(message)
        with self.sending:
            try:
                self.connection.sendall(struct.pack("<Q", len(data)) + data)
            except OSError as error:
                raise Closed(str(error)) from error

    def receive(self, timeout_s: float | None = None) -> tuple | None:
        """The next message; None if none starts within ``timeout_s`` seconds."""
        if timeout_s is not None and not select.select([self.connection], [], [], timeout_s)[0]:
            return None
        (size,) = struct.unpack("<Q", self._exactly(8))
        return pickle.loads(self._exactly(size))

    def _exactly(self, size: int) -> bytes:
        data = bytearray()
        while len(data) < size:
            try:
                chunk = self.connection.recv(size - len(data))
            except OSError as error:
                raise Closed(str(error)) from error
            if not chunk:
                raise Closed("the other end closed the connection")
            data += chunk
        return bytes(data)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.connection.shutdown(socket.SHUT_RDWR)
        self.connection.close()


class QueueLink:
    """One end of a pair of queues (:func:`queue_pair`); ``None`` on a queue means the other end closed."""

    def __init__(self, inbox: queue.Queue, outbox: queue.Queue):
        self.inbox, self.outbox = inbox, outbox

    def send(self, message: tuple) -> None:
        self.outbox.put(message)

    def receive(self, timeout_s: float | None = None) -> tuple | None:
        """The next message; None if none comes within ``timeout_s`` seconds."""
        try:
            message = self.inbox.get(timeout=timeout_s)
        except queue.Empty:
            return None
        if message is None:
            self.inbox.put(None)  # every later receive sees the end too
            raise Closed("the other end closed")
        return message

    def close(self) -> None:
        self.outbox.put(None)


def queue_pair() -> tuple[QueueLink, QueueLink]:
    """Two connected ends: what one sends, the other receives."""
    there, back = queue.Queue(), queue.Queue()
    return QueueLink(back, there), QueueLink(there, back)
