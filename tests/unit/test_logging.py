"""hivemind's chatter is kept out of the user's console; the user's own asyncio errors are not."""

from __future__ import annotations

import gc
import logging
import multiprocessing
import warnings

from hivemind.averaging import DecentralizedAverager

import swarm_opt  # importing tames hivemind's logging


def _asyncio_record(message: str) -> logging.LogRecord:
    return logging.LogRecord("asyncio", logging.ERROR, __file__, 1, message, None, None)


def test_hivemind_warnings_become_debug_records_of_swarm_opt(caplog):
    with caplog.at_level(logging.DEBUG, logger="swarm_opt.hivemind"):
        logging.getLogger("hivemind.averaging.averager").warning("could not find a group")
    records = [r for r in caplog.records if "could not find a group" in r.getMessage()]
    assert records and all(r.levelno == logging.DEBUG for r in records)
    assert {r.name for r in records} == {"swarm_opt.hivemind.averaging.averager"}


def test_asyncio_noise_is_dropped_only_inside_hivemind_processes(monkeypatch):
    asyncio_logger = logging.getLogger("asyncio")
    noise = "Task was destroyed but it is pending!\ntask: <Task pending coro=<wait_for()>>"
    assert asyncio_logger.filter(_asyncio_record(noise))  # the user's own process: shown
    assert asyncio_logger.filter(_asyncio_record("some other asyncio error"))
    # stands for hivemind's averager process (a multiprocessing.Process subclass defined in hivemind)
    averager_process = type("Averager", (), {"__module__": DecentralizedAverager.__module__})()
    monkeypatch.setattr(multiprocessing, "current_process", lambda: averager_process)
    assert not asyncio_logger.filter(_asyncio_record(noise))  # inside hivemind's averager: hivemind's, dropped
    # p2pd's stream handler when a SIGKILLed peer's stream breaks (uvloop's wording, seen under churn in the soak)
    assert not asyncio_logger.filter(_asyncio_record("Unhandled exception in client_connected_cb\n"
                                                     "transport: <UnixTransport closed=True reading=False>"))
    assert asyncio_logger.filter(_asyncio_record("some other asyncio error"))


def _drop_unawaited_coroutine(module: str) -> list:
    """Create and drop a coroutine object in a frame of ``module``; return the warnings it raised."""
    namespace = {"__name__": module}
    exec("async def traverse_dht():\n    pass\n\ndef drop():\n    coroutine = traverse_dht()\n    del coroutine\n",
         namespace)
    with warnings.catch_warnings(record=True) as caught:
        swarm_opt.tame_hivemind_logging()  # pytest resets warning filters around collection, where we were imported
        namespace["drop"]()
        gc.collect()
    return [w for w in caught if "was never awaited" in str(w.message)]


def test_coroutines_hivemind_abandons_at_shutdown_are_not_reported_but_the_users_are():
    assert _drop_unawaited_coroutine("hivemind.dht.dht") == []
    assert len(_drop_unawaited_coroutine("my_training_script")) == 1


def test_hivemind_imported_after_swarm_opt_is_tamed_too():
    """``import swarm_opt`` does not import hivemind; hivemind's logging is tamed whenever it is imported later,
    so that a DHT started before any swarm_opt class is used forks quiet."""
    import subprocess
    import sys

    code = ("import sys, logging, swarm_opt\n"
            "assert 'hivemind' not in sys.modules and 'torch' not in sys.modules\n"
            "import hivemind\n"
            "handlers = logging.getLogger('hivemind').handlers\n"
            "print(sorted(type(h).__name__ for h in handlers), logging.getLogger('hivemind').propagate)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=90)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "['_Downgrade'] False\n", result.stdout
