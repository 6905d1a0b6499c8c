"""A process's memory as Linux accounts it (``/proc/PID/smaps_rollup``, ``/proc/PID/smaps``), read in one place for
the test harness (``swarm_opt.testing``), the averager's memory trace (``swarm_opt._hivemind.memtrace``) and the
memory benchmarks. Imports nothing heavy.
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict, Union


def memory_rollup(pid: Union[int, str] = "self") -> Dict[str, int]:
    """Every field of ``/proc/PID/smaps_rollup`` in bytes (``Pss``, ``Rss``, ``Pss_Anon``, ...), plus ``USS`` (its
    private pages) and ``anon`` (anonymous and shared-memory PSS: what the process adds beyond shared library files,
    whose PSS depends on who else maps them). Raises ``OSError`` if the process is gone."""
    found: Dict[str, int] = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        key, value = line.split(":", 1)
        found[key.strip()] = int(value.split()[0]) * 1024
    found["USS"] = found.get("Private_Clean", 0) + found.get("Private_Dirty", 0)
    found["anon"] = found.get("Pss_Anon", 0) + found.get("Pss_Shmem", 0)
    return found


def mappings(least: int = 1 << 20, pid: Union[int, str] = "self") -> Dict[str, int]:
    """The process's mappings holding at least ``least`` bytes: ``"start size name"`` -> Rss bytes, anonymous ones
    named ``anon``. Two samples' difference shows which mapping grew: glibc's main heap, a thread arena (64 MiB
    reservations), a block mapped on its own, a thread's stack. Empty if the process is gone."""
    found: Dict[str, int] = {}
    try:
        lines = Path(f"/proc/{pid}/smaps").read_text().splitlines()
    except OSError:
        return found
    head = None
    for line in lines:
        fields = line.split()
        if fields and "-" in fields[0] and not fields[0].endswith(":"):
            start, end = (int(x, 16) for x in fields[0].split("-"))
            name = fields[5] if len(fields) > 5 else "anon"
            head = f"{start:x} {(end - start) >> 10}k {name}"
        elif head is not None and fields and fields[0] == "Rss:":
            rss = int(fields[1]) * 1024
            if rss >= least:
                found[head] = rss
    return found
