"""What a forked helper (the DHT's or the averager's process) inherits from the trainer (``swarm_opt._hivemind.fork``):
not the pages of large tensors, and the Python heap shared for as long as it lives.

Each case runs in a fresh interpreter: freezing the heap is process-wide."""

from __future__ import annotations

import json
import subprocess
import sys

from swarm_opt import testing

PROBE = """
import contextlib, gc, json, multiprocessing as mp, sys
import torch
from swarm_opt._hivemind.fork import forking_helper
from swarm_opt._procfs import memory_rollup

def mapped(start, size):  # whether any whole page of [start, start + size) is mapped in this process
    first, last = -(-start // 4096) * 4096, (start + size) // 4096 * 4096
    for line in open("/proc/self/maps"):
        low, high = (int(x, 16) for x in line.split()[0].split("-"))
        if low < last and high > first:
            return True
    return False

def helper(conn, regions):
    conn.send([mapped(*region) for region in regions])
    conn.recv()  # the trainer has collected its garbage
    conn.send(memory_rollup()["USS"])
    conn.recv()

def fork(tensors):
    regions = [(t.data_ptr(), t.untyped_storage().nbytes()) for t in tensors]
    ours, theirs = mp.Pipe()
    process = mp.get_context("fork").Process(target=helper, args=(theirs, regions), daemon=True)
    with (forking_helper() if sys.argv[1] == "helper" else contextlib.nullcontext()) as heap:
        process.start()
    return process, ours, ours.recv(), heap

objects = [[i, str(i)] for i in range(300_000)]  # what a trainer holds: modules, a model's objects
before = torch.ones(4_000_000)  # a model's parameters, 16 MB
first = fork([before])
for _ in range(3):
    gc.collect()  # the trainer's full collections write into every object they scan
first[1].send("collected")
uss = first[1].recv()
after = torch.ones(4_000_000)  # built after the first helper, whose fork froze ``before``
second = fork([before, after])
second[1].send("collected")
second[1].recv()
frozen = []
for process, conn, _, heap in (first, second):
    conn.send("end")
    process.join(10)
    frozen.append(gc.get_freeze_count())
    if heap is not None:
        heap.ended()
        heap.ended()  # idempotent
        frozen.append(gc.get_freeze_count())
print(json.dumps({"mapped": first[2] + second[2], "uss": uss, "frozen": frozen}))
"""


def _probe(mode: str) -> dict:
    done = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=120,
                          env=testing.peer_env())
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_helper_maps_no_large_tensor_and_keeps_sharing_the_heap_through_the_trainers_collections():
    plain, helper = _probe("plain"), _probe("helper")
    assert plain["mapped"] == [True, True, True]  # a plain fork maps every tensor: the control
    assert helper["mapped"] == [False, False, False]  # also a tensor frozen at the first helper's fork
    # the trainer's full collections copied the heap's pages into a plainly forked child, not into a helper
    assert plain["uss"] > 4 * helper["uss"], (plain["uss"], helper["uss"])
    # frozen while a helper lives, scanned again once the last one has ended
    assert plain["frozen"] == [0, 0]
    assert helper["frozen"][:3] == [helper["frozen"][0]] * 3 and helper["frozen"][0] > 300_000
    assert helper["frozen"][3] == 0
