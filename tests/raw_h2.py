"""A bare HTTP/2 (cleartext, prior knowledge) client for header blocks that real clients will not
send: curl's nghttp2 refuses to send a header block over 64 KiB, and the project's environment
has no ``h2``. It writes one request (HPACK literals, no Huffman, no dynamic table; CONTINUATION
frames past 16 KiB) and reads frames until the stream ends or is reset.
"""

from __future__ import annotations

import socket
import struct
from dataclasses import dataclass

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_DATA, _HEADERS, _RST_STREAM, _SETTINGS, _GOAWAY, _CONTINUATION = 0x0, 0x1, 0x3, 0x4, 0x7, 0x9
_END_STREAM, _END_HEADERS, _ACK = 0x1, 0x4, 0x1
INTERNAL_ERROR, COMPRESSION_ERROR = 0x2, 0x9
"""HTTP/2 error codes (RFC 9113 7)."""
_MAX_FRAME = 16384
# HPACK's static table (RFC 7541, appendix A): the :status entries Envoy's encoder may index.
_STATIC_STATUS = {8: 200, 9: 204, 10: 206, 11: 304, 12: 400, 13: 404, 14: 500}


@dataclass
class H2Reply:
    status: int | None
    """None when no response headers came (the stream or connection was reset first)."""
    body: bytes
    reset: int | None
    """The RST_STREAM or GOAWAY error code, if one ended the exchange."""


def _integer(value: int, prefix_bits: int, first: int = 0) -> bytes:
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes([first | value])
    out = [first | limit]
    value -= limit
    while value >= 128:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _literal(name: str, value: str) -> bytes:
    """A literal field without indexing, new name (RFC 7541 6.2.2), neither string Huffman-coded."""
    raw_name, raw_value = name.encode(), value.encode()
    return b"\x00" + _integer(len(raw_name), 7) + raw_name + _integer(len(raw_value), 7) + raw_value


def _frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream) + payload


def _status(block: bytes) -> int | None:
    """The :status of a response header block, if its first field carries it as Envoy writes it."""
    if block and block[0] & 0x80:
        return _STATIC_STATUS.get(block[0] & 0x7F)
    # A literal whose name is static entry 8 (:status), with or without indexing, plain value.
    if block[:1] in (b"\x08", b"\x18", b"\x48") and block[1] & 0x80 == 0:
        return int(block[2 : 2 + block[1]])
    return None


def _read_exact(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise ConnectionError("closed")
        data += chunk
    return data


def request(host: str, port: int, path: str, headers: list[tuple[str, str]], body: bytes) -> H2Reply:
    pseudo = [(":method", "POST"), (":scheme", "http"), (":authority", f"{host}:{port}"), (":path", path)]
    block = b"".join(_literal(k, v) for k, v in [*pseudo, *headers])
    pieces = [block[i : i + _MAX_FRAME] for i in range(0, len(block), _MAX_FRAME)] or [b""]
    out = PREFACE + _frame(_SETTINGS, 0, 0, b"")
    for i, piece in enumerate(pieces):
        flags = _END_HEADERS if i == len(pieces) - 1 else 0
        out += _frame(_HEADERS if i == 0 else _CONTINUATION, flags, 1, piece)
    out += _frame(_DATA, _END_STREAM, 1, body)
    status, data = None, b""
    with socket.create_connection((host, port), timeout=10) as sock:
        sock.sendall(out)
        try:
            while True:
                length, kind, flags, stream = struct.unpack(">IBBI", b"\0" + _read_exact(sock, 9))
                payload = _read_exact(sock, length)
                if kind == _SETTINGS and not flags & _ACK:
                    sock.sendall(_frame(_SETTINGS, _ACK, 0, b""))
                elif kind == _HEADERS and stream == 1:
                    status = _status(payload)
                elif kind == _DATA and stream == 1:
                    data += payload
                elif kind in (_RST_STREAM, _GOAWAY) and (stream == 1 or kind == _GOAWAY):
                    code = struct.unpack(">I", payload[-4:] if kind == _RST_STREAM else payload[4:8])[0]
                    return H2Reply(status, data, code)
                if stream == 1 and flags & _END_STREAM and kind in (_DATA, _HEADERS):
                    return H2Reply(status, data, None)
        except (ConnectionError, TimeoutError):
            return H2Reply(status, data, -1)
