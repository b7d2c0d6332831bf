"""The declared twins (kvspec/twins.py): every module that restates the spec is registered, says
so (``TWIN_OF``), and names equality tests that exist; the table of what each form follows,
evaluates and refuses covers every registered feature, invariant and policy trait, each declared
refusal is the one the form raises, and the pool machine equals the spec's pool."""

from __future__ import annotations

import ast
import importlib
import pkgutil
import random
from collections.abc import Callable
from pathlib import Path

import pytest

import kvspec
from kvspec import twins
from kvspec.spec import Config, initial_state, pool, pool_machine
from kvspec.spec.features import FEATURES, FIELDS_OF, GROUP_KIND_FEATURES, PARAMETERS, Feature
from kvspec.spec.invariants import REGISTRY, Invariant
from kvspec.spec.state import Request
from kvspec.twins import TWINS, twin

FAST = "kvspec.judge.fastmodel"
INCREMENTAL = "kvspec.judge.incremental"
SYMBOLIC = "kvspec.proofs.symbolic"
PARAMETRIC = "kvspec.proofs.parametric"

ROOT = Path(__file__).resolve().parents[1]
SKIP = ("kvspec.impl", "kvspec.conformance.adapters", "kvspec.pytest_plugin")
"""Not imported here: torch, third-party engines (their modules are not twins)."""


def declared() -> set[str]:
    """Modules whose source declares ``TWIN_OF`` (read, not imported: some need z3)."""
    found = set()
    for info in pkgutil.walk_packages(kvspec.__path__, "kvspec."):
        if info.name.startswith(SKIP):
            continue
        spec = importlib.util.find_spec(info.name)
        if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
            continue
        tree = ast.parse(Path(spec.origin).read_text())
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "TWIN_OF" for t in node.targets
            ):
                found.add(info.name.removesuffix(".__init__"))
    return found


def test_every_form_of_the_spec_is_registered_and_every_registered_form_says_so() -> None:
    assert declared() == {twin.form for twin in TWINS}


def test_every_twin_names_tests_that_exist() -> None:
    for row in TWINS:
        assert row.shown_by, row.form
        for node in row.shown_by:
            path, _, name = node.partition("::")
            tree = ast.parse((ROOT / path).read_text())
            names = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
            assert name in names, f"{row.form}: {node} does not exist"


# -- the table: what each form follows, evaluates and refuses ------------------------------------


def test_the_table_has_no_gaps() -> None:
    assert twins.problems() == []
    assert twin("kvspec.proofs.lemmas").features is twin(SYMBOLIC).features


def test_each_form_evaluates_what_its_row_says() -> None:
    """The forms' own lists are the table's: the incremental checks' order, the fast path's set
    and the Z3 model's set."""
    from kvspec.judge.fastmodel import FAST_INVARIANTS
    from kvspec.judge.incremental import Incremental

    order = [name for name, _, _ in Incremental(initial_state(Config(8, 4)))._order]
    assert order == [n for n in REGISTRY if n in twins.implemented(INCREMENTAL)]
    assert FAST_INVARIANTS == twins.implemented(FAST)
    pytest.importorskip("z3")
    from kvspec.proofs.symbolic import Z3_INVARIANTS

    assert set(Z3_INVARIANTS) == twins.implemented(SYMBOLIC)
    from kvspec.proofs.parametric import SAFETY

    # its FreeQueueExact is a set (who is queued), not the queue: declared exempt, with why
    assert set(SAFETY) - {"FreeQueueExact"} == twins.implemented(PARAMETRIC)


def test_an_invariant_added_to_the_registry_alone_fails_until_every_form_declares_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(
        REGISTRY, "NewInvariant", Invariant("NewInvariant", lambda s: None, ("spec_tokens",))
    )
    checkers = {row.form for row in TWINS if not isinstance(row.invariants, twins.Exempt)}
    assert checkers == {FAST, INCREMENTAL, SYMBOLIC, PARAMETRIC}
    assert {p.split(":")[0] for p in twins.problems()} == checkers
    for form in checkers:
        monkeypatch.setitem(twin(form).invariants, "NewInvariant", twins.Exempt("planted"))  # type: ignore[index]
    assert twins.problems() == []
    # an exemption "unreachable" is refused where the form follows what breaks it
    exempt = twins.Exempt("planted", unreachable=True)
    monkeypatch.setitem(twin(INCREMENTAL).invariants, "NewInvariant", exempt)  # type: ignore[index]
    assert twins.problems() == [
        f"{INCREMENTAL}: NewInvariant is exempt as unreachable, but spec_tokens, which breaks "
        "it, is followed"
    ]
    # and declared implemented, the form's own list lacks it
    monkeypatch.setitem(twin(INCREMENTAL).invariants, "NewInvariant", twins.IMPLEMENTS)  # type: ignore[index]
    with pytest.raises(AssertionError):
        test_each_form_evaluates_what_its_row_says()


