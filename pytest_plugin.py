"""kvspec's pytest plugin: an engine's own tests, judged (``pytest -p kvspec.pytest_plugin``).

Installing kvspec registers it (the ``pytest11`` entry point ``kvspec.pytest_plugin``), so in an
environment with vLLM 0.33.0 every pytest run is judged; ``-p no:kvspec.pytest_plugin`` turns it
off. Where vLLM is not importable it does nothing.

While it is active, vLLM's ``Scheduler``, ``KVCacheManager`` and ``BlockPool`` constructors are
patched: every scheduler a test builds is attached (``vllm_adapter.attach``: events from vLLM's
own entry points) and judged by the spec (``judge_for``), and every ``KVCacheManager`` or
``BlockPool`` built on its own (not inside a scheduler) by the pool-level judge
(``vllm_adapter.pool_attach``, ``conformance.pool_judge``). Judging happens at each consistent
point (an outermost entry point returned): the events so far are fed, and vLLM's refcounts, free
queue and cached blocks are compared with the judge's state.

* A violation (an invariant broken, vLLM's effects differing from the spec's, an illegal
  decision) fails the test with kvspec's report, after the test body ran; a test that failed on
  its own keeps its own failure.
* A refusal (a feature the spec does not model, seen at construction or at run time) never fails
  a test: the attachment stops being judged and the summary lists it by feature.
* A bug of kvspec inside a wrapper is recorded (and listed), never raised into the test.

The summary at the end of the run (and ``--kvspec-report FILE``, JSON per test) sorts every test
into: no Scheduler built, a bare KVCacheManager/BlockPool judged (or refused), refused at
construction, stopped mid-run, judged and holding, violation.
"""

from __future__ import annotations

import functools
import json
import threading
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

OUTCOME_ORDER = ("violation", "error", "run", "construction", "judged")
LABELS = {
    "none": "no Scheduler, KVCacheManager or BlockPool built",
    "pool": "a bare KVCacheManager / BlockPool, judged and holding",
    "pool-refused": "a bare KVCacheManager / BlockPool, refused",
    "construction": "refused at construction (a feature the spec cannot express)",
    "run": "stopped mid-run (a feature seen only at run time)",
    "judged": "judged and holding",
    "violation": "violations",
    "error": "kvspec internal errors (judging stopped; the test ran as usual)",
}


class KvspecViolation(AssertionError):
    """The test drove vLLM into a state, or through a step, the spec does not allow."""


def judge_for(config: Any) -> Any:
    """The judge of a scheduler's events: the spec itself, strict, in-process
    (``Judge.spec``). (The one call site of the judge's constructor.)"""
    from kvspec.conformance.judge.core import Judge

    return Judge.spec(config)


@dataclass
class Record:
    """One test's part: the sessions it built or drove."""

    nodeid: str
    sessions: list[Session] = field(default_factory=list)

    def outcome(self) -> dict[str, Any]:
        schedulers = [s for s in self.sessions if s.kind == "scheduler"]
        pools = [s for s in self.sessions if s.kind == "pool"]
        states = [s.state() for s in schedulers or pools]
        entry: dict[str, Any] = {"outcome": "none", "features": [], "events": 0}
        if not states:
            return entry
        entry["events"] = sum(len(s.attachment.events) for s in schedulers or pools)
        entry["features"] = list(
            dict.fromkeys(
                str(feature)
                for s in self.sessions
                if s.attachment.refusal
                for feature in s.attachment.refusal.features
            )
        )
        entry["refusals"] = [
            str(s.attachment.refusal) for s in self.sessions if s.attachment.refusal
        ]
        worst = min(states, key=OUTCOME_ORDER.index)
        findings = [s.report for s in self.sessions if s.report]
        if findings:
            entry["finding"] = findings[0].splitlines()[0]
        if not schedulers and worst in ("run", "construction"):
            worst = "pool-refused"
        elif not schedulers and worst == "judged":
            worst = "pool"
        entry["outcome"] = worst
        return entry


class Session:
    """An attachment and its judge."""

    def __init__(self, plugin: Plugin, kind: str, attachment: Any, judge: Any) -> None:
        self.plugin, self.kind, self.attachment, self.judge = plugin, kind, attachment, judge
        self.config = getattr(attachment, "config", None)
        """The configuration the judge was built for (a scheduler's)."""
        self.fed = 0
        self.report: str | None = None
        self.tests: set[str] = set()
        plugin.touch(self)

    def state(self) -> str:
        if self.report is not None:
            return "violation"
        refusal = self.attachment.refusal
        if refusal is not None:
            return "error" if refusal.feature == "kvspec internal error" else refusal.at
        return "judged"

    def point(self, attachment: Any) -> None:
        """A consistent point: judge the new events, compare vLLM's pool with the judge's."""
        self.plugin.touch(self)
        if self.report is not None or attachment.refusal is not None:
            return
        try:
            if not self.fed and self.kind == "scheduler" and self.config != attachment.config:
                # a setting the test changed before the first event (defer_block_free)
                self.config = attachment.config
                self.judge = judge_for(attachment.config)
            events = attachment.events[self.fed :]
            self.fed = len(attachment.events)
            finding = self.judge.feed_all(events)
            if finding is None:
                finding = self.judge.compare(*attachment.snapshot())
            check = attachment.self_check() if finding is None else None
            if finding is None and check is not None:
                finding = f"Disagreement: {check}"
        except Exception as err:  # kvspec's own bug: never the test's
            attachment.refuse("kvspec internal error", f"{type(err).__name__}: {err}")
            return
        if finding is not None:
            self.report = report(finding, attachment.events, getattr(attachment, "ids", {}))


