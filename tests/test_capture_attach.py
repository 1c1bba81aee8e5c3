"""The one detachable wrapping mechanism (capture/attach.py): only what is on top detaches, and it can be toggled."""

from __future__ import annotations

from kmesh_trace.capture.attach import Attachments


def test_attachments_detach_only_what_is_on_top_and_can_be_toggled():
    class Obj:
        def m(self):
            return "own"

    o = Obj()
    a, b = Attachments(), Attachments()
    a.attach(o, {"m": lambda: "a"})
    b.attach(o, {"m": lambda: "b"})  # over a's
    a.detach()  # a's is not on top: left for b's owner to pass through
    assert o.m() == "b"
    b.set_attached(False)
    assert o.m() == "own"
    b.set_attached(True)
    assert o.m() == "b"
    b.detach()
    assert o.m() == "own" and "m" not in vars(o)

