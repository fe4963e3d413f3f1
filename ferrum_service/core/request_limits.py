"""Request size limits, declared once: read from the message descriptors, compiled into checks.

Every repeated, map, string and bytes field of every request message has a bound: for the
contract (``ferrum.executor.v1``) a ``buf.validate`` annotation in the ``.proto`` files, for vLLM's
engine protocol (not ours) the table in :mod:`.vllm_limits`. At start-up :func:`compile_checks`
reads those bounds from the message descriptors and builds, per request type, a check of plain
``len()`` comparisons (no CEL runtime on the hot path); a nested repeated message is walked only
after its own count has passed. A check refuses a message over a bound with INVALID_ARGUMENT
naming the field path and its limit (``sampling_params.stop[3]``, limit 1024); the server runs
them on every RPC before its handler (``wire/limits.py``). :func:`unbounded_fields` lists what
lacks a bound (a test keeps it empty).

The bounds that can be declared and are understood here: ``string.max_len`` (characters),
``string.max_bytes`` (UTF-8 bytes), ``bytes.max_len``, ``repeated.max_items`` with ``items`` rules,
``map.max_pairs`` with ``keys`` / ``values`` rules, and a field CEL rule of exactly the form
``size(this) <= N`` (the key count of a ``google.protobuf.Struct``, whose contents the server
never reads).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable, Mapping

from ferrum_client._proto.buf.validate import validate_pb2 as validate
from google.protobuf.descriptor import Descriptor, FieldDescriptor, ServiceDescriptor

from . import errors

_SIZE_RULE = re.compile(r"^\s*size\(this\)\s*<=\s*(\d+)\s*$")
_STRING, _BYTES = FieldDescriptor.TYPE_STRING, FieldDescriptor.TYPE_BYTES


@dataclasses.dataclass(frozen=True)
class Bound:
    """The declared limits of one field. ``count``: items of a repeated field, pairs of a map, keys
    of a Struct; ``chars`` / ``bytes``: of a string or bytes value (each item's, each map value's);
    ``key_chars``: of each string map key."""

    count: int = 0
    chars: int = 0
    bytes: int = 0
    key_chars: int = 0

    def __bool__(self) -> bool:
        return bool(self.count or self.chars or self.bytes or self.key_chars)


#: Bounds not written in a message's own descriptor: {message full name: {field name: Bound}}.
Table = Mapping[str, Mapping[str, Bound]]


def _value_bound(rules: validate.FieldRules) -> Bound:
    which = rules.WhichOneof("type")
    if which == "string":
        return Bound(chars=rules.string.max_len, bytes=rules.string.max_bytes)
    if which == "bytes":
        return Bound(bytes=rules.bytes.max_len)
    return Bound()


def declared(field: FieldDescriptor, table: Table = {}) -> Bound:  # noqa: B006 - read only
    """The bound of ``field``: its entry in ``table``, else its ``buf.validate`` annotation."""
    row = table.get(field.containing_type.full_name, {})
    if field.name in row:
        return row[field.name]
    opts = field.GetOptions()
    if not opts.HasExtension(validate.field):
        return Bound()
    rules = opts.Extensions[validate.field]
    which = rules.WhichOneof("type")
    if which == "repeated":
        r = rules.repeated
        item = _value_bound(r.items)
        return Bound(count=r.max_items, chars=item.chars, bytes=item.bytes)
    if which == "map":
        m = rules.map
        val = _value_bound(m.values)
        return Bound(count=m.max_pairs, chars=val.chars, bytes=val.bytes, key_chars=_value_bound(m.keys).chars)
    for rule in rules.cel:
        size = _SIZE_RULE.match(rule.expression)
        if size:
            return Bound(count=int(size.group(1)))
    return _value_bound(rules)


def limit_of(message, field: str, table: Table = {}) -> int:  # noqa: B006 - read only
    """The declared count (or length) limit of ``message``'s field (a message class or descriptor),
    for code that needs the number itself (so it is written only where it is declared)."""
    desc = getattr(message, "DESCRIPTOR", message)
    b = declared(desc.fields_by_name[field], table)
    return b.count or b.chars or b.bytes


# ---- what lacks a bound ---------------------------------------------------------------------------
def _is_map(f: FieldDescriptor) -> bool:
    return f.message_type is not None and f.message_type.GetOptions().map_entry


def _repeated(f: FieldDescriptor) -> bool:
    return f.is_repeated


def _opaque(desc: Descriptor) -> bool:
    """google.protobuf's own messages (Struct, Value): bounded where a field holds them."""
    return desc.full_name.startswith("google.protobuf.")