def report(finding: Any, events: list[tuple[object, ...]], ids: dict[str, int]) -> str:
    """kvspec's report of a finding: what broke, why it matters, the events that led there."""
    lines = [f"kvspec: {finding}"]
    explanation = getattr(finding, "explanation", "")
    if explanation:
        lines.append(f"  ({explanation})")
    if ids:
        names = ", ".join(f"r{n} = {rid!r}" for rid, n in list(ids.items())[:12])
        lines.append(f"request ids: {names}")
    at = getattr(finding, "event", len(events))
    start = max(0, at - 40)
    lines.append(f"events {start} to {min(at, len(events) - 1)} (the last is where it was found):")
    for i in range(start, min(at + 1, len(events))):
        lines.append(f"  {i:5d} {events[i]}")
    return "\n".join(lines)


class Plugin:
    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.current: Record | None = None
        self.records: dict[str, dict[str, Any]] = {}
        self.patched: list[tuple[Any, Any]] = []
        self.local = threading.local()
        self.enabled = False
        self.errors: list[str] = []

    # -- constructor patches ------------------------------------------------------------------

    def install(self) -> None:
        try:
            from vllm.v1.core.block_pool import BlockPool
            from vllm.v1.core.kv_cache_manager import KVCacheManager
            from vllm.v1.core.sched.scheduler import Scheduler
        except Exception:  # no vLLM here: nothing to judge
            return
        self.enabled = True
        for cls, kind in ((Scheduler, "scheduler"), (KVCacheManager, "pool"), (BlockPool, "pool")):
            original = cls.__init__
            cls.__init__ = self._constructor(original, kind)
            self.patched.append((cls, original))

    def uninstall(self) -> None:
        for cls, original in reversed(self.patched):
            cls.__init__ = original
        self.patched.clear()

    def _constructor(self, original: Any, kind: str) -> Any:
        plugin = self

        @functools.wraps(original)
        def __init__(obj: Any, *args: Any, **kwargs: Any) -> None:
            depth = getattr(plugin.local, "building", 0)
            plugin.local.building = depth + 1
            try:
                original(obj, *args, **kwargs)
            finally:
                plugin.local.building = depth
            if depth == 0 and not getattr(obj, "_kvspec_attached", False):
                plugin.adopt(obj, kind)

        return __init__

    def adopt(self, obj: Any, kind: str) -> None:
        """Attach to an object vLLM just built (outside any other vLLM constructor)."""
        try:
            obj._kvspec_attached = True
            if kind == "scheduler":
                from kvspec.conformance.adapters.vllm_adapter.attach import attach

                attachment = attach(obj, hold_arrivals=True)  # tests add out of order
                judge = judge_for(attachment.config)
            else:
                from kvspec.conformance.adapters.vllm_adapter.pool_attach import attach_pool
                from kvspec.conformance.pool_judge import PoolJudge

                attachment = attach_pool(obj)
                judge = PoolJudge(attachment.num_blocks, attachment.caching)
        except Exception as err:  # kvspec's own bug: the test goes on unjudged
            self.errors.append(f"attaching to {type(obj).__name__}: {type(err).__name__}: {err}")
            return
        session = Session(self, kind, attachment, judge)
        attachment.listener = session.point

    def touch(self, session: Session) -> None:
        record = self.current
        if record is not None and session not in record.sessions:
            record.sessions.append(session)

    # -- hooks --------------------------------------------------------------------------------

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: Any) -> Iterator[Any]:
        self.current = Record(item.nodeid)
        try:
            return (yield)
        finally:
            record, self.current = self.current, None
            if self.enabled:
                self.records[record.nodeid] = record.outcome()

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_call(self, item: pytest.Item) -> Iterator[Any]:
        result = yield  # the test's own failure, if any, propagates from here unchanged
        record = self.current
        reports = [s.report for s in (record.sessions if record else []) if s.report]
        if reports:
            raise KvspecViolation(reports[0])
        return result

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if not self.enabled:
            return
        counts = Counter(entry["outcome"] for entry in self.records.values())
        features: Counter[str] = Counter()
        for entry in self.records.values():
            features.update(set(entry["features"]))
        write = terminalreporter.write_line
        terminalreporter.section("kvspec")
        for key, label in LABELS.items():
            write(f"{counts[key]:6d}  {label}")
        if features:
            write("refused, by feature (tests):")
            for feature, n in features.most_common():
                write(f"{n:6d}  {feature}")
        for error in self.errors[:5]:
            write(f"kvspec error: {error}")
        path = self.config.getoption("kvspec_report")
        if path:
            with open(path, "w") as f:
                json.dump({"tests": self.records, "errors": self.errors}, f, indent=1)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kvspec", "kvspec: vLLM's schedulers and pools judged by the spec")
    group.addoption(
        "--kvspec-report", default=None, metavar="FILE", help="write each test's outcome (JSON)"
    )


def pytest_configure(config: pytest.Config) -> None:
    plugin = Plugin(config)
    plugin.install()
    config.pluginmanager.register(plugin, "kvspec-judge")
    config.stash[_KEY] = plugin


def pytest_unconfigure(config: pytest.Config) -> None:
    plugin = config.stash.get(_KEY, None)
    if plugin is not None:
        plugin.uninstall()


_KEY = pytest.StashKey[Plugin]()
