"""The few C library calls swarm_opt makes (Linux, glibc), each a no-op answering False or {} elsewhere.

``die_with_parent()`` (``PR_SET_PDEATHSIG``): a helper process whose parent was SIGKILLed would otherwise live on, an
orphan holding its ports and buffers. ``glibc_heap()``, ``malloc_trim()`` and ``map_blocks_from()``: what glibc holds
of a process's heap, giving its free part back, and keeping large blocks out of it (the averager process, whose
buffers of a round would otherwise fragment its heap; ``swarm_opt._hivemind.memtrace`` for diagnostics). Imports
nothing heavy: the test harness (``swarm_opt.testing``) uses it.
"""

from __future__ import annotations

import ctypes
import os
import sys
from typing import Any, Dict, Optional

_PR_SET_PDEATHSIG = 1
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


def libc_function(name: str) -> Optional[Any]:
    """The C library's function ``name`` (errno kept), or None off Linux or where it is missing."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):
        return None


def die_with_parent(signum: int, parent_pid: int) -> bool:
    """In a forked child: have the kernel send ``signum`` when the parent's thread that forked it ends (the main
    thread: the parent process). Raised at once if the parent is already gone. False where unsupported."""
    prctl = libc_function("prctl")
    if prctl is None:
        return False
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    if prctl(_PR_SET_PDEATHSIG, signum, 0, 0, 0) != 0:
        return False
    if os.getppid() != parent_pid:
        os.kill(os.getpid(), signum)
    return True


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def glibc_heap() -> Dict[str, int]:
    """glibc's heap of this process in bytes (``mallinfo2``): ``in_use`` (allocated blocks, mmapped ones included),
    ``free`` (held by glibc, unused), ``mmapped``, ``arena`` (all of the main and thread arenas); {} off glibc."""
    mallinfo2 = libc_function("mallinfo2")
    if mallinfo2 is None:
        return {}
    mallinfo2.restype = _MallInfo2
    info = mallinfo2()
    return {"in_use": info.uordblks + info.hblkhd, "free": info.fordblks, "mmapped": info.hblkhd,
            "arena": info.arena}


def malloc_trim() -> bool:
    """Give glibc's free heap memory back to the system (``malloc_trim(0)``); False off glibc."""
    trim = libc_function("malloc_trim")
    if trim is None:
        return False
    trim.argtypes = [ctypes.c_size_t]
    trim(0)
    return True


def map_blocks_from(size: int) -> bool:
    """Serve every block of ``size`` bytes or more from a mapping of its own, given back to the system when freed
    (glibc's ``M_MMAP_THRESHOLD``, set once: it stays fixed). Left alone, glibc raises that threshold to the largest
    block freed so far (up to 32 MiB) and serves later blocks of that size from its heaps, whose freed holes a
    process keeps: a process that handles many short-lived buffers of a few hundred kB grows with them. False off
    glibc."""
    mallopt = libc_function("mallopt")
    if mallopt is None:
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return mallopt(_M_MMAP_THRESHOLD, int(size)) == 1
