"""The adapter protocol: the few operations ``kvspec fuzz`` needs from an engine under test.

An *adapter* wraps one engine (a block manager plus its scheduler) so that the lockstep fuzzer
(``fuzz.py``) can drive it with Hypothesis workloads and judge the events it emits against the
spec. A *factory* builds one adapter per fuzzed example::

    factory(config: kvspec.spec.Config, choices: Choices) -> Adapter

``config`` is the cell and the geometry the example draws (blocks, block size, token budget, ...);
``choices.pick(n, label)`` is how the engine asks Hypothesis for a nondeterministic choice (so it
shrinks). A factory raises ``ValueError`` for a config its engine cannot run; the CLI reports it as
one line and exits 2. ``kvspec fuzz --target module:factory`` names a factory; this module's
``reference`` is the factory of the reference engine, the worked example of ``docs/adapters.md``.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from typing import Protocol, runtime_checkable

from kvspec.reference import Engine, EngineConfig, GroupSpec
from kvspec.reference.choices import Choices
from kvspec.spec import POLICIES, Config

from .engine_view import PoolView

Event = tuple[object, ...]
Snapshot = tuple[tuple[int, ...], tuple[int, ...]]


@runtime_checkable
class Adapter(Protocol):
    """An engine as the fuzzer sees it. Every call appends the events it caused to ``events``
    (the v0/v1 vocabulary of ``docs/events.md``: decisions, each followed by its effects)."""

    config: Config
    """The spec configuration the engine claims to implement (judged against)."""
    events: list[Event]

    def add_request(
        self,
        rid: int,
        prompt: tuple[int, ...],
        max_tokens: int,
        priority: int,
        external: bool = False,
    ) -> None:
        """A request arrives (emits ``arrive``). ``external``: its KV may be loaded from an
        external store. Sent only by ``kvspec fuzz --loads``, which needs the adapter's
        optional attribute ``supports_loads = True``."""
        ...

    def step(self) -> bool:
        """One unit of engine work: schedule a step, or execute and commit the oldest one.
        False when there is nothing to do."""
        ...

    def abort(self, rid: int) -> bool:
        """Abort a live request between steps; False if it is unknown or finished."""
        ...

    def reset_prefix_cache(self) -> bool:
        """Drop every cached hash; False (and no event) if blocks are in use."""
        ...

    def live_requests(self) -> list[int]:
        """Ids of requests that arrived and have not finished, in arrival order."""
        ...

    def snapshot(self) -> Snapshot | None:
        """(refcount of every block 0..N-1, free queue head first), or None if the engine cannot
        tell; compared with the spec's after every rule."""
        ...


Factory = Callable[[Config, Choices], Adapter]
"""Optional adapter attributes: ``refusal`` (None, or what names a feature the spec does not
model, seen at run time: the fuzzer ends the run and the search there, ``kvspec fuzz`` exits 2
naming it, as at a factory's refusal), ``supports_loads = True`` (it can run ``kvspec fuzz --loads``),
``judging = "observed"`` (``observed.py``; default strict), ``pool_view() -> PoolView | None``
(the engine's own hash index and free / evictable accounting, compared with the spec's state after
every snapshot: ``engine_view.py``) and ``self_check() -> str | None`` (the adapter's own consistency check, e.g. its wrappers against the
engine's native events; a message is reported as a ``Disagreement``)."""


def engine_traits(config: Config) -> tuple[str, str, str, str] | None:
    """The configuration's policy as the reference engine takes it: the spec's traits (the
    engine derives its behaviour from them, ``reference/policies.py``), so a policy registered
    in ``spec.policies.POLICIES`` alone runs on the engine too; None for a policy not there."""
    traits = POLICIES.get(config.policy)
    return traits.values() if traits is not None else None


def engine_config(config: Config, **engine_only: object) -> EngineConfig:
    """The reference engine's configuration of the spec's ``config``: every ``Config`` field
    (a spec constant the engine has no setting for is refused, never ignored: ``ValueError``),
    the policy as traits (``engine_traits``), then ``engine_only`` (e.g. ``vocab``)."""
    if config.hash_lookahead:  # its hashes name a block's prefix alone: refused by its row
        from kvspec import twins

        raise twins.refused("kvspec.reference", "hash_lookahead")
    fields = {name: getattr(config, name) for name in Config.__dataclass_fields__}
    del fields["hash_lookahead"]  # 0: the engine's own hashing
    # several KV-cache groups (issue #36) in the engine's own representation; () is one group
    fields["groups"] = tuple(
        GroupSpec(group.kind, group.block_size, group.window, group.registers, group.chunk)
        for group in config.groups
    )
    if config.admission_window:  # cache-aware admission: declared refused in twins.py
        from kvspec import twins

        raise twins.refused("kvspec.reference", "cache_aware_admission")
    del fields["admission_window"], fields["admission_threshold"]  # off: queue order, the engine's
    if config.trim_at_finish:  # WindowFinish: declared refused in twins.py
        from kvspec import twins

        raise twins.refused("kvspec.reference", "trim_at_finish")
    del fields["trim_at_finish"]  # off: a finish gives up the table in one piece, the engine's
    unknown = sorted(set(fields) - set(EngineConfig.__dataclass_fields__))
    if unknown:
        raise ValueError(f"the reference engine has no setting {', '.join(unknown)}")
    return EngineConfig(**fields, policy_traits=engine_traits(config), **engine_only)  # type: ignore[arg-type]


