"""A run's own object, found by whatever runs on its behalf: the comm session (`comm.using`), the
tracer's recorder (`trace.recording`).

The owner is a context variable, so two runs in one process (a dry run beside a run, the tests'
worlds) keep apart. A context variable alone is not enough: torch's autograd engine runs the
backward of CUDA tensors on its own device threads, which start from an empty context and never
see the caller's, so a backward's collectives would fall back to a plain session (host-visible
completion, no rules, not recorded) and its spans to a recorder nobody reads. Such a thread gets
the process's active run instead: the one object activated and not yet left. Where several are
active at once (nested or side-by-side runs) it cannot tell which is its own, and says so rather
than guess; a thread that carries its context always gets its own.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Generic, TypeVar

T = TypeVar("T")


class RunLocal(Generic[T]):
    """The active run's `T` (module notes): `activate(value)` for a block, `get()` anywhere."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._var: ContextVar[T | None] = ContextVar(name, default=None)
        self._lock = threading.Lock()
        self._active: list[T] = []  # activated and not yet left, in any thread

    def get(self) -> T | None:
        """This context's value; in a thread without one (an autograd device thread), the one
        active value of the process, None where there is none."""
        value = self._var.get()
        if value is not None:
            return value
        with self._lock:
            active = {id(v): v for v in self._active}
        if len(active) > 1:
            raise RuntimeError(
                f"{self.name}: this thread carries no run's context (an autograd device thread?) "
                f"and {len(active)} runs are active in this process, so it cannot tell which is "
                "its own; run one at a time where backward runs on device threads"
            )
        return next(iter(active.values()), None)

    @contextmanager
    def activate(self, value: T) -> Iterator[T]:
        """`value` is the active one for the block (what was active before comes back)."""
        token = self._var.set(value)
        with self._lock:
            self._active.append(value)
        try:
            yield value
        finally:
            with self._lock:
                self._active.remove(value)
            self._var.reset(token)