def unbounded_fields(root: Descriptor, table: Table = {}) -> list[str]:  # noqa: B006 - read only
    """Paths (``Message.field``) of every repeated, map, string or bytes field reachable from
    ``root`` that has no declared bound (a repeated or map field needs a count; string and bytes
    values, also as items or map values, need a length; a held google.protobuf message needs a
    count rule)."""
    missing: list[str] = []
    seen: set[str] = set()

    def visit(desc: Descriptor) -> None:
        if desc.full_name in seen:
            return
        seen.add(desc.full_name)
        for f in desc.fields:
            b = declared(f, table)
            name = f"{desc.full_name}.{f.name}"
            if _is_map(f):
                key, val = f.message_type.fields_by_name["key"], f.message_type.fields_by_name["value"]
                if not b.count or (key.type == _STRING and not b.key_chars) or \
                        (val.type in (_STRING, _BYTES) and not (b.chars or b.bytes)):
                    missing.append(name)
                if val.message_type is not None:
                    visit(val.message_type)
                continue
            if _repeated(f) and not b.count:
                missing.append(name)
            elif f.type in (_STRING, _BYTES) and not (b.chars or b.bytes):
                missing.append(name)
            elif f.message_type is not None and _opaque(f.message_type) and not b.count:
                missing.append(name)
            if f.message_type is not None and not _opaque(f.message_type):
                visit(f.message_type)

    visit(root)
    return missing


# ---- the largest encoding within the bounds ------------------------------------------------------
#: Encoded bytes a bounded ``google.protobuf.Struct`` field may take (its key count is declared; its
#: nested values are not, and the server never reads them): the proto comment says so too.
STRUCT_BYTES = 64 * 1024
_HEAD = 10  # a field's tag and length prefix, at most
_FIXED = {FieldDescriptor.TYPE_DOUBLE: 8, FieldDescriptor.TYPE_FIXED64: 8, FieldDescriptor.TYPE_SFIXED64: 8,
          FieldDescriptor.TYPE_FLOAT: 4, FieldDescriptor.TYPE_FIXED32: 4, FieldDescriptor.TYPE_SFIXED32: 4,
          FieldDescriptor.TYPE_BOOL: 1}


def max_encoded_bytes(desc: Descriptor, table: Table = {}, _seen: frozenset = frozenset()) -> int | None:  # noqa: B006
    """The most bytes a message of ``desc`` within every declared bound can take on the wire (an
    over-estimate), or None when something in it is unbounded. A request longer than this is over
    some bound, so it can be refused before it is parsed: parsing tens of millions of tiny items
    costs seconds of the event loop before any check could look at them."""
    if desc.full_name in _seen:
        return None
    seen = _seen | {desc.full_name}
    total = 0
    for f in desc.fields:
        b = declared(f, table)
        if _is_map(f):
            key, val = (f.message_type.fields_by_name[k] for k in ("key", "value"))
            one = _value_bytes(key, Bound(chars=b.key_chars), table, seen)
            two = _value_bytes(val, b, table, seen)
            if not b.count or one is None or two is None:
                return None
            total += b.count * (_HEAD + one + two)
            continue
        one = _value_bytes(f, b, table, seen)
        if one is None or (_repeated(f) and not b.count):
            return None
        if not _repeated(f):
            total += _HEAD + one
        elif f.message_type is None and f.type not in (_STRING, _BYTES):  # packed: one head
            total += _HEAD + b.count * one
        else:
            total += b.count * (_HEAD + one)
    return total


def _value_bytes(f: FieldDescriptor, b: Bound, table: Table, seen: frozenset) -> int | None:
    """The most bytes one value of ``f`` takes (without its tag)."""
    if f.type == _STRING:
        return (b.bytes or 4 * b.chars) or None
    if f.type == _BYTES:
        return b.bytes or None
    if f.message_type is not None:
        if _opaque(f.message_type):
            return STRUCT_BYTES if f.message_type.full_name == "google.protobuf.Struct" and b.count else None
        return max_encoded_bytes(f.message_type, table, seen)
    return _FIXED.get(f.type, 10)


# ---- the checks -----------------------------------------------------------------------------------
class _Over(Exception):
    """A value over its bound; ``path`` grows outward as the check unwinds (only on failure)."""

    def __init__(self, path: list[str], message: str, limit: int, size: int) -> None:
        super().__init__(message)
        self.path, self.message, self.limit, self.size = path, message, limit, size


