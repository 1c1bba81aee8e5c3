"""The one way the capture, the hold controller and the proxy connector wrap vLLM methods: detachably.

`Attachments.attach(obj, {name: wrapper})` sets instance attributes (vLLM's classes are never
changed, so only the engine being wrapped is affected); `detach()` removes every wrapper still on
top, so the engine calls vLLM's own method again. A wrapper that another was attached over stays in
that chain (removing it would drop the one above); its owner makes it a pass-through instead (the
capture checks `Recorder.closed`, the hold controller `HoldController.closed`). `set_attached(False)`
takes every wrapper off for a while and `set_attached(True)` puts them back (A/B measurements).
"""

from __future__ import annotations

from typing import Any, Callable


class Attachments:
    __slots__ = ("_items",)

    def __init__(self):
        self._items: list[tuple[Any, dict[str, Callable]]] = []

    def attach(self, obj: Any, wrappers: dict[str, Callable]) -> None:
        for name, fn in wrappers.items():
            setattr(obj, name, fn)
        self._items.append((obj, wrappers))

    def __iter__(self):
        return iter(self._items)

    def detach(self) -> None:
        """Remove every wrapper still on top of its object; forget them all."""
        for obj, wrappers in self._items:
            for name, fn in wrappers.items():
                if obj.__dict__.get(name) is fn:
                    del obj.__dict__[name]
        self._items.clear()

    def set_attached(self, on: bool) -> None:
        for obj, wrappers in self._items:
            for name, fn in wrappers.items():
                if on:
                    setattr(obj, name, fn)
                else:
                    obj.__dict__.pop(name, None)
