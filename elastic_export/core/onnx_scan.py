"""An ONNX file's graph read without parsing its weights: the nodes, and for every initializer its
name, type, shape and where its ``raw_data`` bytes lie in the file.

``onnx.load`` copies every weight into a ``ModelProto`` (0.8 s for a 436 MB all-mpnet-base-v2 file, and
``raw_data`` copies it once more on access); a caller that needs only some weights' bytes (a digest of
the ones several budget files may hold alike) maps the file and reads those. The scan walks protobuf's
wire format (``ModelProto.graph`` -> ``GraphProto.node`` / ``initializer`` -> ``TensorProto`` fields) and
skips every other field; a file that is not well-formed protobuf raises :class:`ScanError`.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass, field
from pathlib import Path

import onnx

MODEL_GRAPH = 7  # ModelProto.graph
GRAPH_NODE, GRAPH_INITIALIZER = 1, 5  # GraphProto.node / .initializer
TENSOR_DIMS, TENSOR_TYPE, TENSOR_NAME, TENSOR_RAW, TENSOR_LOCATION = 1, 2, 8, 9, 14  # TensorProto fields
_VARINT, _FIXED64, _LENGTH, _FIXED32 = 0, 1, 2, 5  # wire types


class ScanError(ValueError):
    """The bytes are not a protobuf message of the expected shape."""


@dataclass
class Initializer:
    """One ``GraphProto.initializer``: ``raw`` is its ``raw_data``'s (offset, length) in the file, None
    when it has none (values in a typed field, or external data)."""

    name: str = ""
    data_type: int = 0
    dims: list[int] = field(default_factory=list)
    raw: tuple[int, int] | None = None
    external: bool = False


@dataclass
class Scan:
    """The file's nodes (parsed: they are small) and initializers (headers only), in file order."""

    nodes: list[onnx.NodeProto]
    initializers: list[Initializer]


def _varint(buf, pos: int, end: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= end or shift > 63:
            raise ScanError("truncated varint")
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7


def _fields(buf, pos: int, end: int):
    """(field number, wire type, value or (start, end) of a length-delimited field) of one message."""
    while pos < end:
        tag, pos = _varint(buf, pos, end)
        number, wire = tag >> 3, tag & 7
        if wire == _VARINT:
            value, pos = _varint(buf, pos, end)
        elif wire in (_FIXED64, _FIXED32):
            size = 8 if wire == _FIXED64 else 4
            value, pos = None, pos + size
        elif wire == _LENGTH:
            length, pos = _varint(buf, pos, end)
            value, pos = (pos, pos + length), pos + length
        else:
            raise ScanError(f"unsupported wire type {wire}")
        if pos > end or number == 0:
            raise ScanError("field past the end of its message")
        yield number, wire, value


def _initializer(buf, start: int, end: int) -> Initializer:
    t = Initializer()
    for number, wire, value in _fields(buf, start, end):
        if number == TENSOR_DIMS and wire == _VARINT:
            t.dims.append(value - (1 << 64) if value >= 1 << 63 else value)
        elif number == TENSOR_DIMS and wire == _LENGTH:  # packed
            pos, stop = value
            while pos < stop:
                d, pos = _varint(buf, pos, stop)
                t.dims.append(d - (1 << 64) if d >= 1 << 63 else d)
        elif number == TENSOR_TYPE and wire == _VARINT:
            t.data_type = value
        elif number == TENSOR_NAME and wire == _LENGTH:
            t.name = bytes(buf[value[0]:value[1]]).decode("utf-8")
        elif number == TENSOR_RAW and wire == _LENGTH:
            t.raw = (value[0], value[1] - value[0])
        elif number == TENSOR_LOCATION and wire == _VARINT:
            t.external = value == onnx.TensorProto.EXTERNAL
    if t.external:
        t.raw = None
    return t


def scan_buffer(buf) -> Scan:
    """:class:`Scan` of a serialised ``ModelProto`` (bytes, or a mapped file)."""
    nodes, inits = [], []
    for number, wire, value in _fields(buf, 0, len(buf)):
        if number != MODEL_GRAPH or wire != _LENGTH:
            continue
        for n, w, (start, end) in ((n, w, v) for n, w, v in _fields(buf, *value) if w == _LENGTH):
            if n == GRAPH_NODE:
                try:
                    nodes.append(onnx.NodeProto.FromString(bytes(buf[start:end])))
                except Exception as e:  # protobuf's DecodeError
                    raise ScanError(f"a node does not parse: {e}") from None
            elif n == GRAPH_INITIALIZER:
                inits.append(_initializer(buf, start, end))
    return Scan(nodes, inits)


class MappedModel:
    """An ONNX file mapped read-only, with its :class:`Scan` (``with MappedModel(path) as m:``);
    :meth:`raw` is a zero-copy view of an initializer's bytes, valid while the file is open."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._file = open(self.path, "rb")
        try:
            size = self.path.stat().st_size
            self._map = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
            self.scan = scan_buffer(memoryview(self._map))
        except BaseException:
            self.close()
            raise

    def raw(self, t: Initializer) -> memoryview:
        start, length = t.raw
        return memoryview(self._map)[start:start + length]

    def close(self) -> None:
        m, self._map = getattr(self, "_map", b""), b""
        if isinstance(m, mmap.mmap):
            try:
                m.close()
            except BufferError:  # a view is still held: the map closes when it goes
                pass
        self._file.close()

    def __enter__(self) -> "MappedModel":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
