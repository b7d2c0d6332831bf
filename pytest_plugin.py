"""kvspec's pytest plugin: an engine's own tests, judged (``pytest --kvspec``).

Installing kvspec registers it (the ``pytest11`` entry point ``kvspec.pytest_plugin``), but it
judges only when asked: ``--kvspec`` on the command line, or ``kvspec = true`` in the ini file
(``[tool.pytest.ini_options]``, ``pytest.ini``, ...). Unasked, it patches nothing and prints
nothing. Asked, its summary says what it judged; where vLLM cannot be imported it says so and
judges nothing, and on a vLLM version outside ``supported_versions()`` it says so once and
judges as far as the attachment goes (what it cannot follow is a refusal or a counted internal
error, never a changed outcome). ``--kvspec-report FILE`` is always written, with the reason
when nothing was judged.

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
* A bug of kvspec inside a wrapper is recorded and counted (the summary's internal errors),
  never raised into the test: vLLM's method runs exactly once, as if kvspec were absent
  (``vllm_adapter/methods.py``), and judging of that attachment stops. So is a bug while
  attaching, judging, or in the plugin's own hooks.
* vLLM's objects are held weakly: the plugin keeps each attachment's events, judge and verdict,
  never the scheduler, manager or pool (a test may check that they are garbage-collected).

The summary at the end of the run (and ``--kvspec-report FILE``, JSON per test) sorts every test
into: no Scheduler built, a bare KVCacheManager/BlockPool judged (or refused), refused at
construction, stopped mid-run, judged and holding, violation.
"""

from __future__ import annotations

import functools
import json
import threading
import weakref
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
SUPPORTED_VLLM = ("0.33.0", "0.34.0")
"""The vLLM releases the attachments know, for the report where vLLM cannot be imported; where it
can, ``vllm_adapter.versions.SUPPORTED`` (a test holds the two equal)."""
NOT_ASKED = "not asked: pass --kvspec, or set kvspec = true in the ini file"


class KvspecViolation(AssertionError):
    """The test drove vLLM into a state, or through a step, the spec does not allow."""


def judge_for(config: Any) -> Any:
    """The judge of a scheduler's events: the spec itself, strict, in-process
    (``Judge.spec``). (The one call site of the judge's constructor.)"""
    from kvspec.judge.core import Judge

    return Judge.spec(config)


def supported_versions() -> tuple[str, ...]:
    """The vLLM versions kvspec's attachments are written for."""
    try:
        from kvspec.conformance.adapters.vllm_adapter import versions
    except Exception:  # an adapter that cannot import here: the plugin's own list
        return SUPPORTED_VLLM
    return versions.SUPPORTED


@dataclass
class Record:
    """One test's part: the sessions it built or drove, and kvspec's errors while attaching."""

    nodeid: str
    sessions: list[Session] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def outcome(self) -> dict[str, Any]:
        schedulers = [s for s in self.sessions if s.kind == "scheduler"]
        pools = [s for s in self.sessions if s.kind == "pool"]
        states = [s.state() for s in schedulers or pools]
        entry: dict[str, Any] = {"outcome": "none", "features": [], "events": 0}
        if self.errors:
            entry["errors"] = list(self.errors)
        if not states:
            if self.errors:
                entry["outcome"] = "error"
            return entry
        entry["events"] = sum(len(s.events) for s in schedulers or pools)
        refusals = [s.refusal for s in self.sessions if s.refusal is not None]
        entry["features"] = list(
            dict.fromkeys(str(feature) for r in refusals for feature in r.features)
        )
        entry["refusals"] = [str(r) for r in refusals]
        internal = [s.error for s in self.sessions if s.error is not None]
        if internal:
            entry["errors"] = entry.get("errors", []) + internal
        worst = min(states, key=OUTCOME_ORDER.index)
        findings = [s.report for s in self.sessions if s.report]
        if findings:
            entry["finding"] = findings[0].splitlines()[0]
        if self.errors and worst != "violation":
            worst = "error"
        if not schedulers and worst in ("run", "construction"):
            worst = "pool-refused"
        elif not schedulers and worst == "judged":
            worst = "pool"
        entry["outcome"] = worst
        return entry


