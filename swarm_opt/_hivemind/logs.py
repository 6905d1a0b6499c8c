"""Keep hivemind's internal chatter out of the user's console.

hivemind logs routine events (retries, failed donors, shutdown races) at WARNING/ERROR with tracebacks. swarm_opt
reports what matters itself, in one line, so hivemind's records are re-emitted at DEBUG under ``swarm_opt.hivemind``:
``logging.getLogger("swarm_opt.hivemind").setLevel(logging.DEBUG)`` plus a handler shows them when debugging.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.util
import logging
import multiprocessing
import sys
import warnings
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Any, Optional

#: what asyncio reports of hivemind's own tasks: abandoned at shutdown, and p2pd's stream handlers whose remote end
#: died mid-stream (a SIGKILLed peer: uvloop then reports "cannot reuse already awaited coroutine", dozens an hour
#: under churn)
_ASYNCIO_NOISE = ("Task was destroyed but it is pending", "aclose(): asynchronous generator",
                  "Task exception was never retrieved", "Future exception was never retrieved",
                  "Exception in callback", "Unhandled exception in client_connected_cb")


class _Downgrade(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        target = logging.getLogger("swarm_opt.hivemind." + record.name.removeprefix("hivemind."))
        if target.isEnabledFor(logging.DEBUG):
            record.levelno, record.levelname, record.name = logging.DEBUG, "DEBUG", target.name
            target.handle(record)


class _DropHivemindAsyncioNoise(logging.Filter):
    """asyncio reports tasks that hivemind abandons (at shutdown, or fire-and-forget DHT stores that time out) and
    its stream handlers that fail when the other peer dies (``_ASYNCIO_NOISE``); they are not the user's.
    Recognised by the traceback naming hivemind, or by being logged inside one of hivemind's own processes (the DHT
    and averager processes are ``multiprocessing.Process`` subclasses from hivemind)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = str(record.msg)
        if not message.startswith(_ASYNCIO_NOISE):
            return True
        text = _full_text(record)
        if not (_in_hivemind_process() or "hivemind" in text):
            return True
        logging.getLogger("swarm_opt.hivemind.asyncio").debug("%s", text)  # for whoever debugs hivemind's tasks
        return False


def _in_hivemind_process() -> bool:
    process_type = type(multiprocessing.current_process())
    return any(cls.__module__.startswith(("hivemind.", "swarm_opt.")) for cls in process_type.__mro__)


def _full_text(record: logging.LogRecord) -> str:
    """The message with its traceback: asyncio names the abandoned task's code only in the traceback."""
    try:
        text = record.getMessage()
        if record.exc_info:
            text += logging.Formatter().formatException(record.exc_info)
        return text
    except Exception:  # a broken record must not break logging
        return ""


def tame_hivemind_logging() -> None:
    """Route hivemind's loggers through ``_Downgrade``. Idempotent; inherited by hivemind's forked processes."""
    from hivemind.utils.logging import use_hivemind_log_handler

    use_hivemind_log_handler("nowhere")
    hivemind_logger = logging.getLogger("hivemind")
    if not any(isinstance(h, _Downgrade) for h in hivemind_logger.handlers):
        hivemind_logger.addHandler(_Downgrade())
    hivemind_logger.propagate = False
    # the DHT process closes its event loop with lookups still pending when it is shut down mid-request; Python then
    # warns (to stderr, not through logging) that their coroutines were never awaited. Inherited by forked processes.
    warnings.filterwarnings("ignore", message=r"coroutine .* was never awaited", category=RuntimeWarning,
                            module=r"hivemind\.")
    asyncio_logger = logging.getLogger("asyncio")
    if not any(isinstance(f, _DropHivemindAsyncioNoise) for f in asyncio_logger.filters):
        asyncio_logger.addFilter(_DropHivemindAsyncioNoise())


class _TameOnImport(importlib.abc.MetaPathFinder):
    """Tames hivemind's logging right after hivemind is first imported, by whoever imports it: ``import swarm_opt``
    stays cheap (no hivemind, no torch), yet a DHT that the user starts before touching any swarm_opt class forks
    with hivemind's chatter already routed (its process inherits the handlers). One shot: it leaves sys.meta_path
    as soon as it has seen the import."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Optional[ModuleSpec]:
        if fullname != "hivemind":
            return None
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)  # the finders that would have found it without us
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        load = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            load(module)
            tame_hivemind_logging()

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]  # this spec's loader instance only
        return spec


def tame_hivemind_logging_when_imported() -> None:
    """``tame_hivemind_logging()`` now if hivemind is imported already, otherwise as soon as it is."""
    if "hivemind" in sys.modules:
        tame_hivemind_logging()
    elif not any(isinstance(finder, _TameOnImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _TameOnImport())
