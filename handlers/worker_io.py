"""Buffered reads for TorchServe 0.12's worker protocol.

The worker decodes each batch frame with one `recv` per field (`otf_message_handler._retrieve_buffer`):
a request with 6 HTTP headers costs 34 system calls before the handler sees it, and each field goes
through three Python calls. Upstream is archived, so the worker's reader is swapped here for one that
takes whatever the socket holds (up to 256 KiB) and a predict frame is parsed from that buffer in one
loop (`read_inference_msg`). Same fields, same order, same end-of-connection behaviour.

Bodies are handed over undecoded, to be parsed once by `servekit.handlers.common.decode_body`: the
worker's own json.loads keeps the last of duplicate keys, so a handler given its dict could not refuse
them.
"""
from __future__ import annotations

import logging
import os
import socket
import struct
import sys

from ts.protocol import otf_message_handler

CHUNK = 256 * 1024
stock_retrieve = otf_message_handler._retrieve_buffer  # TorchServe's own reader, for comparison
stock_inference_msg = otf_message_handler._retrieve_inference_msg
_INT = struct.Struct("!i")
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

    def requests(self) -> list[dict]:
        """The requests of the predict frame whose command byte was read last, parsed from what is
        buffered; a frame not all there yet is read on (at least up to where the parse found the
        buffer short) and parsed again."""
        while True:
            try:
                batch, end = parse_requests(self._buf, self._pos)
            except _Short as short:
                self._fill(short.need)
                continue
            self._pos = end
            return batch

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


def _reader_of(conn: socket.socket) -> BufferedReader:
    global _reader
    if _reader is None or _reader.conn is not conn:
        _reader = BufferedReader(conn)
    return _reader


def _buffered_retrieve(conn: socket.socket, length: int) -> bytearray:
    return _reader_of(conn).read(length)


class _Short(Exception):
    """The buffer ends inside the frame: it needs at least `need` bytes from where the frame starts."""

    def __init__(self, need: int) -> None:
        self.need = need


def parse_requests(buf: bytearray, pos: int) -> tuple[list[dict], int]:
    """The requests of a predict frame whose command byte ended at `pos`, and where the frame ends;
    `_Short` if `buf` ends first. One loop, no call per field (TorchServe makes three per field,
    which cost most of the decoding of a continuous-batching call). A field cut off by the end of
    `buf` is seen at the next length read (every frame ends with one, its -1), which then fails."""
    unpack, start = _INT.unpack_from, pos
    batch = []
    try:
        while True:
            n = unpack(buf, pos)[0]
            pos += 4
            if n == -1:
                return batch, pos
            request_id = buf[pos:pos + n]
            pos += n
            headers = []
            while True:
                n = unpack(buf, pos)[0]
                pos += 4
                if n == -1:
                    break
                name = buf[pos:pos + n]
                pos += n
                n = unpack(buf, pos)[0]
                pos += 4
                headers.append({"name": name, "value": buf[pos:pos + n]})
                pos += n
            parameters = []
            while True:
                n = unpack(buf, pos)[0]
                pos += 4
                if n == -1:
                    break
                name = buf[pos:pos + n]
                pos += n
                n = unpack(buf, pos)[0]
                pos += 4
                content_type = buf[pos:pos + n]
                pos += n
                n = unpack(buf, pos)[0]
                pos += 4
                parameters.append({"name": name.decode("utf-8"), "contentType": content_type.decode("utf-8"),
                                   "value": buf[pos:pos + n]})
                pos += n
            batch.append({"requestId": request_id, "headers": headers, "parameters": parameters})
    except struct.error:  # a length read past the end: what is buffered so far ends before `pos + 4`
        raise _Short(pos + 4 - start) from None


def read_inference_msg(conn: socket.socket) -> list[dict]:
    """A predict frame's requests as `otf_message_handler._retrieve_inference_msg` gives them with
    body decoding off: [{"requestId", "headers": [{"name", "value"}], "parameters": [{"name",
    "contentType", "value"}]}], ids, names and values as bytearrays, parameter names and content
    types as str."""
    return _reader_of(conn).requests()


def install_buffered_reads() -> bool:
    """Routes the worker's frame decoding through `BufferedReader` and `read_inference_msg`, which
    leaves request bodies undecoded (bytes, for `decode_body`); True if not installed yet.

    Safe to call from a handler's `initialize`: TorchServe has read the whole load frame by then and
    nothing else is buffered, so the next frame starts at the reader's first byte.
    """
    os.environ[DECODE_SWITCH] = "false"  # for any frame still decoded by TorchServe's own code
    if otf_message_handler._retrieve_inference_msg is read_inference_msg:
        return False
    otf_message_handler._retrieve_buffer = _buffered_retrieve  # the command byte, load frames
    otf_message_handler._retrieve_inference_msg = read_inference_msg
    return True