def test_a_feature_added_to_the_registry_alone_fails_until_every_form_declares_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(FEATURES, "new", Feature("new", "a new feature", lambda c: False))
    configured = {row.form for row in TWINS if not isinstance(row.features, twins.Refused)}
    assert {p.split(":")[0] for p in twins.problems()} == configured
    for form in configured:
        monkeypatch.setitem(twin(form).features, "new", twins.Refused("planted"))  # type: ignore[index]
    assert twins.problems() == []


def test_every_config_field_is_a_feature_or_a_parameter() -> None:
    fields = set(Config.__dataclass_fields__)
    assert fields == set(PARAMETERS) | set(FIELDS_OF)
    named = set(FIELDS_OF.values()) | set(GROUP_KIND_FEATURES.values())
    assert named == {n for n, f in FEATURES.items() if f.on is not None}


def _probe(form: str, feature: str) -> Callable[[], object]:
    """Build ``form`` with ``feature`` on: the way each form is first given a configuration."""
    if feature == "reset_running":
        return _probe_reset(form)
    config = Config(4, 1, **FEATURES[feature].example)
    if form == FAST:
        from kvspec.judge.fastmodel import FastModel

        return lambda: FastModel(config)
    if form == INCREMENTAL:
        from kvspec.judge.incremental import Incremental

        return lambda: Incremental(initial_state(config))
    if form == "kvspec.reference":
        from kvspec.conformance.adapter import ReferenceAdapter
        from kvspec.reference.choices import DefaultChoices

        return lambda: ReferenceAdapter(config, DefaultChoices())
    pytest.importorskip("z3")
    if form == "kvspec.proofs.parametric":
        from kvspec.proofs.all_sizes import admit

        return lambda: admit(config)
    from kvspec.proofs import symbolic

    if feature == "loads":  # a stream feature: refused where a load decision is read
        model = symbolic.Model(symbolic.Fragment(Config(4, 1)))
        return lambda: symbolic.instances_for(model, ("schedule", 0, 0, 1))
    if feature == "bounded_hits":  # a stream feature: refused where a bounded hit is read
        model = symbolic.Model(symbolic.Fragment(Config(4, 1)))
        return lambda: symbolic.instances_for(model, ("schedule", 0, 1, 0, 0))
    return lambda: symbolic.Model(symbolic.Fragment(config))


def _probe_reset(form: str) -> Callable[[], object]:
    """A stream feature: refused where a reset preempting running requests is read."""
    decision = ("reset", True)
    if form == FAST:
        from kvspec.judge.fastmodel import FastModel

        return lambda: FastModel(Config(4, 1)).apply(decision)
    if form == INCREMENTAL:  # it follows: it judges the spec's state after the decision
        from kvspec.judge.incremental import Incremental

        return lambda: Incremental(initial_state(Config(4, 1)))
    if form == "kvspec.reference":
        from kvspec.proofs.enact import enact

        return lambda: enact(Config(4, 1), [decision])
    pytest.importorskip("z3")
    if form == "kvspec.proofs.parametric":
        from kvspec.proofs.all_sizes import admit_decision

        return lambda: admit_decision(decision)
    from kvspec.proofs import symbolic

    model = symbolic.Model(symbolic.Fragment(Config(4, 1)))
    return lambda: symbolic.instances_for(model, decision)


