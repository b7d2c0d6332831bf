"""The adapter protocol checked: an adapter's mistakes are bad input, not an engine's bugs.

The judge compares events and snapshots by equality, so an adapter that hands it a list where the
vocabulary says a tuple (``snapshot()`` returning lists, a ``hit``'s blocks as a list), an event
with an extra field (a ``publish`` carrying its hash as a fifth value) or a kind the vocabulary
does not have would be reported as the engine disagreeing with the spec, with values that print
equal. ``check_event`` checks one event against ``spec/events.py``'s vocabulary (its kind, its
number of values, each field's type); ``check_adapter`` builds an adapter from its factory and
drives a small workload through every method of the protocol (``adapter.py``), checking each
result's type and shape (the optional ``pool_view()`` too) and every event emitted. A problem is a ``ProtocolError`` (a
``ValueError``: one line, exit 2) that names the method and the field.

``kvspec fuzz`` runs ``check_adapter`` before its first run (``flow.fuzz``) and, with
``--check-protocol``, ``check_event`` on every event of every run; ``kvspec adapter-check
MODULE:FACTORY`` runs it alone.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvspec.reference.choices import Choices
from kvspec.spec import Config
from kvspec.spec.events import KINDS, REASONS, TRAILING

from .adapter import Adapter, Factory, probe
from .engine_view import PoolView

Event = tuple[object, ...]

RUN_STEPS = 200
"""The most engine steps ``check_adapter`` takes to run its workload to the end."""


class ProtocolError(ValueError):
    """An adapter's result or event does not follow the protocol: one line naming the method
    and the field."""


class AdapterMistake(KeyboardInterrupt):
    """A ``ProtocolError`` inside a fuzzing run (``CheckingAdapter``): a ``KeyboardInterrupt``,
    which Hypothesis lets through without replaying or shrinking the run (an adapter's mistake is
    not a counterexample); ``fuzz.run_cell`` raises it as the ``ProtocolError`` it is."""


class FirstChoice:
    """The engine's nondeterministic choices, all the simplest (``Choices``)."""

    def pick(self, n: int, label: str) -> int:
        return 0


def _int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _type_name(value: object) -> str:
    return type(value).__name__


def field_problem(type_: str, value: object, num_blocks: int | None) -> str | None:
    """What is wrong with ``value`` as a field of ``type_`` (``spec/events.py``'s field types),
    or None."""
    if type_ in ("id", "nat"):
        if not _int(value) or value < 0:  # type: ignore[operator]
            return f"{value!r} ({_type_name(value)}) is not an int >= 0"
    elif type_ == "int":
        if not _int(value):
            return f"{value!r} ({_type_name(value)}) is not an int"
    elif type_ == "block":
        if not _int(value):
            return f"{value!r} ({_type_name(value)}) is not a block id (an int)"
        if num_blocks is not None and not 0 <= value < num_blocks:  # type: ignore[operator]
            return f"block {value} is outside 0..{num_blocks - 1}"
    elif type_ in ("tokens", "blocks", "ids"):
        if not isinstance(value, tuple):
            return f"a {_type_name(value)}, not a tuple"
        if type_ == "tokens" and not value:
            return "an empty tuple of tokens"
        for item in value:
            problem = field_problem("block" if type_ == "blocks" else "nat", item, num_blocks)
            if problem is not None:
                return f"item {item!r}: {problem}"
    elif type_ == "sampled":
        if not isinstance(value, tuple):
            return f"a {_type_name(value)}, not a tuple"
        for pair in value:
            if not isinstance(pair, tuple) or len(pair) != 2:
                return f"item {pair!r} is not a (req, token) tuple"
            if not all(_int(x) and x >= 0 for x in pair):  # type: ignore[operator]
                return f"item {pair!r} is not two ints >= 0"
    elif type_ == "reason":
        if value not in REASONS:
            return f"{value!r} is not one of {', '.join(REASONS)}"
    return None


