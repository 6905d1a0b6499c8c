"""What the DHT process does with what it inherited from the trainer (``swarm_opt._hivemind.dht_process``)."""

from __future__ import annotations

import multiprocessing as mp
import warnings

import torch
import torch.distributed  # noqa: F401  (its deprecated ``reduce_op`` warns when asked its class: the walk must not)

from swarm_opt._hivemind.dht_process import drop_inherited_tensors


def _child(queue, big, view, shared, from_numpy) -> None:
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        freed = drop_inherited_tensors()
    queue.put(([str(w.message) for w in said], freed, big.untyped_storage().nbytes(), view.untyped_storage().nbytes(),
               shared.untyped_storage().nbytes(), from_numpy.untyped_storage().nbytes()))


def test_a_forked_process_frees_the_tensors_it_inherited_and_the_trainer_keeps_them():
    big = torch.ones(4_000_000)  # a model's parameters: 16 MB
    view = big[10:20]  # the same storage: freed once
    shared = torch.ones(1000).share_memory_()  # an averaging buffer, shared with another process: left alone
    from_numpy = torch.from_numpy(torch.ones(100).numpy().copy())  # not resizable: left alone
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_child, args=(queue, big, view, shared, from_numpy))
    child.start()
    said, freed, big_left, view_left, shared_left, numpy_left = queue.get(timeout=60)
    child.join(30)
    assert not said  # a DHT process prints nothing of it
    assert freed >= big.numel() * 4 and big_left == view_left == 0
    assert shared_left == 4000 and numpy_left == 400
    assert float(big.sum()) == 4_000_000 and float(shared.sum()) == 1000  # the parent's own, untouched