def _text(v, chars: int, nbytes: int) -> None:
    n = len(v)
    if chars and n > chars:
        raise _Over([], f"{n} characters; the limit is {chars}", chars, n)
    if nbytes and (n > nbytes or (isinstance(v, str) and n * 4 > nbytes and len(v.encode()) > nbytes)):
        size = len(v.encode()) if isinstance(v, str) else n
        raise _Over([], f"{size} bytes; the limit is {nbytes}", nbytes, size)


Check = Callable[[Any], None]


def _field_check(f: FieldDescriptor, b: Bound, sub: Check | None) -> Check:
    """One field's check (raises :class:`_Over` with the field's name in its path)."""
    name, count, chars, nbytes = f.name, b.count, b.chars, b.bytes
    text = f.type in (_STRING, _BYTES) or (_is_map(f) and f.message_type.fields_by_name["value"].type
                                           in (_STRING, _BYTES))

    def over_count(n: int) -> _Over:
        return _Over([name], f"{n} items; the limit is {count}", count, n)

    if _is_map(f):
        key_chars = b.key_chars

        def check_map(m):
            v = getattr(m, name)
            if len(v) > count:
                raise over_count(len(v))
            if key_chars or text or sub:
                for k, x in v.items():
                    try:
                        if key_chars and isinstance(k, str):
                            _text(k, key_chars, 0)
                        if text:
                            _text(x, chars, nbytes)
                        elif sub is not None:
                            sub(x)
                    except _Over as e:
                        e.path.append(f"{name}[{k!r}]")
                        raise
        return check_map
    if _repeated(f):
        def check_repeated(m):
            v = getattr(m, name)
            if len(v) > count:
                raise over_count(len(v))
            if text or sub is not None:
                for i, x in enumerate(v):
                    try:
                        _text(x, chars, nbytes) if text else sub(x)
                    except _Over as e:
                        e.path.append(f"{name}[{i}]")
                        raise
        return check_repeated
    if text:
        def check_text(m):
            try:
                _text(getattr(m, name), chars, nbytes)
            except _Over as e:
                e.path.append(name)
                raise
        return check_text

    def check_message(m):  # a singular message: walked only when set
        if m.HasField(name):
            v = getattr(m, name)
            if count and len(getattr(v, "fields", ())) > count:  # a Struct's keys
                raise _Over([name], f"{len(v.fields)} keys; the limit is {count}", count, len(v.fields))
            if sub is not None:
                try:
                    sub(v)
                except _Over as e:
                    e.path.append(name)
                    raise
    return check_message


def _compile(desc: Descriptor, table: Table, memo: dict[str, Check | None]) -> Check | None:
    """The check of one message type (None: nothing in it is bounded)."""
    if desc.full_name in memo:
        return memo[desc.full_name]
    memo[desc.full_name] = None  # a recursive type sees itself unchecked (none is in our requests)
    checks: list[Check] = []
    for f in desc.fields:
        b = declared(f, table)
        sub = None
        if f.message_type is not None and not _opaque(f.message_type):
            inner = f.message_type.fields_by_name["value"].message_type if _is_map(f) else f.message_type
            sub = _compile(inner, table, memo) if inner is not None else None
        if b or sub is not None:
            checks.append(_field_check(f, b, sub))
    if not checks:
        return None
    steps = tuple(checks)

    def check(m):
        for step in steps:
            step(m)
    memo[desc.full_name] = check
    return check


def compile_checks(service: ServiceDescriptor, table: Table = {}) -> dict[str, Check]:  # noqa: B006
    """{method name: check of its request message} for every method of ``service``. A check
    raises a :class:`~ferrum_service.core.errors.FerrumError` (INVALID_ARGUMENT, the field path in
    ``field``, ``limit`` and ``requested`` in its metadata) for a message over a bound."""
    memo: dict[str, Check | None] = {}
    out: dict[str, Check] = {}
    for method in service.methods:
        inner = _compile(method.input_type, table, memo)
        if inner is not None:
            out[method.name] = _refusing(inner)
    return out


def _refusing(inner: Check) -> Check:
    def check(m) -> None:
        try:
            inner(m)
        except _Over as e:
            path = ".".join(reversed(e.path)).replace(".[", "[")
            raise errors.invalid(f"{path}: {e.message}", field=path, limit=e.limit, requested=e.size) from None
    return check


__all__ = ["STRUCT_BYTES", "Bound", "Check", "Table", "compile_checks", "declared", "limit_of",
           "max_encoded_bytes", "unbounded_fields"]
