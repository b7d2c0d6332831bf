"""Instance wrappers that stay out of the way: the machinery ``attach.py`` and ``pool_attach.py``
share.

``Wrappers.install(obj, name, make)`` replaces ``obj.name`` on that instance only by
``make(original)``, where ``original`` calls what ``obj.name`` would call without the wrapper *at
the time of the call*: the method an instance attribute held at attach time, else the class's
current one. So a test that patches a vLLM class after the object was built gets its patch, as
it would without kvspec; ``tampered()`` then names what changed (a class method patched, one of
the wrappers replaced on the instance), which the attachments refuse to judge.

One replacement is not tampering: a test's own wrapper around kvspec's, set on the instance
(``orig = obj.name; def spy(*a, **k): ...; return orig(*a, **k)``; ``obj.name = spy``), which
vLLM's tests use to count calls. ``tampered()`` adopts a replacement whose closure holds the
wrapper it replaced, and puts a guard around it: every call of the replacement must call that
wrapper exactly once (what vLLM did then is what kvspec records), else ``on_bypass`` is told
(the attachments refuse, as for any other patch). A replacement that calls it conditionally
(a spy that fails the first allocation by itself) is caught at its first call that does not.

Some calls a test may answer itself, without vLLM (``answerable``): an attachment names a method
and the answers it accepts (the scheduler's: ``KVCacheManager.allocate_slots`` answering None, an
allocation that failed; ``reset_prefix_cache`` answering a bool, the manager's reply). Any
replacement of such a method (a ``Mock``, ``patch.object(..., side_effect=...)``, a spy that
fails one call) is adopted under the same guard: a call that called kvspec's wrapper once is
recorded as usual; one that did not is an answer, accepted where it is one the attachment named
and the attachment's ``snapshot`` (what the spec models of vLLM's state) is unchanged across it,
else ``on_bypass`` is told. The guard forwards attribute reads to the replacement (a test's
``mock.assert_called_once()`` still works), and kvspec's own wrapper put back (``patch.object``
leaving) is taken back as it was.

**Never kvspec's fault.** Every wrapper runs vLLM's method exactly once, whatever kvspec's own
code inside it does: an exception raised by kvspec's part (not by vLLM's method, whose
exceptions pass through unchanged) is handed to ``on_error`` (the attachments record it as an
internal error and stop judging), and the call completes as if kvspec were absent: vLLM's method
is called with the caller's arguments if kvspec had not called it yet, else its result (or its
exception) is what the caller gets. kvspec's part returning without calling vLLM's method at
all is such an error too; calling it a second time gets the first call's outcome, never a
second run. After the first error (``failed``) every wrapper passes straight through to vLLM.
"""

from __future__ import annotations

from collections.abc import Callable
from types import FunctionType
from typing import Any

Method = Callable[..., Any]


