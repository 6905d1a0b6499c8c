"""Event loops that keep every task they run until it ends, in hivemind's DHT and averager processes.

asyncio holds a task only weakly: a task is kept alive by whatever it waits on. hivemind creates tasks it keeps no
reference to (each averaging step's task; the search of a step that was cancelled, whose clean-up then withdraws the
peer's matchmaking declaration), and its DHT calls return ``MPFuture``s, which hivemind registers weakly too. A task
whose only pending await is such a call is garbage: the next collection closes it mid-way (``GeneratorExit``, hidden
as "Task was destroyed but it is pending!"). A search closed that way left hivemind's matchmaking half reset: the peer
searched every later round and met nobody (``docs/hivemind.md``)."""

from __future__ import annotations

import asyncio
from types import ModuleType
from typing import Any, Callable, Coroutine, Set


def hold_every_task(loop: asyncio.AbstractEventLoop) -> None:
    """Make ``loop`` keep a reference to every task it creates from now on, until each ends. Idempotent."""
    if getattr(loop, "_swarm_opt_held", None) is not None:
        return
    held: Set[asyncio.Future] = set()
    make_task = loop.get_task_factory()

    def factory(loop: asyncio.AbstractEventLoop, coro: Coroutine, **kwargs: Any) -> asyncio.Future:
        task = make_task(loop, coro, **kwargs) if make_task is not None else asyncio.Task(coro, loop=loop, **kwargs)
        held.add(task)
        task.add_done_callback(held.discard)
        return task

    loop.set_task_factory(factory)
    loop._swarm_opt_held = held  # type: ignore[attr-defined]


def hold_tasks_of_loops_made_by(module: ModuleType) -> None:
    """In this process: the event loop that ``module`` (hivemind's DHT or averager) makes through its
    ``switch_to_uvloop`` holds every task it runs (``hold_every_task``). Call before the module makes its loop."""
    make_loop: Callable[[], asyncio.AbstractEventLoop] = module.switch_to_uvloop
    if getattr(make_loop, "_swarm_opt_holds", False):
        return

    def switch_to_uvloop() -> asyncio.AbstractEventLoop:
        loop = make_loop()
        hold_every_task(loop)
        return loop

    switch_to_uvloop._swarm_opt_holds = True  # type: ignore[attr-defined]
    module.switch_to_uvloop = switch_to_uvloop

