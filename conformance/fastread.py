"""The fast reader's line decoder: msgspec structs made from ``spec.events.KINDS``, one per kind.

``iter_trace(path, fast=True)`` decodes each line with ``decoder(num_blocks)`` (``kvspec check``'s
compiled loop with its ``parts``, the same steps inlined): msgspec parses
and validates in one pass (types, ranges, required fields, no unknown field; a tagged union on
``"ev"``) and the line becomes ``parse_line``'s result. Each struct's first field is its kind
(``KIND_FIELD``, of the kind's one value and defaulting to it), so that the struct's values are
the event tuple itself (``msgspec.structs.astuple``: one tuple, none joined to the kind after).
Anything msgspec refuses (an ``x_`` field, a null hash, a wrong type, a JSON error) goes to
``parse_line``, which accepts it or says what is wrong: the one-line errors are
``parse_line``'s, and this decoder must accept nothing ``parse_line`` rejects. Where msgspec is
more lenient than orjson it is narrowed here: integers outside orjson's 64-bit range (which orjson
reads as floats, so ``parse_line`` rejects them) are refused (msgspec bounds fit int64: larger ones
go to ``parse_line`` too). Measured against orjson plus a hand-written validator
(``docs/checker.md``).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache
from typing import Annotated, Literal, Union

import msgspec

from kvspec.spec.events import KINDS, OPTIONAL, REASONS, Event

Decoded = tuple[Event, "str | None"]
Error = msgspec.MsgspecError
"""What ``decoder(n)`` raises for a line it does not accept (then ``parse_line`` decides)."""

KIND_FIELD = "x_kvspec_kind"
"""The structs' first field, the kind: an ``x_`` field, which a line may carry and ``parse_line``
ignores. A line that carries it with the kind's name is the same event either way; with any other
value msgspec refuses it and ``parse_line`` reads the line as before."""

_MAX = 2**63 - 1
"""orjson reads integers in [-2**63, 2**64 - 1] as ints, others as floats; msgspec's bounds must
fit int64, so integers above this are left to ``parse_line``."""


def _types(num_blocks: int) -> dict[str, object]:
    nat = Annotated[int, msgspec.Meta(ge=0, le=_MAX)]
    block = Annotated[int, msgspec.Meta(ge=0, lt=num_blocks)]
    return {
        "id": nat,
        "nat": nat,
        "block": block,
        "int": Annotated[int, msgspec.Meta(ge=-(2**63), le=_MAX)],
        "tokens": Annotated[tuple[nat, ...], msgspec.Meta(min_length=1)],
        "blocks": tuple[block, ...],
        "ids": tuple[nat, ...],
        "sampled": tuple[tuple[nat, nat], ...],
        "reason": Literal[REASONS],
    }


Parts = tuple[
    "Callable[[bytes], object]", "dict[type, tuple[str, bool]]", "Callable[[object], tuple]", object
]
"""``parts(n)``: msgspec's decode of a line (a struct), each struct's type -> (its kind, whether
its last field is the optional hash), ``msgspec.structs.astuple`` (the event, and the hash last
when the kind has one) and ``msgspec.UNSET``."""


@lru_cache(maxsize=8)
def parts(num_blocks: int) -> Parts:
    """What ``decoder(n)`` is made of, for a loop that decodes lines itself (``core.FileFeed``,
    compiled): ``astuple(struct)`` is the event, with the hash last when the kind has one
    (``UNSET``: none)."""
    types = _types(num_blocks)
    kinds: dict[type, tuple[str, bool]] = {}
    for kind, spec in KINDS.items():
        fields = spec.fields
        spec: list[tuple[str, object] | tuple[str, object, object]] = [
            (KIND_FIELD, Literal[kind], kind)
        ]
        spec += [(name, types[type_]) for name, type_ in fields]
        for name in OPTIONAL.get(kind, ()):
            text = Annotated[str, msgspec.Meta(min_length=1)]
            spec.append((name, Union[text, msgspec.UnsetType], msgspec.UNSET))  # noqa: UP007
        cls = msgspec.defstruct(
            f"Line_{kind}",
            spec,
            tag=kind,
            tag_field="ev",
            forbid_unknown_fields=True,
            gc=False,
            kw_only=True,  # the kind first, with its default
        )
        kinds[cls] = (kind, bool(OPTIONAL.get(kind)))
    decode = msgspec.json.Decoder(Union[tuple(kinds)]).decode  # type: ignore[valid-type]  # noqa: UP007
    return decode, kinds, msgspec.structs.astuple, msgspec.UNSET


@lru_cache(maxsize=8)
def decoder(num_blocks: int) -> Callable[[bytes], Decoded]:
    """``raw line -> (event tuple, hash or None)``; raises ``Error`` for anything else."""
    decode, kinds, astuple, unset = parts(num_blocks)

    def line(raw: bytes) -> Decoded:
        obj = decode(raw)
        values = astuple(obj)
        if kinds[type(obj)][1]:
            hash_ = values[-1]
            return values[:-1], None if hash_ is unset else hash_
        return values, None

    return line
