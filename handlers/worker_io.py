"""Buffered reads for TorchServe 0.12's worker protocol.

The worker decodes each batch frame with one `recv` per field (`otf_message_handler._retrieve_buffer`):
a request with 6 HTTP headers costs 34 system calls before the handler sees it. Upstream is archived,
so the worker's reader is swapped here for one that takes whatever the socket holds (up to 256 KiB)
and hands out fields from that buffer. Same bytes, same order, same end-of-connection behaviour.

Bodies are handed over undecoded, to be parsed once by `servekit.handlers.common.decode_body`: the
worker's own json.loads keeps the last of duplicate keys, so a handler given its dict could not refuse
them.
"""
from __future__ import annotations

import logging
import os
import socket
import sys

from ts.protocol import otf_message_handler

CHUNK = 256 * 1024
stock_retrieve = otf_message_handler._retrieve_buffer  # TorchServe's own reader, for comparison
# TorchServe's switch, read for every body the worker decodes: "false" leaves bodies as bytes.
DECODE_SWITCH = "TS_DECODE_INPUT_REQUEST"


class BufferedReader:
    """Hands out exact-length fields of one connection's byte stream, reading it in large chunks."""

    def __init__(self, conn: socket.socket) -> None:
        self.conn = conn
        self._buf = bytearray()
        self._pos = 0

    def read(self, length: int) -> bytearray:
        pos, end = self._pos, self._pos + length
        if end > len(self._buf):
            self._fill(length)
            pos, end = 0, length
        self._pos = end
        return self._buf[pos:end]

    def _fill(self, length: int) -> None:
        """Drops what was handed out and reads until `length` bytes are buffered."""
        del self._buf[: self._pos]
        self._pos = 0
        while len(self._buf) < length:
            chunk = self.conn.recv(max(CHUNK, length))
            if not chunk:
                logging.info("Frontend disconnected.")
                sys.exit(0)  # what TorchServe's own reader does: the worker process ends
            self._buf += chunk


_reader: BufferedReader | None = None  # a worker process talks to the frontend over one connection


def _buffered_retrieve(conn: socket.socket, length: int) -> bytearray:
    global _reader
    if _reader is None or _reader.conn is not conn:
        _reader = BufferedReader(conn)
    return _reader.read(length)


def install_buffered_reads() -> bool:
    """Routes the worker's frame decoding through `BufferedReader` and leaves request bodies undecoded
    (bytes, for `decode_body`); True if the reader was not installed yet.

    Safe to call from a handler's `initialize`: TorchServe has read the whole load frame by then and
    nothing else is buffered, so the next frame starts at the reader's first byte.
    """
    os.environ[DECODE_SWITCH] = "false"
    if otf_message_handler._retrieve_buffer is _buffered_retrieve:
        return False
    otf_message_handler._retrieve_buffer = _buffered_retrieve
    return True
