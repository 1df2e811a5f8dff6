"""Avro single-object encoding of the records the processor writes.

Framing follows the Avro specification: the marker ``C3 01``, the 8-byte
little-endian CRC-64-AVRO fingerprint of the writer schema's Parsing
Canonical Form, then the binary-encoded datum. Any Avro library holding the
``.avsc`` files in ``schemas/`` can decode it; ``decode`` picks the writer
schema by fingerprint.
"""

from __future__ import annotations

import io
import struct
from collections.abc import Callable
from functools import cache, lru_cache
from pathlib import Path
from typing import Any, cast

import orjson
from fastavro import parse_schema, schemaless_reader, schemaless_writer
from fastavro.schema import to_parsing_canonical_form

SCHEMAS_DIR = Path(__file__).resolve().parent.parent.parent / "schemas"
MAGIC = b"\xc3\x01"

_EMPTY64 = 0xC15D213AA4D7A795


def _fp_table() -> list[int]:
    table = []
    for i in range(256):
        fp = i
        for _ in range(8):
            fp = (fp >> 1) ^ (_EMPTY64 & -(fp & 1))
        table.append(fp & 0xFFFFFFFFFFFFFFFF)
    return table


_FP_TABLE = _fp_table()


def crc64_avro(data: bytes) -> int:
    """The Rabin fingerprint the Avro spec names CRC-64-AVRO."""
    fp = _EMPTY64
    for b in data:
        fp = (fp >> 8) ^ _FP_TABLE[(fp ^ b) & 0xFF]
    return fp


def _zigzag_varint(n: int) -> bytes:
    n = (n << 1) ^ (n >> 63)
    if n < 128:
        return _SMALL[n]
    if n < 16384:
        return bytes((n & 0x7F | 0x80, n >> 7))
    if n < 2097152:  # offsets and sizes up to a few million: three bytes
        return bytes((n & 0x7F | 0x80, (n >> 7) & 0x7F | 0x80, n >> 14))
    out = bytearray()
    while n > 127:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


_SMALL = [bytes([i]) for i in range(128)]
_DOUBLE = struct.Struct("<d").pack

_timestamp_varint = lru_cache(maxsize=1024)(_zigzag_varint)
"""Timestamps repeat: every decision of a batch carries the batch's clock reading, and
every call of a contract the same deadline. Their six-byte varints are cached."""


