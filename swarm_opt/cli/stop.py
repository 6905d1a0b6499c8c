"""Ctrl-C and SIGTERM for the long-running commands: the first asks to stop at the next safe point, a second one
interrupts at once (``KeyboardInterrupt``).

A command installs its handler first thing, before it imports torch or hivemind: a ``KeyboardInterrupt`` raised
inside a library's import or start-up can come out as another error (a ``RecursionError``, a ``RuntimeError`` from
``__set_name__``; both seen) or be swallowed, and a start-up takes seconds, tens of seconds on a loaded machine.
During start-up the command checks ``requested`` where nothing is left half done (``raise_if_requested``), and
its waits (the DHT's start, a retry's pause) watch ``event``.
"""

from __future__ import annotations

import signal
import sys
import threading
from typing import Optional


class StopRequest:
    """SIGINT/SIGTERM handling: the first signal sets ``event`` and prints ``message`` (what the command will do
    now; it may change as the command goes on), a second one raises ``KeyboardInterrupt``."""

    def __init__(self, message: Optional[str] = None) -> None:
        self.event = threading.Event()
        self.signal_name: Optional[str] = None
        self.message = message

    def install(self) -> StopRequest:
        """Handle SIGINT and SIGTERM from now on (call it from the main thread)."""
        signal.signal(signal.SIGINT, self._handle)
        signal.signal(signal.SIGTERM, self._handle)
        return self

    def _handle(self, signum: int, frame: object) -> None:
        if self.event.is_set():
            raise KeyboardInterrupt
        self.signal_name = signal.Signals(signum).name
        self.event.set()
        if self.message:
            print(self.message, file=sys.stderr, flush=True)

    @property
    def requested(self) -> bool:
        return self.event.is_set()

    def wait(self, timeout: Optional[float] = None) -> bool:
        return self.event.wait(timeout)

    def raise_if_requested(self) -> None:
        """``KeyboardInterrupt`` if a stop was asked for: at a start-up step where nothing is left half done."""
        if self.event.is_set():
            raise KeyboardInterrupt