def check_event(event: object, num_blocks: int | None = None, where: str = "events") -> None:
    """``ProtocolError`` unless ``event`` is a tuple of a known kind with exactly its fields,
    each of its type (``spec/events.py``)."""
    if not isinstance(event, tuple):
        raise ProtocolError(f"{where}: event {event!r} is a {_type_name(event)}, not a tuple")
    if not event or not isinstance(event[0], str) or event[0] not in KINDS:
        raise ProtocolError(
            f"{where}: event {event!r}: unknown kind {event[:1]!r} (spec/events.py: "
            f"{', '.join(KINDS)})"
        )
    kind = KINDS[event[0]]
    names = ", ".join(name for name, _ in kind.fields) or "none"
    trailing = TRAILING.get(kind.name)
    group = event[-1]
    if trailing is not None and len(event) == 2 + len(kind.fields) and type(group) is int:
        if group < 1:  # its group, canonical: a group other than 0
            raise ProtocolError(
                f"{where}: event {event!r}: field {trailing[0]}: {group!r} is not an int >= 1 "
                "(group 0 is written without the field)"
            )
        event = event[:-1]
    if len(event) != 1 + len(kind.fields):
        raise ProtocolError(
            f"{where}: event {event!r}: a {kind.name} has {len(kind.fields)} fields ({names}), "
            f"this one {len(event) - 1} values"
        )
    for (name, type_), value in zip(kind.fields, event[1:], strict=True):
        problem = field_problem(type_, value, num_blocks)
        if problem is not None:
            raise ProtocolError(f"{where}: event {event!r}: field {name}: {problem}")


def check_snapshot(snapshot: object, num_blocks: int, method: str = "snapshot()") -> None:
    """``ProtocolError`` unless ``snapshot`` is None or (refcounts, free queue): two tuples of
    ints, one refcount per block."""
    if snapshot is None:
        return
    if not isinstance(snapshot, tuple) or len(snapshot) != 2:
        raise ProtocolError(
            f"{method}: returned a {_type_name(snapshot)}, not None or a (refcounts, free queue) "
            "tuple"
        )
    for name, part in zip(("refcounts", "free queue"), snapshot, strict=True):
        if not isinstance(part, tuple):
            raise ProtocolError(f"{method}: {name} is a {_type_name(part)}, not a tuple")
        bad = [x for x in part if not _int(x)]
        if bad:
            raise ProtocolError(
                f"{method}: {name} holds {bad[0]!r} ({_type_name(bad[0])}), not an int"
            )
    if len(snapshot[0]) != num_blocks:
        raise ProtocolError(
            f"{method}: refcounts has {len(snapshot[0])} values, the pool {num_blocks} blocks"
        )


def check_pool_view(view: object, num_blocks: int, method: str = "pool_view()") -> None:
    """``ProtocolError`` unless ``view`` is None or an ``engine_view.PoolView`` whose fields are
    None or of their types: an int count, a tuple of block ids, a tuple of tuples of block ids."""
    if view is None:
        return
    if not isinstance(view, PoolView):
        raise ProtocolError(
            f"{method}: returned a {_type_name(view)}, not None or a kvspec PoolView"
        )
    if view.free_count is not None and not _int(view.free_count):
        raise ProtocolError(f"{method}: free_count is a {_type_name(view.free_count)}, not an int")
    parts = [("evictable", view.evictable)] if view.evictable is not None else []
    if view.index is not None:
        if not isinstance(view.index, tuple):
            raise ProtocolError(f"{method}: index is a {_type_name(view.index)}, not a tuple")
        parts += [(f"index[{i}]", blocks) for i, blocks in enumerate(view.index)]
    for name, blocks in parts:
        if not isinstance(blocks, tuple):
            raise ProtocolError(f"{method}: {name} is a {_type_name(blocks)}, not a tuple")
        bad = [b for b in blocks if not _int(b) or not 0 <= b < num_blocks]
        if bad:
            raise ProtocolError(f"{method}: {name} holds {bad[0]!r}, not a block id")


def _result(method: str, value: object, want: type | tuple[type, ...], what: str) -> None:
    if not isinstance(value, want) or (want is bool and not isinstance(value, bool)):
        raise ProtocolError(f"{method}: returned {value!r} ({_type_name(value)}), not {what}")


class Checked:
    """An adapter's calls, each result and each new event checked as it comes."""

    def __init__(self, adapter: Adapter) -> None:
        self.adapter = adapter
        self.num_blocks = adapter.config.num_blocks
        self.seen = 0

    def events(self, method: str) -> None:
        events = self.adapter.events
        if not isinstance(events, list):
            raise ProtocolError(f"{method}: events is a {_type_name(events)}, not a list")
        for event in events[self.seen :]:
            check_event(event, self.num_blocks, f"{method}: emitted")
        self.seen = len(events)

    def call(self, method: str, *args: object) -> object:
        result = getattr(self.adapter, method)(*args)
        shown = f"{method}({', '.join(map(repr, args))})" if len(args) < 3 else f"{method}(...)"
        if method in ("step", "abort", "reset_prefix_cache"):
            _result(shown, result, bool, "a bool")
        elif method == "add_request" and result is not None:
            raise ProtocolError(f"{shown}: returned {result!r}, not None")
        elif method == "live_requests":
            _result(shown, result, list, "a list of request ids")
            bad = [r for r in result if not _int(r)]  # type: ignore[attr-defined]
            if bad:
                raise ProtocolError(f"{shown}: holds {bad[0]!r} ({_type_name(bad[0])}), not an id")
        elif method == "snapshot":
            check_snapshot(result, self.num_blocks, "snapshot()")
        elif method == "pool_view":
            check_pool_view(result, self.num_blocks, "pool_view()")
        self.events(shown)
        return result


