"""A walk over a request's wire bytes that refuses too many items before protobuf parses them.

Parsing holds the interpreter: 10M empty strings take ~1.5 s of ``FromString`` (measured on the
busy 2-core test machine), during which no other caller is answered, and the declared bounds
(:mod:`.request_limits`) can only be checked on the parsed message. Requests that some in-bounds
request could not be as long as are refused unparsed (``wire/limits.py``); this walk covers the
rest, the types whose bounds add up past the message limit (batches, ``Generate``, text, KV
chunks). It reads tags and lengths only, descending into nested messages, and stops at the first
field that occurs more often than its bound allows (a repeated field's ``count``; a singular field
:data:`SINGULAR_REPEATS` times, which no encoder does), a string or bytes value longer than its
bound, or more than :data:`MAX_UNKNOWN` fields a message does not declare. So its work is bounded
by the declared counts, not by the request's size: a legal request of big values (KV bytes, a long
text) walks a handful of fields, and a flood of tiny items is refused after at most its bound.
"""

from __future__ import annotations

from typing import Callable

from google.protobuf.descriptor import Descriptor, FieldDescriptor

from . import errors
from .request_limits import STRUCT_BYTES, Bound, Table, declared

#: Times a singular field may occur in one message (encoders write it once; parsers merge repeats).
SINGULAR_REPEATS = 16
#: Fields one message may carry that its schema does not declare (a newer client's additions).
MAX_UNKNOWN = 256

_STRING, _BYTES = FieldDescriptor.TYPE_STRING, FieldDescriptor.TYPE_BYTES
_LEN, _VARINT, _I64, _I32 = 2, 0, 1, 5


class _Spec:
    """What one message type allows, by field number."""

    __slots__ = ("fields",)

    def __init__(self) -> None:
        self.fields: dict[int, _Field] = {}


class _Field:
    __slots__ = ("name", "most", "max_len", "child", "repeated")

    def __init__(self, name: str, repeated: bool, most: int, max_len: int | None, child: _Spec | None) -> None:
        self.name, self.repeated, self.most, self.max_len, self.child = name, repeated, most, max_len, child


Scan = Callable[[bytes], "errors.FerrumError | None"]


def compile_scan(desc: Descriptor, table: Table = {}) -> Scan:  # noqa: B006 - read only
    """The walk for requests of ``desc``: ``scan(raw)`` answers None, or the INVALID_ARGUMENT
    error (field path and limit) of the first bound the bytes break. Malformed bytes answer None:
    the parser refuses those itself."""
    spec = _spec(desc, table, {})

    def scan(raw: bytes) -> "errors.FerrumError | None":
        try:
            _walk(raw, 0, len(raw), spec, "")
        except _Broken as e:
            return errors.invalid(e.message, field=e.path, limit=e.limit)
        except (IndexError, _Malformed):
            return None
        return None
    return scan


def _spec(desc: Descriptor, table: Table, memo: dict[str, _Spec]) -> _Spec:
    if desc.full_name in memo:
        return memo[desc.full_name]
    spec = memo[desc.full_name] = _Spec()
    for f in desc.fields:
        b = declared(f, table)
        spec.fields[f.number] = _field(f, b, table, memo)
    return spec


def _field(f: FieldDescriptor, b: Bound, table: Table, memo: dict[str, _Spec]) -> _Field:
    rep = f.is_repeated or (f.message_type is not None and f.message_type.GetOptions().map_entry)
    most = (b.count or 1 << 30) if rep else SINGULAR_REPEATS  # no repeated field lacks a count (a test)
    mt = f.message_type
    if mt is None:
        if f.type == _STRING:
            max_len = b.bytes or (4 * b.chars if b.chars else None)
        elif f.type == _BYTES:
            max_len = b.bytes or None
        elif f.is_repeated and b.count:  # a packed run: at most 10 bytes an item
            max_len = 10 * b.count
        else:
            max_len = None
        return _Field(f.name, rep, most, max_len, None)
    if mt.full_name.startswith("google.protobuf."):  # Struct / Value: held whole, never read
        return _Field(f.name, rep, most, STRUCT_BYTES if mt.full_name == "google.protobuf.Struct" else None, None)
    if mt.GetOptions().map_entry:  # an entry: key 1, value 2, each bounded as the map declares
        entry = _Spec()
        key, val = mt.fields_by_name["key"], mt.fields_by_name["value"]
        entry.fields[1] = _field(key, Bound(chars=b.key_chars), table, memo)
        entry.fields[2] = _field(val, Bound(chars=b.chars, bytes=b.bytes), table, memo)
        return _Field(f.name, rep, most, None, entry)
    return _Field(f.name, rep, most, None, _spec(mt, table, memo))


class _Broken(Exception):
    def __init__(self, path: str, message: str, limit: int) -> None:
        super().__init__(message)
        self.path, self.message, self.limit = path, message, limit


class _Malformed(Exception):
    pass


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    b = buf[pos]
    if b < 0x80:
        return b, pos + 1
    value, shift = b & 0x7F, 7
    while True:
        pos += 1
        b = buf[pos]
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, pos + 1
        shift += 7
        if shift > 63:
            raise _Malformed


def _walk(buf: bytes, pos: int, end: int, spec: _Spec, prefix: str) -> None:
    counts: dict[int, int] = {}
    unknown = 0
    fields = spec.fields
    while pos < end:
        tag, pos = _varint(buf, pos)
        number, wire = tag >> 3, tag & 7
        f = fields.get(number)
        if f is None:
            unknown += 1
            if unknown > MAX_UNKNOWN:
                raise _Broken(prefix.rstrip(".") or "request",
                              f"{prefix or 'the request: '}more than {MAX_UNKNOWN} undeclared fields", MAX_UNKNOWN)
        else:
            n = counts[number] = counts.get(number, 0) + 1
            if n > f.most:
                path = prefix + f.name
                what = "items" if f.repeated else "occurrences of a singular field"
                raise _Broken(path, f"{path}: more than {f.most} {what}; the limit is {f.most}", f.most)
        if wire == _VARINT:
            _, pos = _varint(buf, pos)
        elif wire == _LEN:
            size, pos = _varint(buf, pos)
            if f is not None:
                if f.max_len is not None and size > f.max_len:
                    path = prefix + f.name
                    raise _Broken(path, f"{path}: {size} bytes; the limit is {f.max_len}", f.max_len)
                if f.child is not None:
                    _walk(buf, pos, pos + size, f.child, f"{prefix}{f.name}[{n - 1}]." if f.repeated
                          else f"{prefix}{f.name}.")
            pos += size
        elif wire == _I64:
            pos += 8
        elif wire == _I32:
            pos += 4
        else:  # groups (3, 4) and reserved wire types: not ours to accept
            raise _Malformed
    if pos != end:
        raise _Malformed


__all__ = ["MAX_UNKNOWN", "SINGULAR_REPEATS", "Scan", "compile_scan"]
