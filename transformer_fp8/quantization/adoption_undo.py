"""Recipe adoptions made during a step that fails are undone.

A module takes a DelayedScaling recipe when it first runs under it (or when a context under it
is entered while the module has none): its amax histories are resized to the recipe's length
and its recipe record written (state.py, _adopt_new_recipe). If the step then fails (an
exception leaves the outermost fp8_autocast), its amaxes are discarded; so is the adoption
here, so that a failed step leaves the FP8 state as it found it (a failed first step under a
shorter history cut the histories for good). Only steps that adopt something record anything:
a steady-state step costs a truth test at its exit.
"""
from __future__ import annotations

import threading
import weakref


class _Adoptions(threading.local):
    def __init__(self):
        # One list per outermost context being run (an isolated one, make_graphed_callables',
        # may run inside another): (module ref, what _adopt_new_recipe is about to change).
        self.frames: list = []


_LOCAL = _Adoptions()


def begin() -> None:
    """An outermost fp8_autocast is entered: adoptions from now on are recorded for it."""
    _LOCAL.frames.append([])


def note(module, snapshot: dict) -> None:
    """``module`` is about to adopt a recipe; ``snapshot`` puts it back (Fp8State's
    _restore_adoption_snapshot)."""
    frames = _LOCAL.frames
    if frames:
        frames[-1].append((weakref.ref(module), snapshot))


def end(failed: bool) -> None:
    """The outermost fp8_autocast exits: on failure its step's adoptions are undone, newest
    first."""
    frames = _LOCAL.frames
    records = frames.pop() if frames else []
    if failed:
        for ref, snapshot in reversed(records):
            module = ref()
            if module is not None:
                module._restore_adoption_snapshot(snapshot)
