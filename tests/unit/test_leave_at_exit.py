"""An ``Optimizer`` that a script never shut down leaves the swarm at the interpreter's exit
(``swarm_opt.optimizer._LeaveAtExit``); one already shut down, one collected, or a forked child's copy does not.
The swarm-level effect (the partner goes on at once) is in ``tests/swarm/test_faults.py``."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import gc, os, sys
from swarm_opt.optimizer import _LeaveAtExit

class Peer:
    def __init__(self, name):
        self.name = name
    def shutdown(self):
        print("shutdown", self.name, os.getpid() == parent, flush=True)

parent = os.getpid()
kept, cancelled, collected = Peer("kept"), Peer("cancelled"), Peer("collected")
hooks = [_LeaveAtExit(p) for p in (kept, cancelled, collected)]
hooks[1].cancel()  # what Optimizer.shutdown does
del collected
gc.collect()
child = os.fork()
if child == 0:  # a forked child that ends normally must not leave on its parent's behalf
    sys.exit(0)
os.waitpid(child, 0)
print("end", flush=True)
"""


def test_only_a_live_optimizer_not_shut_down_leaves_at_exit_and_only_in_its_own_process():
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["end", "shutdown kept True"], done.stdout
    assert done.stderr == "", done.stderr