class Wrappers:
    def __init__(self) -> None:
        self.installed: list[tuple[Any, str, Method, Any]] = []
        """(object, name, the wrapper now expected there, the class attribute at install)."""
        self._own: dict[tuple[int, str], Method] = {}
        self._calls: dict[tuple[int, str], int] = {}
        """Calls of kvspec's own wrapper, per (object, name): what an adopted spy's guard counts."""
        self.on_bypass: Callable[[str], None] = lambda why: None
        """Told when an adopted replacement returned without calling kvspec's wrapper once."""
        self.on_error: Callable[[str], None] = lambda why: None
        """Told of a bug of kvspec inside a wrapper (module docstring: never kvspec's fault)."""
        self.failed = False
        """Whether ``on_error`` was told: from then on the wrappers only call vLLM."""
        self.answerable: dict[tuple[int, str], Callable[[Any], bool]] = {}
        """(object, name) -> whether a result is an answer a test may give without vLLM."""
        self.snapshot: Callable[[], object] = lambda: None
        """What the spec models of vLLM's state: an accepted answer leaves it unchanged."""
        self._mine: dict[tuple[int, str], Method] = {}
        """kvspec's own wrapper per (object, name), as installed: taken back when put back."""

    def install(self, obj: Any, name: str, make: Callable[[Method], Method]) -> None:
        own = obj.__dict__.get(name)
        cls_attr = getattr(type(obj), name, None)
        if own is not None:
            self._own[(id(obj), name)] = own

            def original(*args: Any, **kwargs: Any) -> Any:
                return own(*args, **kwargs)
        else:

            def original(*args: Any, **kwargs: Any) -> Any:
                return getattr(type(obj), name)(obj, *args, **kwargs)

        frames: list[_Call] = []  # the calls of this wrapper in progress, innermost last

        def once(*args: Any, **kwargs: Any) -> Any:
            """vLLM's method, as kvspec's part calls it: run once per call of the wrapper."""
            if not frames:  # called after its wrapper returned: nothing to track
                return original(*args, **kwargs)
            call = frames[-1]
            if call.state is not _NOT_CALLED:  # kvspec's second call: the first one's outcome
                self._error(f"{where}: kvspec called vLLM's method twice")
                return call.outcome()
            call.state = _RUNNING
            try:
                call.value = original(*args, **kwargs)
            except BaseException as err:
                call.state, call.value = _RAISED, err
                raise
            call.state = _RETURNED
            return call.value

        where = f"{type(obj).__name__}.{name}"
        inner = make(once)
        key = (id(obj), name)
        calls = self._calls
        calls[key] = 0

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            calls[key] += 1
            if self.failed:
                return original(*args, **kwargs)
            call = _Call()
            frames.append(call)
            try:
                result = inner(*args, **kwargs)
            except BaseException as err:
                if call.state is _RAISED:  # vLLM's own exception (or kvspec's on top of it)
                    if err is call.value:
                        raise
                    self._error(f"{where}: {type(err).__name__}: {err} (after vLLM raised)")
                    raise call.value from call.value.__cause__
                if not isinstance(err, Exception):
                    raise  # an interrupt: the user's, not kvspec's part
                self._error(f"{where}: {type(err).__name__}: {err}")
                if call.state is _RETURNED:
                    return call.value
                return original(*args, **kwargs)  # as if kvspec were absent
            finally:
                frames.pop()
            if call.state is _NOT_CALLED:
                self._error(f"{where}: kvspec's wrapper did not call vLLM's method")
                return original(*args, **kwargs)
            return result

        wrapper.__doc__ = inner.__doc__
        setattr(obj, name, wrapper)
        self.installed.append((obj, name, wrapper, cls_attr))
        self._mine[key] = wrapper

    def _error(self, why: str) -> None:
        """A bug of kvspec in a wrapper: told once (``on_error``), then the wrappers step aside.
        ``on_error`` failing in turn changes nothing for vLLM."""
        first, self.failed = not self.failed, True
        if first:
            try:
                self.on_error(why)
            except Exception:  # the last line of defence: vLLM's call goes on regardless
                pass

    def tampered(self) -> str | None:
        """What replaced a wrapper or patched a wrapped class method since install, or None. A
        test's wrapper around the one it replaced is adopted instead (module docstring)."""
        for i, (obj, name, wrapper, cls_attr) in enumerate(self.installed):
            current = obj.__dict__.get(name)
            key = (id(obj), name)
            mine = self._mine.get(key)
            if current is not wrapper and mine is not None and current is mine:
                self.installed[i] = (obj, name, mine, cls_attr)  # kvspec's, put back
            elif current is not wrapper:
                answerable = current is not None and key in self.answerable
                if not answerable and not _delegates(current, wrapper):
                    return f"{type(obj).__name__}.{name} replaced on the instance"
                guard = self._guard(obj, name, current)
                setattr(obj, name, guard)
                self.installed[i] = (obj, name, guard, cls_attr)
            if (id(obj), name) not in self._own and getattr(type(obj), name, None) is not cls_attr:
                return f"{type(obj).__name__}.{name} patched on the class"
        return None

    def _guard(self, obj: Any, name: str, spy: Method) -> Method:
        key, calls, where = (id(obj), name), self._calls, f"{type(obj).__name__}.{name}"

        accepts = self.answerable.get(key)

        def guard(*args: Any, **kwargs: Any) -> Any:
            before = calls[key]
            state = self.snapshot() if accepts is not None else None
            result = spy(*args, **kwargs)
            made = calls[key] - before
            if made == 1:
                return result
            if made == 0 and accepts is not None and accepts(result):
                if self.snapshot() == state:
                    return result  # the test's answer in vLLM's place: nothing changed
                self.on_bypass(f"{where} answered by the test, with vLLM's state changed")
                return result
            self.on_bypass(f"{where} replaced on the instance by a wrapper that did not call it")
            return result

        if isinstance(spy, FunctionType):
            return guard
        return _Forwarding(guard, spy)

    def uninstall(self) -> None:
        """Put back what was there (where the wrapper is still in place)."""
        for obj, name, wrapper, _ in reversed(self.installed):
            if obj.__dict__.get(name) is wrapper:
                own = self._own.get((id(obj), name))
                if own is not None:
                    setattr(obj, name, own)
                else:
                    delattr(obj, name)
        self.installed.clear()


_NOT_CALLED, _RUNNING, _RETURNED, _RAISED = "not called", "running", "returned", "raised"


class _Forwarding:
    """A guard around a replacement that is not a plain function (a ``Mock``): called, the
    guard runs; any attribute is the replacement's (``assert_called_once``, ``call_count``)."""

    def __init__(self, guard: Method, spy: object) -> None:
        self._kvspec_guard = guard
        self._kvspec_spy = spy

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._kvspec_guard(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._kvspec_spy, name)


class _Call:
    """One call of a wrapper: whether vLLM's method ran, and its result or exception."""

    __slots__ = ("state", "value")

    def __init__(self) -> None:
        self.state = _NOT_CALLED
        self.value: Any = None

    def outcome(self) -> Any:
        if self.state is _RAISED:
            raise self.value
        return self.value


def _delegates(replacement: object, wrapper: Method) -> bool:
    """Whether ``replacement`` is a function that closes over ``wrapper`` (a test's wrapper
    around it)."""
    cells = getattr(replacement, "__closure__", None) or ()
    for cell in cells:
        try:
            if cell.cell_contents is wrapper:
                return True
        except ValueError:  # an empty cell
            continue
    return False
