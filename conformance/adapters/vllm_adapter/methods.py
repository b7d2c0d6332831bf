"""Instance wrappers that stay out of the way: the machinery ``attach.py`` and ``pool_attach.py``
share.

``Wrappers.install(obj, name, make)`` replaces ``obj.name`` on that instance only by
``make(original)``, where ``original`` calls what ``obj.name`` would call without the wrapper *at
the time of the call*: the method an instance attribute held at attach time, else the class's
current one. So a test that patches a vLLM class after the object was built gets its patch, as
it would without kvspec; ``tampered()`` then names what changed (a class method patched, one of
the wrappers replaced on the instance), which the attachments refuse to judge.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Method = Callable[..., Any]


class Wrappers:
    def __init__(self) -> None:
        self.installed: list[tuple[Any, str, Method, Any]] = []
        """(object, name, the wrapper, the class attribute at install time)."""
        self._own: dict[tuple[int, str], Method] = {}

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

        wrapper = make(original)
        setattr(obj, name, wrapper)
        self.installed.append((obj, name, wrapper, cls_attr))

    def tampered(self) -> str | None:
        """What replaced a wrapper or patched a wrapped class method since install, or None."""
        for obj, name, wrapper, cls_attr in self.installed:
            if obj.__dict__.get(name) is not wrapper:
                return f"{type(obj).__name__}.{name} replaced on the instance"
            if (id(obj), name) not in self._own and getattr(type(obj), name, None) is not cls_attr:
                return f"{type(obj).__name__}.{name} patched on the class"
        return None

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
