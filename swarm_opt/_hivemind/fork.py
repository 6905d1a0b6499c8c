"""Forked helper processes: started without a copy-on-write twin of the training memory, ended with their parent.

hivemind's averager is an ``mp.Process`` started with ``fork`` after the user built the model: the child maps every
page of the parent, and each page the parent writes afterwards (parameters, gradients, optimizer state, our own
buffers) is duplicated so that the child keeps the old version, which it never reads. Measured on a 10M-parameter
MLP: 4.4-5.4x the parameter bytes held privately by the averager process after two rounds.

``without_tensor_memory()`` marks the pages that lie entirely inside large private CPU tensor storages
``MADV_DONTFORK`` for the duration of the fork, then restores them, so the child never maps them and the parent
writes them in place. The child must not read those tensors (hivemind's averager only touches its shared-memory
buffers, which are skipped). Only whole pages inside one storage are marked, so no other object loses memory in the
child. On systems without ``madvise`` this does nothing.

``share_heap()``: the Python objects the helpers inherit (torch's and hivemind's modules, the model's objects) stay
shared with them. A full collection of the garbage collector writes into every object it tracks, so one in any of
the processes (the trainer's, most often) made each of them hold its own copy of every page of that heap within
minutes. The objects alive at a helper's fork are therefore frozen (``gc.freeze()``, Python's own remedy: no
collector scans them) until the last helper has ended (``SharedHeap.ended``). A cycle among them that becomes
garbage meanwhile is collected only then; and ``gc.get_objects()`` does not list them meanwhile, so the tensors among
them are remembered here (weakly) for the next fork.

The forked helpers end with their parent through ``swarm_opt._libc.die_with_parent()``.

``children_ignore_sigint()``: a terminal's Ctrl-C reaches every process of the foreground group; helpers forked
inside ignore it from their first instruction (blocked across the fork, ignored in the child right after it), so
that only the user's process reacts and shuts them down in order. The caller's own handler is never touched:
ignoring SIGINT in the parent around the fork, as hivemind's ``run_in_background`` does, loses a Ctrl-C that arrives
meanwhile.

``forking_helper()`` is all of them: what the DHT and averager processes are forked inside.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import logging
import mmap
import os
import signal
import threading
import weakref
from typing import Dict, Iterator, List, Tuple

import torch

from swarm_opt._libc import libc_function

logger = logging.getLogger(__name__)

_MIN_BYTES = 1 << 20  # smaller storages are not worth a separate memory mapping each
_PAGE = mmap.PAGESIZE


_forking = threading.local()  # .ignore_sigint: whether this thread's forks should ignore SIGINT
_helpers: List[SharedHeap] = []  # the helpers alive that share this process's frozen objects
_frozen_tensors: Dict[int, weakref.ref[torch.Tensor]] = {}  # the tensors among the frozen objects, by id
_helpers_lock = threading.Lock()


def _after_fork_in_child() -> None:
    if getattr(_forking, "ignore_sigint", False):
        _forking.ignore_sigint = False  # the child's own forks decide for themselves
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # discards a SIGINT that arrived since the fork (blocked)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


os.register_at_fork(after_in_child=_after_fork_in_child)


@contextlib.contextmanager
def children_ignore_sigint() -> Iterator[None]:
    """Processes this thread forks inside ignore SIGINT from their start; this process keeps its own handler.

    SIGINT is blocked in this thread meanwhile, so that the child is born with it blocked: one that arrives before
    the child's after-fork hook ignores it (a Ctrl-C to the whole group, on a loaded machine) would otherwise run the
    handler the child inherited (seen: the trainer's KeyboardInterrupt in a starting DHT process). A program it
    executes keeps SIGINT blocked: torch's ``torch_shm_manager``, started by the process's first shared tensor, moves
    to a process group of its own, and a Ctrl-C to the group before it had left killed it half-way through its
    handshake, the caller waiting for its answer for ever (seen). This process still hears it: in another thread,
    or here once unblocked."""
    _forking.ignore_sigint = True
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        _forking.ignore_sigint = False
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


def _libc_madvise():
    madvise = libc_function("madvise") if hasattr(mmap, "MADV_DONTFORK") else None
    if madvise is None:
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


def _private_tensor_pages() -> List[Tuple[int, int]]:
    """(start, length) of the whole pages inside every large, private, CPU tensor storage of this process."""
    regions, seen = [], set()
    for obj in _tensors():
        if obj.device.type != "cpu" or obj.is_sparse:
            continue
        try:
            storage = obj.untyped_storage()
            start, size = storage.data_ptr(), storage.nbytes()
        except (RuntimeError, NotImplementedError):  # tensors without a plain storage (functional wrappers, or one
            continue  # FSDP2 freed: "invalid python storage")
        if size < _MIN_BYTES or start in seen or storage.is_shared():
            continue
        seen.add(start)
        first = -(-start // _PAGE) * _PAGE
        last = (start + size) // _PAGE * _PAGE
        if last > first:
            regions.append((first, last - first))
    return regions


def _tracked_tensors() -> List[torch.Tensor]:
    """The tensors among the objects the collector tracks and has not frozen."""
    # by type, not isinstance: it reads __class__, which some objects answer with a warning
    return [obj for obj in gc.get_objects() if issubclass(type(obj), torch.Tensor)]


def _tensors() -> Iterator[torch.Tensor]:
    frozen = [tensor() for tensor in _frozen_tensors.values()]
    for obj in _tracked_tensors() + [tensor for tensor in frozen if tensor is not None]:
        yield obj
        if obj.is_leaf and obj.requires_grad and obj.grad is not None:  # autograd's grads may have no
            yield obj.grad  # Python object of their own until accessed


@contextlib.contextmanager
def without_tensor_memory() -> Iterator[None]:
    """Processes forked inside this block do not inherit the pages of large private CPU tensors."""
    madvise = _libc_madvise()
    if madvise is None:
        yield
        return
    marked = []
    for start, length in _private_tensor_pages():
        if madvise(start, length, mmap.MADV_DONTFORK) == 0:
            marked.append((start, length))
    try:
        yield
    finally:
        for start, length in marked:  # later forks (DataLoader workers) must see these tensors again
            if madvise(start, length, mmap.MADV_DOFORK) != 0:
                logger.warning("Could not restore fork inheritance of a tensor (errno %d); processes forked "
                               "later may not read it", ctypes.get_errno())


class SharedHeap:
    """One forked helper's hold on this process's frozen objects (``share_heap``): ``ended()`` once the helper
    has ended; when no helper holds them any more, this process's collector scans every object again."""

    def ended(self) -> None:
        """Idempotent."""
        with _helpers_lock:
            if not any(held is self for held in _helpers):
                return
            _helpers[:] = [held for held in _helpers if held is not self]
            if not _helpers:
                gc.unfreeze()
                _frozen_tensors.clear()


@contextlib.contextmanager
def share_heap() -> Iterator[SharedHeap]:
    """Freeze this process's objects for a helper forked inside, until the ``SharedHeap`` it yields has ended."""
    held = SharedHeap()
    with _helpers_lock:
        _frozen_tensors.update((id(tensor), weakref.ref(tensor)) for tensor in _tracked_tensors())
        gc.freeze()
        _helpers.append(held)
    try:
        yield held
    except BaseException:
        held.ended()
        raise


@contextlib.contextmanager
def forking_helper() -> Iterator[SharedHeap]:
    """Fork a helper process (the DHT's or the averager's) inside: without the pages of large tensors, sharing the
    heap's objects, ignoring Ctrl-C. The ``SharedHeap`` it yields must be told when the helper has ended."""
    with without_tensor_memory(), share_heap() as held, children_ignore_sigint():
        yield held
