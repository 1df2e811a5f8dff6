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
from functools import cache
from pathlib import Path
from typing import Any

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


class AvroCodec:
    """One writer schema: encode to single-object bytes, decode them back."""

    def __init__(self, schema: dict[str, Any]) -> None:
        self.parsed = parse_schema(schema)
        self.name: str = self.parsed["name"]
        self.canonical = to_parsing_canonical_form(self.parsed)
        self.fingerprint = crc64_avro(self.canonical.encode())
        self.header = MAGIC + struct.pack("<Q", self.fingerprint)

    def encode(self, datum: dict[str, Any]) -> bytes:
        buf = io.BytesIO()
        buf.write(self.header)
        schemaless_writer(buf, self.parsed, datum)
        return buf.getvalue()

    def decode(self, data: bytes) -> dict[str, Any]:
        if data[:10] != self.header:
            raise ValueError(f"not a single-object {self.name} record")
        result: dict[str, Any] = schemaless_reader(io.BytesIO(data[10:]), self.parsed, None)
        return result


@cache
def codec(name: str) -> AvroCodec:
    """The codec for ``schemas/<name>.avsc`` (``observation``, ``approved_call``)."""
    return AvroCodec(orjson.loads((SCHEMAS_DIR / f"{name}.avsc").read_bytes()))


def decode_any(data: bytes, names: tuple[str, ...] = ("observation", "approved_call")) -> Any:
    """Decode a single-object record written with any of the named schemas."""
    for name in names:
        c = codec(name)
        if data[:10] == c.header:
            return c.decode(data)
    raise ValueError("unknown schema fingerprint")
