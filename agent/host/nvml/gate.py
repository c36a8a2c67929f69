"""One NVML session shared by every caller, which a GPU reset can take away for a while.

`nvidia-smi --gpu-reset` refuses while any process holds the GPU's device node open, and an initialised NVML
session (the agent's own included) holds every GPU's node open. So the session must be closed for a reset and
opened again after it. `SessionGate` makes that safe across threads: calls share the session; `suspend` waits
until the calls running now have finished (new ones wait behind it, so a steady stream of polls cannot starve
it), runs `shutdown` with no call in flight, and from then on every call waits until `resume`. Waiting calls are
health checks: they pause for the reset, they do not fail (a check that failed would report the GPU Unhealthy,
or NVML as gone, for no reason).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager


class SessionGate:
    """Shared calls, exclusive suspension. `generation` grows at each suspension: what a caller opened before
    (handles, event sets) belongs to a closed session when it has changed."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._calls = 0
        self._suspending = False
        self._suspended = False
        self.generation = 0

    @property
    def suspended(self) -> bool:
        """True between a successful `suspend` and `resume`."""
        return self._suspended

    @property
    def suspending(self) -> bool:
        """True while a `suspend` waits for running calls (new calls wait behind it)."""
        return self._suspending

    @contextmanager
    def call(self) -> Iterator[None]:
        """Hold the session for one call; waits while it is suspended or a suspension is waiting."""
        with self._cond:
            self._cond.wait_for(lambda: not (self._suspending or self._suspended))
            self._calls += 1
        try:
            yield
        finally:
            with self._cond:
                self._calls -= 1
                self._cond.notify_all()

    def suspend(self, timeout_s: float, shutdown: Callable[[], None]) -> bool:
        """Wait up to `timeout_s` for the running calls, then `shutdown()`; False (nothing changed) on timeout.

        Not for a thread inside `call` (it would wait for itself). `shutdown` runs with no call in flight; if it
        raises, the gate is suspended anyway (the session is in an unknown state; `resume` opens it afresh)."""
        with self._cond:
            if self._suspended:
                return True
            self._suspending = True
            try:
                if not self._cond.wait_for(lambda: self._calls == 0, timeout_s):
                    return False
                self._suspended = True
                self.generation += 1
            finally:
                self._suspending = False
                self._cond.notify_all()
        shutdown()  # no call can start: every caller waits for `_suspended` to clear
        return True

    def resume(self) -> None:
        """Let calls run again (they open the session afresh)."""
        with self._cond:
            self._suspended = False
            self._cond.notify_all()
