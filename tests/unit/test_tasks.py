"""Event loops that keep their tasks (``swarm_opt._hivemind.tasks``): a task whose only pending await is a DHT call
survives a garbage collection, where asyncio alone lets it be closed mid-way."""

from __future__ import annotations

import asyncio
import gc
import types

import hivemind
import pytest

from swarm_opt._hivemind.tasks import hold_every_task, hold_tasks_of_loops_made_by


@pytest.fixture(scope="module")
def dht():
    node = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    yield node
    node.shutdown()


async def _slow_call(dht, node) -> str:  # runs in the DHT process: a call that takes half a second
    await asyncio.sleep(0.5)
    return "answered"


def _dropped_task_outcome(dht, hold: bool) -> list:
    """Start a task that calls the DHT process, keep no reference to it, collect garbage while it waits for the
    answer; what became of it."""
    outcome: list = []

    async def call() -> None:
        try:
            outcome.append(await dht.run_coroutine(_slow_call, return_future=True))
        except BaseException as e:  # GeneratorExit: closed by the collector
            outcome.append(type(e).__name__)
            raise

    async def main() -> None:
        if hold:
            hold_every_task(asyncio.get_running_loop())
        asyncio.ensure_future(call())
        await asyncio.sleep(0.1)  # the task now waits on the DHT call alone
        gc.collect()
        for _ in range(100):
            if outcome:
                return
            await asyncio.sleep(0.05)

    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(main())
    finally:
        loop.close()
    return outcome


def test_a_held_task_that_waits_on_a_dht_call_alone_survives_garbage_collection(dht, caplog):
    assert _dropped_task_outcome(dht, hold=True) == ["answered"]
    # the hazard held against: without the holding, asyncio lets the collector close that task mid-way
    with caplog.at_level("CRITICAL", logger="asyncio"):  # ("Task was destroyed but it is pending!")
        assert _dropped_task_outcome(dht, hold=False) == ["GeneratorExit"]


def test_loops_made_by_a_module_hold_their_tasks_and_the_patch_is_applied_once():
    module = types.SimpleNamespace(switch_to_uvloop=asyncio.new_event_loop)
    hold_tasks_of_loops_made_by(module)
    patched = module.switch_to_uvloop
    hold_tasks_of_loops_made_by(module)
    assert module.switch_to_uvloop is patched
    loop = module.switch_to_uvloop()
    try:
        task = loop.create_task(asyncio.sleep(0))
        assert task in loop._swarm_opt_held
        loop.run_until_complete(task)
        assert task not in loop._swarm_opt_held  # released once it ended
    finally:
        loop.close()
