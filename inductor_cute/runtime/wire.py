"""Messages between a process and its compile workers: length-prefixed pickles over pipes.

Both ends are our own code started by us, so pickle (which keeps KernelSpec's tuples as tuples)
is safe here.
"""

from __future__ import annotations

import pickle
import struct

_LENGTH = struct.Struct("<Q")


def encode(message) -> bytes:
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return _LENGTH.pack(len(body)) + body


def read_message(stream):
    """The next message from a blocking binary stream; None at end of stream."""
    head = stream.read(_LENGTH.size)
    if len(head) < _LENGTH.size:
        return None
    (n,) = _LENGTH.unpack(head)
    body = stream.read(n)
    if len(body) < n:
        return None
    return pickle.loads(body)


class MessageBuffer:
    """Bytes read so far from a non-blocking pipe, cut into whole messages."""

    def __init__(self):
        self._data = bytearray()

    def feed(self, data: bytes) -> list:
        self._data += data
        out = []
        while len(self._data) >= _LENGTH.size:
            (n,) = _LENGTH.unpack_from(self._data)
            end = _LENGTH.size + n
            if len(self._data) < end:
                break
            out.append(pickle.loads(bytes(self._data[_LENGTH.size:end])))
            del self._data[:end]
        return out