class _EncoderSource:
    """Generates the straight-line Python of an encoder for one Avro schema.

    fastavro's generic writer spends most of its time dispatching on the
    schema per field; an encoder written out for one schema does only the
    byte work. It covers the types our records use (records, enums, arrays,
    null unions, strings, ints, longs, doubles, booleans); ``codec`` checks
    its output against fastavro's decoder when it is built.
    """

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.consts: dict[str, Any] = {"_v": _zigzag_varint, "_t": _timestamp_varint, "_d": _DOUBLE}
        self.n = 0

    def var(self) -> str:
        self.n += 1
        return f"x{self.n}"

    def emit(self, schema: Any, expr: str, indent: int) -> None:
        pad = "    " * indent
        t = schema["type"] if isinstance(schema, dict) else schema
        if isinstance(schema, list):
            if len(schema) != 2 or "null" not in schema:
                raise NotImplementedError("only [null, X] unions")
            other = schema[1] if schema[0] == "null" else schema[0]
            null_index = schema.index("null")
            v = self.var()
            self.lines.append(f"{pad}{v} = {expr}")
            self.lines.append(f"{pad}if {v} is None:")
            self.lines.append(f"{pad}    b += {bytes([null_index * 2])!r}")
            self.lines.append(f"{pad}else:")
            self.lines.append(f"{pad}    b += {bytes([(1 - null_index) * 2])!r}")
            self.emit(other, v, indent + 1)
        elif t == "record":
            v = self.var()
            self.lines.append(f"{pad}{v} = {expr}")
            for f in schema["fields"]:
                self.emit(f["type"], f"{v}[{f['name']!r}]", indent)
        elif t == "enum":
            table = self.var()
            self.consts[table] = {s: _zigzag_varint(i) for i, s in enumerate(schema["symbols"])}
            self.lines.append(f"{pad}b += {table}[{expr}]")
        elif t == "array":
            v, item = self.var(), self.var()
            self.lines.append(f"{pad}{v} = {expr}")
            self.lines.append(f"{pad}if {v}:")
            self.lines.append(f"{pad}    b += _v(len({v}))")
            self.lines.append(f"{pad}    for {item} in {v}:")
            self.emit(schema["items"], item, indent + 2)
            self.lines.append(f"{pad}b += b'\\x00'")
        elif t == "string":
            v = self.var()
            self.lines.append(f"{pad}{v} = {expr}.encode()")
            self.varint(f"len({v})", pad)
            self.lines.append(f"{pad}b += {v}")
        elif (
            t == "long"
            and isinstance(schema, dict)
            and schema.get("logicalType", "").startswith("timestamp")
        ):
            self.lines.append(f"{pad}b += _t({expr})")
        elif t in ("int", "long"):
            self.varint(expr, pad)
        elif t == "boolean":
            self.lines.append(f"{pad}b += b'\\x01' if {expr} else b'\\x00'")
        elif t == "double":
            self.lines.append(f"{pad}b += _d({expr})")
        else:
            raise NotImplementedError(f"Avro type {t!r}")

    def varint(self, expr: str, pad: str) -> None:
        """Inline the common one- and two-byte cases (0 <= n < 8192: lengths of ids,
        hashes and messages) instead of calling ``_v``."""
        n = self.var()
        self.lines.append(f"{pad}{n} = {expr}")
        self.lines.append(f"{pad}if 0 <= {n} < 64:")
        self.lines.append(f"{pad}    b.append({n} << 1)")
        self.lines.append(f"{pad}elif 0 <= {n} < 8192:")
        self.lines.append(f"{pad}    b.append(({n} << 1) & 0x7F | 0x80)")
        self.lines.append(f"{pad}    b.append({n} >> 6)")
        self.lines.append(f"{pad}else:")
        self.lines.append(f"{pad}    b += _v({n})")

    def build(self, schema: dict[str, Any], header: bytes) -> Any:
        self.lines = ["def encode(d):", f"    b = bytearray({header!r})"]
        self.emit(schema, "d", 1)
        self.lines.append("    return bytes(b)")
        namespace = dict(self.consts)
        exec("\n".join(self.lines), namespace)
        return namespace["encode"]