class ReferenceAdapter:
    """The reference engine (``kvspec.reference.Engine``) through the protocol."""

    def __init__(self, config: Config, choices: Choices) -> None:
        self.config = config
        self.engine = Engine(engine_config(config, vocab=4), choices=choices)
        self.events = self.engine.events

    supports_loads = True

    def add_request(
        self,
        rid: int,
        prompt: tuple[int, ...],
        max_tokens: int,
        priority: int,
        external: bool = False,
        encoder: int = 0,
    ) -> None:
        """``encoder``: the request's encoder tokens (a cross group's, ``Engine.add_request``)."""
        self.engine.add_request(rid, prompt, max_tokens, priority, external, encoder=encoder)

    def step(self) -> bool:
        return self.engine.step()

    def abort(self, rid: int) -> bool:
        return self.engine.abort(rid)

    def reset_prefix_cache(self) -> bool:
        return self.engine.reset_prefix_cache()

    def live_requests(self) -> list[int]:
        return [rid for rid, q in self.engine.requests.items() if q.status != "finished"]

    def snapshot(self) -> Snapshot | None:
        return self.engine.snapshot()

    def pool_view(self) -> PoolView:
        """The pool's own books: its free counter, its unreferenced cached blocks, its index."""
        pool = self.engine.pool
        return PoolView(
            free_count=pool.num_free,
            evictable=tuple(
                b.block_id for b in pool.blocks if b.ref_cnt == 0 and b.block_hash is not None
            ),
            index=tuple(tuple(owners) for owners in pool.index.values()),
        )


def reference(config: Config, choices: Choices) -> ReferenceAdapter:
    """The factory of the reference engine: ``--target kvspec.conformance.adapter:reference``."""
    return ReferenceAdapter(config, choices)


def load_factory(target: str, from_cwd: bool = False) -> Factory:
    """Import ``module:attribute`` and return it; ``ValueError`` (one line) if that fails.
    ``from_cwd``: modules are found in the current folder first, as ``python -m`` finds them
    (the command line's ``--target``; a console script's path starts with its own folder)."""
    module_name, sep, attribute = target.partition(":")
    if not sep or not module_name or not attribute:
        raise ValueError(f"--target {target!r}: expected module:factory")
    if from_cwd and os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # ImportError (an adapter outside its venv), or the module's own bug
        message = " ".join(str(err).split())
        raise ValueError(
            f"--target {target!r}: cannot import {module_name}: {type(err).__name__}: {message}"
        ) from None
    factory = getattr(module, attribute, None)
    if not callable(factory):
        raise ValueError(f"--target {target!r}: {module_name} has no callable {attribute!r}")
    return factory  # type: ignore[no-any-return]


def probe(
    factory: Factory, config: Config, choices: Choices, target: str = "factory", loads: bool = False
) -> Adapter:
    """Build one adapter and check it against the protocol; ``ValueError`` (one line) if the
    factory refuses the config or returns something that is not an adapter."""
    try:
        adapter = factory(config, choices)
    except ValueError as err:  # the documented refusal
        raise ValueError(f"--target {target}: {err}") from None
    except (Exception, SystemExit) as err:  # a factory that does not follow the protocol
        message = " ".join(str(err).split())  # (one that exits is bad input, never "holds")
        raise ValueError(
            f"--target {target}: the factory failed: {type(err).__name__}: {message}"
        ) from None
    if not isinstance(adapter, Adapter):
        missing = [
            name
            for name in ("config", "events", "add_request", "step", "abort", "reset_prefix_cache")
            + ("live_requests", "snapshot")
            if not hasattr(adapter, name)
        ]
        raise ValueError(
            f"--target {target}: {type(adapter).__name__} is not an adapter (missing {missing})"
        )
    if loads and not getattr(adapter, "supports_loads", False):
        raise ValueError(f"--target {target}: the engine has no external KV loads (--loads)")
    return adapter