def check_adapter(
    factory: Factory, config: Config, target: str = "factory", choices: Choices | None = None
) -> int:
    """Build an adapter (``adapter.probe``) and drive it through every method of the protocol on
    a small workload (two requests sharing a prefix, steps until idle, a third aborted, a reset),
    checking every result and every event (``ProtocolError`` at the first problem, naming the
    method and the field). The number of events checked."""
    adapter = probe(factory, config, choices or FirstChoice(), target)  # type: ignore[arg-type]
    if not isinstance(adapter.config, Config):
        raise ProtocolError(
            f"--target {target}: config is a {_type_name(adapter.config)}, not kvspec.spec.Config"
        )
    checked = Checked(adapter)
    checked.events("the factory")
    bsz = config.block_size
    shared = tuple(1 + i % 3 for i in range(2 * bsz))
    for rid, prompt in enumerate((shared + (1,), shared + (2, 3))):
        checked.call("add_request", rid, prompt, 2, 0)
        checked.call("snapshot")
    _run(checked)
    checked.call("add_request", 2, shared, 3, 0)
    checked.call("step")
    live = checked.call("live_requests")
    if 2 in live:  # type: ignore[operator]
        checked.call("abort", 2)
    _run(checked)
    checked.call("live_requests")
    checked.call("reset_prefix_cache")
    checked.call("snapshot")
    return checked.seen


def _run(checked: Checked) -> None:
    for _ in range(RUN_STEPS):
        busy = checked.call("step")
        checked.call("snapshot")
        if hasattr(checked.adapter, "pool_view"):  # optional (engine_view.py)
            checked.call("pool_view")
        if not busy:
            return


def check_events(events: Sequence[object], num_blocks: int, start: int = 0) -> None:
    """``check_event`` of ``events[start:]`` (the fuzzer's ``--check-protocol``)."""
    for event in events[start:]:
        check_event(event, num_blocks, "an engine call")


class CheckingAdapter:
    """An adapter whose every call is checked (``Checked``): ``kvspec fuzz --check-protocol``.
    Everything else is the adapter's own."""

    def __init__(self, adapter: Adapter) -> None:
        self._checked = Checked(adapter)
        self._adapter = adapter

    def _call(self, method: str, *args: object) -> object:
        try:
            return self._checked.call(method, *args)
        except ProtocolError as err:
            raise AdapterMistake(str(err)) from None

    def __getattr__(self, name: str) -> object:
        return getattr(self._adapter, name)

    def add_request(
        self,
        rid: int,
        prompt: tuple[int, ...],
        max_tokens: int,
        priority: int,
        external: bool = False,
    ) -> None:
        self._call("add_request", rid, prompt, max_tokens, priority, external)

    def step(self) -> bool:
        return self._call("step")  # type: ignore[return-value]

    def abort(self, rid: int) -> bool:
        return self._call("abort", rid)  # type: ignore[return-value]

    def reset_prefix_cache(self) -> bool:
        return self._call("reset_prefix_cache")  # type: ignore[return-value]

    def live_requests(self) -> list[int]:
        return self._call("live_requests")  # type: ignore[return-value]

    def snapshot(self) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
        return self._call("snapshot")  # type: ignore[return-value]

    def pool_view(self) -> PoolView | None:
        """The adapter's optional ``pool_view``, checked; None where it has none."""
        if not hasattr(self._adapter, "pool_view"):
            return None
        return self._call("pool_view")  # type: ignore[return-value]


def checking(factory: Factory) -> Factory:
    """``factory``, its adapters checked on every call (``CheckingAdapter``)."""

    def build(config: Config, choices: Choices) -> Adapter:
        return CheckingAdapter(factory(config, choices))  # type: ignore[return-value]

    build.__name__ = getattr(factory, "__name__", "factory")
    return build
