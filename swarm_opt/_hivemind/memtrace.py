"""Where an averager process's memory goes, for soaks: on only when ``SWARM_OPT_TRACEMALLOC=PATH`` is set.

A diagnostic, not a feature: ``benchmarks/soak.py --tracemalloc`` sets it for the stable peers. The averager process
then traces its Python allocations (``tracemalloc``, a few frames each) and, every ``SWARM_OPT_TRACEMALLOC_PERIOD``
seconds (60), appends one JSON line to ``PATH.PID.jsonl``: its PSS and RSS, its mappings of 1 MiB or more (which
one grows: glibc's main heap, a thread's arena, a block mapped on its own), what tracemalloc traces, the blocks
Python's small-object allocator holds (``sys.getallocatedblocks``: its 1-MiB arenas are anonymous mappings), the torch
tensors alive and the bytes of their storages (torch allocates them outside tracemalloc's sight), glibc's heap
(``mallinfo2``: in use and free, so that native growth and fragmentation show as PSS minus traced), counts of the
structures that could grow with rounds or peer ids (asyncio tasks of the averager's loop by coroutine, hivemind's
registered groups, its p2p control client's pending calls and handler tasks, futures), the object types whose count
grew most, and the source lines whose allocations grew most since the baseline (the first sample after
``SWARM_OPT_TRACEMALLOC_WARMUP`` seconds, 120); and to ``PATH.PID.errors`` the tracebacks of what the averager's
event loop reports as unhandled (asyncio logs them without). ``SWARM_OPT_MALLOC_TRIM=1`` calls glibc's
``malloc_trim(0)`` after each sample: an experiment that shows how much of a growth is free memory glibc keeps.
``SWARM_OPT_MEMRAY_SECONDS``: native allocations too, for a while (``Tracer._capture_native``). Each sample counts
the loop's tasks by where they wait (``_awaiting``): a task that never ends shows where it hangs.
"""

from __future__ import annotations

import asyncio
import collections
import gc
import json
import logging
import math
import os
import sys
import threading
import time
import traceback
import tracemalloc
from pathlib import Path
from typing import Any, Callable, Dict, Optional

from swarm_opt._libc import glibc_heap, malloc_trim
from swarm_opt._procfs import mappings, memory_rollup

logger = logging.getLogger(__name__)

VARIABLE = "SWARM_OPT_TRACEMALLOC"
_MEMRAY = "SWARM_OPT_MEMRAY_SECONDS"
_FRAMES = 4  # frames kept per traced allocation: enough to see who called a generic helper, cheap enough for hours
_TOP = 30  # lines (and object types) reported per sample


def _own_memory() -> Dict[str, int]:
    try:
        rollup = memory_rollup()
    except OSError:
        return {}
    return {key.lower(): rollup[key] for key in ("Pss", "Rss", "Pss_Anon") if key in rollup}


def _size(value: Any) -> Optional[int]:
    try:
        return len(value)
    except TypeError:
        return None


def _tensor_bytes(objects: Any) -> Dict[str, int]:
    """How many torch tensors are alive and the bytes of their distinct storages (torch allocates them outside
    tracemalloc's sight); none where torch was never imported."""
    torch = sys.modules.get("torch")
    if torch is None:
        return {"count": 0, "bytes": 0}
    storages: Dict[int, int] = {}
    count = 0
    for o in objects:
        if issubclass(type(o), torch.Tensor):  # type(): some torch objects warn when asked their __class__
            count += 1
            try:
                storage = o.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
            except (RuntimeError, NotImplementedError):  # sparse, meta...
                continue
    return {"count": count, "bytes": sum(storages.values())}


def _awaiting(coro: Any) -> str:
    """Where a task waits: its coroutine and each one it awaits in turn, ``name:line``, outermost first (a task that
    never ends shows where it hangs)."""
    chain = []
    while coro is not None and len(chain) < 8:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "ag_frame", None) or getattr(coro, "gi_frame", None)
        name = getattr(coro, "__qualname__", type(coro).__name__)
        chain.append(f"{name}:{frame.f_lineno}" if frame is not None else name)
        coro = getattr(coro, "cr_await", None) or getattr(coro, "ag_await", None) or getattr(coro, "gi_yieldfrom",
                                                                                               None)
    return " > ".join(chain)


