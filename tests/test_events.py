"""The event vocabulary (spec/events.py) is the one declaration of every kind: each consumer
handles every kind it declares, so a kind added there and forgotten anywhere fails here."""

from __future__ import annotations

import importlib.resources
import json
from pathlib import Path

import pytest

from kvspec.conformance.fastread import decoder
from kvspec.conformance.report import describe
from kvspec.conformance.trace import FIELDS, parse_line, to_json
from kvspec.judge.ids import requests_named
from kvspec.spec import ACTIONS
from kvspec.spec.events import (
    DECISIONS,
    EFFECTS,
    KINDS,
    blocks_of,
    field,
    request_of,
    requests_of,
    step_of,
)

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = {
    "id": 3,
    "block": 2,
    "nat": 1,
    "int": -1,
    "tokens": (5, 6),
    "blocks": (1, 2),
    "ids": (3,),
    "sampled": ((3, 7),),
    "reason": "stop",
}
"""A value of each field type."""


def sample(kind: str) -> tuple[object, ...]:
    return (kind, *(SAMPLE[type_] for _, type_ in KINDS[kind].fields))


def test_decisions_are_the_spec_actions_and_effects_the_rest() -> None:
    assert DECISIONS == set(ACTIONS)
    assert DECISIONS | EFFECTS == set(KINDS) and not DECISIONS & EFFECTS


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_every_kind_round_trips_through_both_readers(kind: str) -> None:
    event = sample(kind)
    raw = json.dumps(to_json(event)).encode()
    assert parse_line(raw, 8) == (event, None)
    assert decoder(8)(raw) == (event, None)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_every_kind_has_a_phrase_and_accessors(kind: str) -> None:
    event = sample(kind)
    assert describe(event) != repr(event)
    fields = dict(KINDS[kind].fields)
    blocks = tuple(
        b
        for name, t in fields.items()
        if t in ("block", "blocks")
        for b in (field(event, name) if t == "blocks" else (field(event, name),))
    )  # type: ignore[union-attr]
    assert blocks_of(event) == blocks
    assert request_of(event) == (SAMPLE["id"] if "req" in fields else None)
    if "req" in fields:
        assert requests_of(event) == (SAMPLE["id"],)
    elif kind in ("execute", "commit"):
        assert requests_of(event) == (3,)
    else:
        assert requests_of(event) == ()
    assert step_of(event) == (SAMPLE["id"] if "step" in fields else None)
    # the judge's compiled reading of the same tables (judge/ids.py)
    assert requests_named(kind, event) == requests_of(event)
    for short in (event[:1], event[:2]):
        assert requests_named(kind, short) == requests_of(short)


def test_the_schema_and_the_docs_name_every_kind() -> None:
    schema = json.loads(
        importlib.resources.files("kvspec.conformance").joinpath("trace-v1.schema.json").read_text()
    )
    events_md = (ROOT / "docs" / "events.md").read_text()
    format_md = (ROOT / "docs" / "trace-format.md").read_text()
    assert set(FIELDS) == set(KINDS)
    for kind, spec in KINDS.items():
        assert schema["$defs"][kind]["required"] == ["ev"] + [name for name, _ in spec.fields]
        assert f'("{kind}"' in events_md, kind
        assert f"`{kind}`" in format_md, kind