@pytest.mark.parametrize(
    "form", [row.form for row in TWINS if not isinstance(row.features, twins.Refused)]
)
def test_each_declared_refusal_is_the_refusal_the_form_raises(form: str) -> None:
    """Every feature a row refuses is refused by the form, by that name; every feature it
    follows is accepted."""
    features = twin(form).features
    assert not isinstance(features, twins.Refused)
    for name, support in features.items():
        if isinstance(support, twins.Refused):
            with pytest.raises(twins.NotFollowed) as refused:
                _probe(form, name)()
            what = refused.value.what
            # the lemmas are stated over the Z3 model: its refusals are theirs (the same row)
            assert refused.value.form == (SYMBOLIC if form == "kvspec.proofs.lemmas" else form)
            if what != name:  # refused first for a feature this one needs (defer_loads)
                needed = FEATURES[name].example
                assert FEATURES[what].on(Config(4, 1, **needed)), (name, what)  # type: ignore[misc]
                assert isinstance(features[what], twins.Refused)
                continue
            assert name in str(refused.value) and support.reason in str(refused.value)
        elif FEATURES[name].on is not None:
            _probe(form, name)()


# -- the pool machine against the spec's pool ------------------------------------------------------


def _pool_differences(seed: int, caching: bool, ops: int = 40) -> str | None:
    """One random sequence of pool operations on both: the spec's pool mechanisms (a State with
    three requests) and the pool machine (holders = request ids). The first difference, or None."""
    rng = random.Random(seed)
    n = 6
    s = initial_state(Config(n, 1, prefix_caching=caching))
    p = pool_machine.initial_pool(n, caching)
    prompts = {0: [1, 2, 3, 4], 1: [1, 2, 5, 6], 2: [1, 2, 3, 7]}
    for rid, tokens in prompts.items():
        s.requests[rid] = Request(rid, list(tokens), len(tokens), 4, 0, rid)
    for step in range(ops):
        rid = rng.randrange(3)
        req = s.requests[rid]
        op = rng.choice(("alloc", "alloc", "publish", "hit", "free_one", "free_all", "evict"))
        try:
            if op == "alloc" and s.free and len(req.table) < len(req.tokens):
                pool.allocate(s, req)
                pool_machine.allocate(p, rid, 1)
            elif op == "publish" and caching and req.table:
                i = rng.randrange(len(req.table))
                block = req.table[i]
                if s.blocks[block].key is None:
                    pool.publish(s, req, i)
                    pool_machine.publish(p, rid, block, s.key(req, i))
            elif op == "hit" and not req.table:
                hits = pool.lookup(s, req)
                cap = (len(req.tokens) - 1) // 1
                keys = tuple(s.key(req, i) for i in range(cap))
                found = pool_machine.lookup(p, rid, keys)[0][2]
                if tuple(hits) != found:
                    return f"step {step}: lookup {hits} vs {found}"
                pool.touch(s, req, hits)
                pool_machine.touch(p, rid, found)
            elif op == "free_one" and req.table:
                block = req.table.pop()
                pool.release(s, block, rid)
                pool_machine.free(p, rid, (block,))
            elif op == "free_all" and req.table:
                table = list(req.table)
                pool.free_batch(s, rid, table)
                pool.clear_table(s, req)
                pool_machine.free(p, rid, tuple(reversed(table)))
            elif op == "evict":
                block = rng.randrange(1, n)
                pool.unpublish(s, block)
                pool_machine.evict(p, block)
        except Exception as err:  # a guard on one side only
            return f"step {step}: {op} raised {err!r}"
        spec_view = (
            [b.refcount for b in s.blocks],
            [b.key for b in s.blocks],
            list(s.free),
            {k: list(v) for k, v in s.index.items()},
        )
        machine_view = (
            [b.refcount for b in p.blocks],
            [b.key for b in p.blocks],
            list(p.free),
            {k: list(v) for k, v in p.index.items()},
        )
        if spec_view != machine_view:
            return f"step {step}: after {op} of r{rid}: {spec_view} vs {machine_view}"
    return None


def test_the_pool_machine_is_the_spec_pool() -> None:
    """Differential: the same refcounts, hashes, index and free queue after every operation of
    random sequences, caching on and off."""
    for seed in range(150):
        for caching in (True, False):
            assert _pool_differences(seed, caching) is None, (seed, caching)


def test_the_pool_differential_finds_a_planted_bug(monkeypatch: pytest.MonkeyPatch) -> None:
    """Planted: the pool machine puts freed cached blocks at the queue's head (not its tail)."""

    def head_first(s: pool_machine.PoolState, holder: object, blocks: tuple[int, ...]) -> list:
        for block in blocks:
            s.held[holder].remove(block)
            s.blocks[block].refcount -= 1
            if s.blocks[block].refcount == 0:
                s.free.insert(0, block)
        return []

    monkeypatch.setattr(pool_machine, "free", head_first)
    assert any(_pool_differences(seed, True) for seed in range(150))