class Tracer:
    """The sampling thread of one averager process. ``counters`` name callables that return a structure of the
    engine (its ``len`` is recorded) or a count; ``loop`` (set once the averager's event loop runs) lets it count
    that loop's tasks."""

    def __init__(self, path: Path, counters: Dict[str, Callable[[], Any]], period: float, warmup: float,
                 trim: bool) -> None:
        self.path, self.counters, self.period, self.warmup, self.trim = path, counters, period, warmup, trim
        self.loop: Optional[asyncio.AbstractEventLoop] = None
        self._baseline: Optional[tracemalloc.Snapshot] = None
        self._types: Dict[str, int] = {}
        self._t0 = time.monotonic()
        self._native_seconds = float(os.environ.get(_MEMRAY) or 0)  # a native capture still to make, that long
        self._native: Optional[Any] = None  # the memray tracker while it records
        self._native_until = math.inf

    def watch_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        """Count ``loop``'s tasks from now on, and keep the tracebacks of the errors it reports to its exception
        handler (``PATH.PID.errors``): asyncio logs them without one."""
        if self.loop is loop:
            return
        self.loop = loop
        errors = self.path.with_suffix(".errors")

        def handler(loop: asyncio.AbstractEventLoop, context: Dict[str, Any]) -> None:
            error = context.get("exception")
            with open(errors, "a") as out:
                out.write(f"--- {time.monotonic() - self._t0:.1f} s: {context.get('message')}\n")
                if error is not None:
                    out.write("".join(traceback.format_exception(error)))
            loop.default_exception_handler(context)

        loop.set_exception_handler(handler)

    def start(self) -> None:
        tracemalloc.start(_FRAMES)
        threading.Thread(target=self._run, name="swarm_opt-memtrace", daemon=True).start()

    def _run(self) -> None:
        while True:
            time.sleep(self.period)
            try:  # a diagnostic must never take the averager down, nor stop at its first error
                self._capture_native()
                line = json.dumps(self.sample(), default=str)
            except Exception as e:
                line = json.dumps({"t": round(time.monotonic() - self._t0, 1), "error": repr(e)})
            with open(self.path, "a") as out:
                out.write(line + "\n")

    def _capture_native(self) -> None:
        """``SWARM_OPT_MEMRAY_SECONDS``: after the warm-up, record native allocations for that many seconds
        (``memray``, installed apart: ``pip install memray``) into ``PATH.PID.memray``, aggregated by place so that
        an hour's capture stays small; what was never freed, with its C and Python stacks:
        ``memray.FileReader(...).get_leaked_allocation_records()``."""
        age = time.monotonic() - self._t0
        if self._native_seconds and age >= self.warmup:
            seconds, self._native_seconds = self._native_seconds, 0.0
            try:
                import memray
            except ImportError:
                logger.warning(f"{_MEMRAY} is set but memray is not installed (pip install memray): not capturing")
                return
            self._native = memray.Tracker(str(self.path.with_suffix(".memray")), native_traces=True,
                                         file_format=memray.FileFormat.AGGREGATED_ALLOCATIONS)
            self._native.__enter__()
            self._native_until = age + seconds
        elif self._native is not None and age >= self._native_until:
            self._native.__exit__(None, None, None)
            self._native = None

    def _tasks(self) -> Dict[str, int]:
        loop = self.loop
        if loop is None or loop.is_closed():
            return {}

        async def count() -> Dict[str, int]:
            names = collections.Counter(_awaiting(task.get_coro()) for task in asyncio.all_tasks())
            return dict(names.most_common(_TOP))

        return asyncio.run_coroutine_threadsafe(count(), loop).result(timeout=30)

    def sample(self) -> Dict[str, Any]:
        age = time.monotonic() - self._t0
        snapshot = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(False, tracemalloc.__file__)])
        traced, peak = tracemalloc.get_traced_memory()
        counts: Dict[str, Any] = {}
        for name, read in self.counters.items():
            try:
                value = read()
                counts[name] = value if isinstance(value, int) else _size(value)
            except Exception as e:  # a structure not there (yet)
                counts[name] = repr(e)[:80]
        tasks = self._tasks()
        objects = gc.get_objects()
        types = collections.Counter(type(o).__qualname__ for o in objects)
        tensors = _tensor_bytes(objects)
        del objects
        grown = sorted(((n - self._types.get(t, 0), t, n) for t, n in types.items()), reverse=True)[:_TOP]
        if not self._types or self._baseline is None:
            self._types = dict(types)
        record: Dict[str, Any] = {
            "t": round(age, 1), "memory": _own_memory(), "mappings": mappings(), "traced": traced,
            "traced_peak": peak, "pymalloc_blocks": sys.getallocatedblocks(),
            "heap": glibc_heap(), "tensors": tensors, "counts": counts, "tasks_total": sum(tasks.values()),
            "tasks": tasks,
            "types_grown": [[t, d, n] for d, t, n in grown if d > 0]}
        if self._baseline is None and age >= self.warmup:
            self._baseline, self._types = snapshot, dict(types)
        if self._baseline is not None:
            diff = snapshot.compare_to(self._baseline, "traceback")
            record["top"] = [{"kb": round(s.size_diff / 1024, 1), "count": s.count_diff,
                              "where": [f"{f.filename.split('site-packages/')[-1]}:{f.lineno}"
                                        for f in s.traceback][::-1]}
                             for s in diff[:_TOP]]
        if self.trim:
            record["trimmed"] = malloc_trim()
        return record


def start_if_asked(counters: Dict[str, Callable[[], Any]]) -> Optional[Tracer]:
    """In the averager process: start a ``Tracer`` if ``SWARM_OPT_TRACEMALLOC`` names a path, else nothing."""
    path = os.environ.get(VARIABLE)
    if not path:
        return None
    tracer = Tracer(Path(f"{path}.{os.getpid()}.jsonl"), counters,
                    period=float(os.environ.get(f"{VARIABLE}_PERIOD", "60")),
                    warmup=float(os.environ.get(f"{VARIABLE}_WARMUP", "120")),
                    trim=os.environ.get("SWARM_OPT_MALLOC_TRIM") == "1")
    tracer.start()
    logger.debug("Tracing this averager's memory into %s", tracer.path)
    return tracer