class Session:
    """An attachment and its judge. The attachment (which holds vLLM's objects, and they it,
    through the wrappers on them) is held weakly; what the verdict needs is kept here: its
    events (plain tuples), the judge, its refusal and internal error (kept current through
    the attachment's ``refuse``)."""

    def __init__(self, plugin: Plugin, kind: str, attachment: Any, judge: Any) -> None:
        self.plugin, self.kind, self.judge = plugin, kind, judge
        self.attachment = weakref.ref(attachment)
        self.events: list[tuple[object, ...]] = attachment.events
        self.config = getattr(attachment, "config", None)
        """The configuration the judge was built for (a scheduler's)."""
        self.refusal: Any = None
        self.error: str | None = None
        self.fed = 0
        self.report: str | None = None
        refuse = attachment.refuse

        def refusing(*args: Any, **kwargs: Any) -> None:
            refuse(*args, **kwargs)
            self.sync()

        attachment.refuse = refusing
        self.sync()
        plugin.touch(self)

    def sync(self) -> None:
        """Copy the attachment's refusal and internal error while it lives."""
        attachment = self.attachment()
        if attachment is not None:
            self.refusal, self.error = attachment.refusal, attachment.error

    def state(self) -> str:
        self.sync()
        if self.report is not None:
            return "violation"
        if self.error is not None:
            return "error"
        if self.refusal is not None:
            return "error" if self.refusal.feature == "kvspec internal error" else self.refusal.at
        return "judged"

    def point(self, attachment: Any) -> None:
        """A consistent point: judge the new events, compare vLLM's pool with the judge's."""
        self.plugin.touch(self)
        self.sync()
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
            from kvspec.conformance.adapters.vllm_adapter.attach import internal_error

            internal_error(attachment, f"judging: {type(err).__name__}: {err}")
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
        self.asked = bool(config.getoption("kvspec", False) or _ini_flag(config))
        self.enabled = False
        """Whether vLLM's constructors are patched: asked, and vLLM imported."""
        self.reason: str | None = None if self.asked else NOT_ASKED
        """Why nothing is judged (None: judging)."""
        self.version: str | None = None
        self.unsupported: str | None = None
        """Said once in the summary: the vLLM version is not one kvspec supports."""
        self.errors: list[str] = []

    # -- constructor patches ------------------------------------------------------------------

    def install(self) -> None:
        if not self.asked:
            return
        try:
            import vllm
            from vllm.v1.core.block_pool import BlockPool
            from vllm.v1.core.kv_cache_manager import KVCacheManager
            from vllm.v1.core.sched.scheduler import Scheduler
        except Exception as err:  # no vLLM here: nothing to judge, and the summary says why
            what = " ".join(f"{type(err).__name__}: {err}".split())[:300]
            self.reason = f"vLLM cannot be imported ({what})"
            return
        self.version = str(getattr(vllm, "__version__", "unknown"))
        supported = supported_versions()
        if self.version not in supported:
            self.unsupported = (
                f"vLLM {self.version} is not a version kvspec supports (supported: "
                f"{', '.join(supported)}): judged as far as the attachment follows it"
            )
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
            try:
                depth = getattr(plugin.local, "building", 0)
                plugin.local.building = depth + 1
            except Exception:  # kvspec's bug: vLLM's constructor runs as without kvspec
                return original(obj, *args, **kwargs)
            try:
                original(obj, *args, **kwargs)
            finally:
                plugin.local.building = depth
            if depth == 0:
                plugin.adopt(obj, kind)

        return __init__

    def adopt(self, obj: Any, kind: str) -> None:
        """Attach to an object vLLM just built (outside any other vLLM constructor)."""
        try:
            if getattr(obj, "_kvspec_attached", False):
                return
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
            session = Session(self, kind, attachment, judge)
            attachment.listener = session.point
        except Exception as err:  # kvspec's own bug: the test goes on unjudged, counted
            what = " ".join(f"{type(err).__name__}: {err}".split())[:300]
            self.error(f"attaching to {type(obj).__name__}: {what}")

    def error(self, why: str) -> None:
        """A bug of kvspec outside an attachment: counted against the current test."""
        self.errors.append(why)
        if self.current is not None:
            self.current.errors.append(why)

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
                try:
                    self.records[record.nodeid] = record.outcome()
                except Exception as err:  # kvspec's bug: counted, the run goes on
                    why = f"the outcome of {record.nodeid}: {type(err).__name__}: {err}"
                    self.errors.append(why)
                    self.records[record.nodeid] = {"outcome": "error", "errors": [why]}

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_call(self, item: pytest.Item) -> Iterator[Any]:
        result = yield  # the test's own failure, if any, propagates from here unchanged
        record = self.current
        reports = [s.report for s in (record.sessions if record else []) if s.report]
        if reports:
            raise KvspecViolation(reports[0])
        return result

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        path = self.config.getoption("kvspec_report")
        if not self.asked and not path:
            return
        write = terminalreporter.write_line
        terminalreporter.section("kvspec")
        try:
            self._summary(write)
        except Exception as err:  # kvspec's bug: said, never a failed run
            self.errors.append(f"the summary: {type(err).__name__}: {err}")
            write(f"kvspec error: {self.errors[-1]}")
        if path:
            try:
                self._write_report(path)
                write(f"kvspec report: {path}")
            except Exception as err:  # an unwritable path: said, never a failed run
                write(f"kvspec: could not write the report {path}: {type(err).__name__}: {err}")

    def _summary(self, write: Any) -> None:
        if not self.enabled:
            write(f"kvspec: nothing judged: {self.reason}")
            return
        asked = "--kvspec" if self.config.getoption("kvspec", False) else "the ini option kvspec"
        write(f"kvspec: judging vLLM {self.version}'s schedulers and pools (asked by {asked})")
        if self.unsupported:
            write(f"kvspec: {self.unsupported}")
        counts = Counter(entry["outcome"] for entry in self.records.values())
        features: Counter[str] = Counter()
        for entry in self.records.values():
            features.update(set(entry.get("features", ())))
        for key, label in LABELS.items():
            write(f"{counts[key]:6d}  {label}")
        if features:
            write("refused, by feature (tests):")
            for feature, n in features.most_common():
                write(f"{n:6d}  {feature}")
        errors = [e for entry in self.records.values() for e in entry.get("errors", ())]
        for error in list(dict.fromkeys(errors + self.errors))[:5]:
            write(f"kvspec error: {error}")

    def _write_report(self, path: str) -> None:
        document = {
            "asked": self.asked,
            "judged": self.enabled,
            "reason": self.reason,
            "vllm": self.version,
            "supported": list(supported_versions()) if self.enabled else list(SUPPORTED_VLLM),
            "unsupported": self.unsupported,
            "tests": self.records,
            "errors": self.errors,
        }
        with open(path, "w") as f:
            json.dump(document, f, indent=1)


def _ini_flag(config: pytest.Config) -> bool:
    try:
        return bool(config.getini("kvspec"))
    except (ValueError, KeyError):  # not registered (the plugin loaded late)
        return False


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kvspec", "kvspec: vLLM's schedulers and pools judged by the spec")
    group.addoption(
        "--kvspec",
        action="store_true",
        default=False,
        help="judge every vLLM Scheduler, KVCacheManager and BlockPool the tests build",
    )
    group.addoption(
        "--kvspec-report",
        default=None,
        metavar="FILE",
        help="write each test's outcome (JSON; written even when nothing was judged, with why)",
    )
    parser.addini("kvspec", type="bool", default=False, help="judge as --kvspec does")


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
