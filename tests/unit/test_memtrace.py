"""``SWARM_OPT_TRACEMALLOC``: an averager process's memory, sampled into a file (``swarm_opt._hivemind.memtrace``).

Runs the tracer in a fresh interpreter (it starts ``tracemalloc`` for the whole process) with a loop standing in
for the averager's, and reads back what a soak's ``--analyse`` reads."""

from __future__ import annotations

import json
import subprocess
import sys

from swarm_opt import testing

TRACED = """
import asyncio, threading, time
from swarm_opt._hivemind import memtrace
kept = []
tracer = memtrace.start_if_asked({"kept": lambda: kept, "broken": lambda: 1 / 0})
loop = asyncio.new_event_loop()
threading.Thread(target=loop.run_forever, daemon=True).start()
tracer.watch_loop(loop)
async def waits():
    await asyncio.sleep(60)
async def fails():
    raise ValueError("nobody awaits this task")
for _ in range(3):
    asyncio.run_coroutine_threadsafe(waits(), loop)
loop.call_soon_threadsafe(lambda: loop.create_task(fails()) and None)
def samples():
    return len(tracer.path.read_text().splitlines()) if tracer.path.exists() else 0
def wait_for(count):
    deadline = time.monotonic() + 90  # a sample takes a while on a loaded machine
    while time.monotonic() < deadline and samples() < count:
        time.sleep(0.05)
wait_for(1)  # the baseline
for _ in range(40):
    kept.append(bytearray(100_000))  # grows after the baseline: the top line
wait_for(samples() + 2)
"""


def test_the_tracer_records_memory_counts_tasks_growing_lines_and_unhandled_errors(tmp_path):
    env = testing.peer_env(SWARM_OPT_TRACEMALLOC=str(tmp_path / "trace"), SWARM_OPT_TRACEMALLOC_PERIOD="0.4",
                           SWARM_OPT_TRACEMALLOC_WARMUP="0")
    done = subprocess.run([sys.executable, "-c", TRACED], env=env, capture_output=True, text=True, timeout=150)
    assert done.returncode == 0, done.stderr
    [path] = tmp_path.glob("trace.*.jsonl")
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) >= 3 and not any("error" in row for row in rows), rows
    last = rows[-1]
    assert last["memory"]["pss"] > 0 and last["traced"] > 3_000_000
    assert last["counts"]["kept"] == 40 and last["counts"]["broken"].startswith("ZeroDivisionError")
    # counted by where they wait: the coroutine, and what it awaits in turn
    assert sum(n for where, n in last["tasks"].items() if where.startswith("waits:10 > sleep:")) == 3, last["tasks"]
    assert any("<string>" in " ".join(line["where"]) and line["kb"] > 1000 for line in last["top"]), last["top"][:3]
    errors = next(tmp_path.glob("trace.*.errors")).read_text()
    assert "nobody awaits this task" in errors