class AvroCodec:
    """One writer schema: encode to single-object bytes, decode them back."""

    def __init__(self, schema: dict[str, Any]) -> None:
        self.parsed: dict[str, Any] = cast(dict[str, Any], parse_schema(schema))
        self.name: str = self.parsed["name"]
        self.canonical = to_parsing_canonical_form(self.parsed)
        self.fingerprint = crc64_avro(self.canonical.encode())
        self.header = MAGIC + struct.pack("<Q", self.fingerprint)
        self._encode = _EncoderSource().build(_resolved(self.parsed), self.header)

    def encode(self, datum: dict[str, Any]) -> bytes:
        """Single-object bytes; the datum must already match the schema's types."""
        result: bytes = self._encode(datum)
        return result

    def field_encoder(self, *path: str) -> Callable[[Any], bytes]:
        """The binary encoding of one field's value alone, no header: ``path`` names a
        field of the record, then a field of that one, and so on. For writers that
        assemble a record from cached segments."""
        schema: Any = _resolved(self.parsed)
        for name in path:
            schema = next(f["type"] for f in schema["fields"] if f["name"] == name)
        wrapper = {"type": "record", "name": "Field", "fields": [{"name": "v", "type": schema}]}
        encode = _EncoderSource().build(wrapper, b"")
        return lambda value: cast(bytes, encode({"v": value}))

    def encode_checked(self, datum: dict[str, Any]) -> bytes:
        """fastavro's validating writer: slower, for data of unknown shape."""
        buf = io.BytesIO()
        buf.write(self.header)
        schemaless_writer(buf, self.parsed, datum)
        return buf.getvalue()

    def leading_strings(self, data: bytes, count: int) -> list[str]:
        """The record's first ``count`` fields, which must be strings, read without
        decoding the rest: enough to tell whose record it is before paying for a decode."""
        fields = self.parsed["fields"][:count]
        if len(fields) < count or any(f["type"] != "string" for f in fields):
            raise TypeError(f"the first {count} fields of {self.name} are not all strings")
        if data[:10] != self.header:
            raise ValueError(f"not a single-object {self.name} record")
        out, at = [], 10
        for _ in range(count):
            n, shift = 0, 0
            while True:
                if at >= len(data) or shift > 63:
                    raise ValueError(f"corrupt {self.name} record: a bad length")
                byte = data[at]
                at += 1
                n |= (byte & 0x7F) << shift
                shift += 7
                if byte < 0x80:
                    break
            n = (n >> 1) ^ -(n & 1)
            if n < 0 or at + n > len(data):
                raise ValueError(f"corrupt {self.name} record: a string past its end")
            try:
                out.append(data[at : at + n].decode())
            except UnicodeDecodeError as exc:
                raise ValueError(f"corrupt {self.name} record: {exc.reason}") from exc
            at += n
        return out

    def decode(self, data: bytes) -> dict[str, Any]:
        if data[:10] != self.header:
            raise ValueError(f"not a single-object {self.name} record")
        body = io.BytesIO(data[10:])
        try:
            result = schemaless_reader(body, self.parsed, None)
        except Exception as exc:  # fastavro raises EOFError, UnicodeDecodeError, IndexError...
            raise ValueError(f"corrupt {self.name} record: {type(exc).__name__}") from exc
        if body.tell() != len(data) - 10:
            raise ValueError(f"{len(data) - 10 - body.tell()} bytes after the {self.name} record")
        if not isinstance(result, dict):
            raise ValueError(f"not a {self.name} record")
        return result


def _resolved(schema: Any, named: dict[str, Any] | None = None) -> Any:
    """The schema with references to named types replaced by their definitions."""
    named = {} if named is None else named
    if isinstance(schema, str):
        return named.get(schema, schema)
    if isinstance(schema, list):
        return [_resolved(s, named) for s in schema]
    if schema.get("type") in ("record", "enum", "fixed"):
        named[schema["name"]] = schema
    if schema.get("type") == "record":
        return {
            **schema,
            "fields": [{**f, "type": _resolved(f["type"], named)} for f in schema["fields"]],
        }
    if schema.get("type") == "array":
        return {**schema, "items": _resolved(schema["items"], named)}
    return schema


@cache
def codec(name: str) -> AvroCodec:
    """The codec for ``schemas/<name>.avsc`` (``observation``, ``approved_call``)."""
    return AvroCodec(orjson.loads((SCHEMAS_DIR / f"{name}.avsc").read_bytes()))


def writer_header(data: bytes) -> bytes | None:
    """The single-object header (marker and writer schema fingerprint) ``data`` starts
    with; None when it is not single-object encoded at all."""
    return data[:10] if len(data) >= 10 and data[:2] == MAGIC else None


@cache
def known_headers() -> frozenset[bytes]:
    """The headers of every schema in ``schemas/``. A record framed with any other was
    written with a schema this version does not have: a newer one, during an upgrade."""
    return frozenset(codec(p.stem).header for p in SCHEMAS_DIR.glob("*.avsc"))


def decode_any(
    data: bytes, names: tuple[str, ...] = ("observation", "approved_call", "approval_request")
) -> Any:
    """Decode a single-object record written with any of the named schemas."""
    for name in names:
        c = codec(name)
        if data[:10] == c.header:
            return c.decode(data)
    raise ValueError("unknown schema fingerprint")
