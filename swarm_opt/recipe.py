"""Training recipes: what the peers of a run must train alike, declared once, and its fingerprint.

A ``Recipe`` holds the model, its loss, the training data (a map-style dataset, or a streaming source that each peer
shards by itself), the optimizer factory with its parameter groups, the learning-rate schedule over global epochs,
gradient clipping, precision, batch collation, evaluation, and defaults for the strategy and batch sizes. A task of
``swarm-opt train`` may return one instead of ``(model, train_dataset, test_dataset, loss_fn)``.

``Recipe.settings()`` describes what changes the training (the optimizer's class and every group's hyper-parameters,
the schedule as the learning-rate factor it gives at a fixed list of global epochs, clipping, precision, the global
batch, the model's parameter shapes, the data's identity); its ``fingerprint`` joins the run's identity
(``Optimizer(identity=...)``), so peers whose recipes differ never average. So that a volunteer whose recipe differs
is told which setting differs instead of training apart, the peers publish their settings under the run's
``{run_id}_recipe`` DHT key (``recipe_beacon``) and a newcomer compares before it trains (``check_run_recipe``).
Published settings are network input: size-bounded, validated, and counted only when they hash to the schema that a
live peer's signed progress record carries.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Union

import torch
from torch.utils.data import Dataset, IterableDataset

from swarm_opt import protocol
from swarm_opt._hivemind.beacon import Beacon
from swarm_opt.errors import ConfigError

logger = logging.getLogger(__name__)

PRECISIONS = ("fp32", "bf16", "fp16")
#: global epochs at which a schedule's learning-rate factor is recorded in the settings
SCHEDULE_PROBES: Sequence[int] = tuple(range(33)) + tuple(sorted({int(2 ** (k / 2)) for k in range(11, 23)}))
#: an optimizer's group options that change how it computes, not what: left out of the settings
_IMPLEMENTATION_OPTIONS = frozenset({"foreach", "fused", "capturable", "differentiable"})
_MAX_RECORD_BYTES = 16384  # a published recipe is network input: bounded
_MAX_SETTINGS = 256
_RECORD_TTL, _RECORD_PERIOD = 120.0, 30.0  # seconds a published recipe lives; seconds between refreshes

OptimizerFactory = Callable[[Any], torch.optim.Optimizer]
SchedulerFactory = Callable[[torch.optim.Optimizer], Any]
Stream = Callable[["DataShard"], Iterable[Any]]


@dataclass(frozen=True)
class DataShard:
    """The part of a streaming source that one peer reads: shard ``index`` of ``count``, its order drawn by
    ``seed``."""

    index: int
    count: int
    seed: int = 0

    def __post_init__(self) -> None:
        if not (isinstance(self.count, int) and self.count >= 1 and isinstance(self.index, int)
                and 0 <= self.index < self.count):
            raise ConfigError(f"a data shard is INDEX/COUNT with 0 <= INDEX < COUNT, e.g. 2/8; got "
                              f"{self.index}/{self.count}")

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"


def perplexity(mean_loss: float) -> Dict[str, float]:
    """``Evaluation(metric=perplexity)``: exp of the mean cross-entropy (in nats)."""
    return {"perplexity": math.exp(min(mean_loss, 700.0))}


@dataclass(frozen=True)
class Evaluation:
    """How a peer evaluates its model after global epochs: the mean loss over ``batches`` batches of ``batch_size``
    from ``data`` (all of it when None), every ``every_epochs`` global epochs, and ``metric(mean_loss)``'s extra
    metrics (e.g. ``perplexity``); the accuracy too when outputs are class scores and targets class indices."""

    data: Dataset
    batches: Optional[int] = None
    every_epochs: int = 1
    batch_size: int = 256
    metric: Optional[Callable[[float], Dict[str, float]]] = None

    def __post_init__(self) -> None:
        if not (hasattr(self.data, "__getitem__") and hasattr(self.data, "__len__")):
            raise ConfigError(f"Evaluation(data=...) must be a map-style dataset (with __len__ and __getitem__), "
                              f"got {type(self.data).__name__}")
        for name in ("every_epochs", "batch_size") + (("batches",) if self.batches is not None else ()):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"Evaluation({name}=...) must be a positive integer, got {value!r}")
        if self.metric is not None and not callable(self.metric):
            raise ConfigError(f"Evaluation(metric=...) must be a function of the mean loss, e.g. "
                              f"swarm_opt.recipe.perplexity; got {self.metric!r}")


@dataclass(frozen=True)
class Recipe:
    """Everything a volunteer needs to train a run's model alike (see the module docstring).

    :param model: the model (built after torch was seeded, so every peer starts from the same parameters).
    :param loss_fn: ``loss_fn(outputs, targets)``.
    :param train_data: a map-style dataset of ``(input, target)`` samples (each peer shuffles all of it), or a
        streaming source: a function ``source(shard: DataShard)`` returning an iterable (a generator, an
        ``IterableDataset``) of the shard's samples, which reads only that shard. An ``IterableDataset`` with a
        ``shard(num_shards, index)`` method (as Hugging Face ``datasets``' has) is sharded by it; any other bare
        ``IterableDataset`` by keeping every ``count``-th sample (each peer then reads the whole stream). A peer
        leaves cleanly when its stream runs out.
    :param num_shards: how many shards a streaming source is cut into (a peer's shard is ``--shard`` or the
        run's least-claimed shard: ``swarm_opt.shard_claims``).
    :param optimizer: the inner optimizer's factory ``lambda groups: AdamW(groups, lr=...)``; default: the
        command line's ``--optimizer``/``--lr``.
    :param param_groups: ``lambda model: [{"params": ..., "weight_decay": 0.1}, ...]``; default: all parameters.
    :param schedule: ``lambda opt: LambdaLR(opt, ...)``, stepped once per global epoch (``Optimizer(scheduler=)``).
    :param clip_grad_norm: ``Optimizer(clip_grad_norm=...)``.
    :param precision: ``fp32``; ``bf16`` (autocast to bfloat16); ``fp16`` (autocast to float16 with a
        ``GradScaler``).
    :param collate: the ``collate_fn`` that turns a list of samples into a batch ``(inputs, targets)``.
    :param evaluation: ``Evaluation(...)``; default none.
    :param strategy: default ``--strategy`` (a name of ``swarm_opt.strategies.STRATEGIES``).
    :param batch_size: default ``--batch-size``; ``target_batch_size``: default ``--target-batch-size``.
    :param data_id: what identifies the training data (e.g. the corpus's hash): joins the fingerprint.
    """

    model: torch.nn.Module
    loss_fn: Callable[[Any, Any], torch.Tensor]
    train_data: Union[Dataset, Stream]
    optimizer: Optional[OptimizerFactory] = None
    param_groups: Optional[Callable[[torch.nn.Module], List[Dict[str, Any]]]] = None
    schedule: Optional[SchedulerFactory] = None
    clip_grad_norm: Optional[float] = None
    precision: str = "fp32"
    collate: Optional[Callable[[List[Any]], Any]] = None
    evaluation: Optional[Evaluation] = None
    num_shards: int = 64
    strategy: Optional[str] = None
    batch_size: Optional[int] = None
    target_batch_size: Optional[int] = None
    data_id: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.model, torch.nn.Module):
            raise ConfigError(f"Recipe(model=...) must be a torch.nn.Module, got {type(self.model).__name__}")
        if not callable(self.loss_fn):
            raise ConfigError("Recipe(loss_fn=...) must be callable as loss_fn(outputs, targets)")
        data = self.train_data
        if not (isinstance(data, IterableDataset) or callable(data)
                or (hasattr(data, "__getitem__") and hasattr(data, "__len__"))):
            raise ConfigError(f"Recipe(train_data=...) must be a map-style dataset, an IterableDataset or a "
                              f"function of a DataShard returning the shard's samples; got {type(data).__name__}")
        if not self.streaming and len(data) == 0:  # type: ignore[arg-type]
            raise ConfigError("Recipe(train_data=...): the training dataset is empty")
        for name in ("optimizer", "param_groups", "schedule", "collate"):
            if getattr(self, name) is not None and not callable(getattr(self, name)):
                raise ConfigError(f"Recipe({name}=...) must be a function (see help(swarm_opt.Recipe)), got "
                                  f"{getattr(self, name)!r}")
        if self.clip_grad_norm is not None:
            from swarm_opt.clipping import checked_max_norm

            checked_max_norm(self.clip_grad_norm)
        if self.precision not in PRECISIONS:
            raise ConfigError(f"Recipe(precision={self.precision!r}): choose one of {', '.join(PRECISIONS)}")
        if self.evaluation is not None and not isinstance(self.evaluation, Evaluation):
            raise ConfigError(f"Recipe(evaluation=...) must be swarm_opt.recipe.Evaluation(...), got "
                              f"{type(self.evaluation).__name__}")
        for name in ("num_shards", "batch_size", "target_batch_size"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ConfigError(f"Recipe({name}=...) must be a positive integer, got {value!r}")
        if self.strategy is not None:
            from swarm_opt.strategies import STRATEGY_NAMES

            if self.strategy not in STRATEGY_NAMES:
                raise ConfigError(f"Recipe(strategy={self.strategy!r}): choose one of {', '.join(STRATEGY_NAMES)}")
        if not isinstance(self.data_id, str) or len(self.data_id) > 200:
            raise ConfigError("Recipe(data_id=...) must be a string of at most 200 characters")

    @property
    def streaming(self) -> bool:
        return isinstance(self.train_data, IterableDataset) or (
            callable(self.train_data) and not hasattr(self.train_data, "__getitem__"))

    def groups(self) -> Any:
        """The parameters (groups) the inner optimizer is built on: a fresh list on every call."""
        if self.param_groups is None:
            return list(self.model.parameters())
        groups = _call(self.param_groups, "param_groups", self.model)
        if not isinstance(groups, (list, tuple)) or not groups:
            raise ConfigError(f"the recipe's param_groups must return a non-empty list of parameter groups "
                              f"([{{'params': [...], ...}}, ...]), got {type(groups).__name__}")
        # copies: an optimizer writes into the groups it is given (torch.optim: "params", a scheduler's "initial_lr")
        return [dict(g, params=list(g.get("params", ()))) if isinstance(g, dict) else g for g in groups]

    def build_optimizer(self, groups: Any) -> torch.optim.Optimizer:
        """The recipe's inner optimizer on ``groups``, checked."""
        if self.optimizer is None:
            raise ConfigError("this recipe declares no optimizer")
        optimizer = _call(self.optimizer, "optimizer", groups)
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigError(f"the recipe's optimizer factory must return a torch.optim.Optimizer, got "
                              f"{type(optimizer).__name__}")
        return optimizer

    def autocast(self) -> Any:
        """The context that runs the forward pass in the recipe's precision (a no-op for fp32)."""
        if self.precision == "fp32":
            import contextlib

            return contextlib.nullcontext()
        device = next(self.model.parameters()).device.type
        return torch.autocast(device, dtype=torch.bfloat16 if self.precision == "bf16" else torch.float16)

    def emulated_precision(self) -> Optional[str]:
        """Why the recipe's mixed precision runs slower than fp32 on this machine (None when it does not): a CPU
        without native bfloat16 (or float16) arithmetic emulates autocast's matrix products."""
        if self.precision == "fp32" or next(self.model.parameters()).device.type != "cpu":
            return None
        check = getattr(torch.ops.mkldnn, f"_is_mkldnn_{self.precision}_supported")
        try:
            if check():
                return None
        except RuntimeError:  # a torch built without oneDNN: nothing to say
            return None
        return (f"this CPU ({torch.backends.cpu.get_cpu_capability()}) has no native {self.precision} arithmetic: the "
                f"recipe's {self.precision} autocast is emulated, several times slower than fp32 here")

    def grad_scaler(self) -> Optional[Any]:
        """A ``GradScaler`` for fp16 (None otherwise)."""
        if self.precision != "fp16":
            return None
        return torch.amp.GradScaler(next(self.model.parameters()).device.type)

    def stream(self, shard: DataShard) -> Iterator[Any]:
        """The samples of ``shard`` of a streaming source."""
        data = self.train_data
        if isinstance(data, IterableDataset) and not callable(data):
            if callable(getattr(type(data), "shard", None)):  # the dataset reads only its shard
                return iter(_call(data.shard, "train_data.shard", shard.count, shard.index))
            return (sample for i, sample in enumerate(data) if i % shard.count == shard.index)
        source = _call(data, "train_data", shard)  # type: ignore[arg-type]
        try:
            return iter(source)
        except TypeError:
            raise ConfigError(f"the recipe's streaming source must return an iterable of samples (a generator, "
                              f"an IterableDataset), got {type(source).__name__}") from None

    def settings(self, *, target_batch_size: int, strategy: str) -> Dict[str, Any]:
        """What peers must share to train together, as a flat mapping of setting name to a JSON value, in the order
        a difference is reported (``difference``)."""
        settings: Dict[str, Any] = {}
        if self.optimizer is not None:
            optimizer = self.build_optimizer(self.groups())
            settings["optimizer"] = type(optimizer).__name__
            for i, group in enumerate(optimizer.param_groups):
                prefix = "" if i == 0 else f"group{i}."
                for key in sorted(group, key=lambda k: (k != "lr", k)):
                    if key != "params" and key not in _IMPLEMENTATION_OPTIONS:
                        settings[prefix + key] = _jsonable(group[key])
                settings[prefix + "parameters"] = sum(p.numel() for p in group["params"])
        settings["schedule"] = self._schedule_factors()
        settings["clip_grad_norm"] = self.clip_grad_norm
        settings["precision"] = self.precision
        settings["target_batch_size"] = target_batch_size
        settings["strategy"] = strategy
        shapes = ";".join(f"{name}:{tuple(p.shape)}:{p.dtype}" for name, p in self.model.named_parameters())
        settings["model"] = f"{sum(p.numel() for p in self.model.parameters())} parameters, shapes " \
                            f"{hashlib.sha256(shapes.encode()).hexdigest()[:12]}"
        settings["data"] = self.data_id
        return settings

    def _schedule_factors(self) -> Optional[List[float]]:
        """The first group's learning rate at each of ``SCHEDULE_PROBES`` global epochs (the first 2048), as a factor
        of its value before the schedule (so that ``lr`` is reported on its own); None without a schedule."""
        if self.schedule is None:
            return None
        optimizer = (self.build_optimizer(self.groups()) if self.optimizer is not None
                     else torch.optim.SGD(self.groups(), lr=1.0))
        base = float(optimizer.param_groups[0]["lr"])
        scheduler = _call(self.schedule, "schedule", optimizer)
        if not hasattr(scheduler, "step"):
            raise ConfigError(f"the recipe's schedule must return a learning-rate scheduler (with step()), got "
                              f"{type(scheduler).__name__}")
        factors, epoch = [], 0
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "lr_scheduler.step() before optimizer.step()": no step is taken here
            for probe in SCHEDULE_PROBES:
                while epoch < probe:
                    _call(scheduler.step, "schedule's step()")
                    epoch += 1
                lr = float(optimizer.param_groups[0]["lr"])
                factors.append(float(f"{lr / base:.6g}") if base else lr)
        return factors


def fingerprint(settings: Mapping[str, Any]) -> str:
    """The hash of a recipe's settings: ``Optimizer(identity=...)``."""
    return hashlib.sha256(json.dumps(settings, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:32]


def difference(theirs: Mapping[str, Any], mine: Mapping[str, Any], flags: Mapping[str, str] = {}) -> Optional[str]:
    """The first setting in which ``mine`` differs from the run's (``theirs``), in one phrase naming both values;
    ``flags`` maps a setting to the command-line option that set it (the phrase then names the option)."""
    for key in list(mine) + [k for k in theirs if k not in mine]:
        a, b = theirs.get(key), mine.get(key)
        if a == b:
            continue
        if key == "schedule" and isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
            epoch, ra, rb = next((e, x, y) for e, x, y in zip(SCHEDULE_PROBES, a, b) if x != y)
            return (f"this run's schedule sets the learning rate to {ra:g}x its base at global epoch {epoch}; your "
                    f"recipe's sets {rb:g}x")
        option = flags.get(key.rsplit(".", 1)[-1] if key.startswith("group") else key)
        said = f"your {option} says" if option else "your recipe says"
        return f"this run trains with {key}={_show(a)}; {said} {key}={_show(b)}"
    return None


def _show(value: Any) -> str:
    return "(none)" if value is None else json.dumps(value) if isinstance(value, (list, str)) else str(value)


def _jsonable(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return float(value)
    return type(value).__name__


def _call(function: Callable[..., Any], what: str, *args: Any) -> Any:
    try:
        return function(*args)
    except ConfigError:
        raise
    except Exception as e:
        raise ConfigError(f"the recipe's {what} raised {type(e).__name__}: {e}; fix the recipe's {what}") from None


# --- the run's published recipe -------------------------------------------------------------------------------------


def recipe_key(run_id: str) -> str:
    return f"{run_id}_recipe"


def encode_record(settings: Mapping[str, Any], base_schema: str) -> bytes:
    """What a peer publishes: its settings and its schema before the recipe was mixed in
    (``strategy_schema``)."""
    return json.dumps({"settings": dict(settings), "schema": base_schema}, separators=(",", ":")).encode()


def parse_record(subkey: Any, value: Any) -> Optional[Dict[str, Any]]:
    """The settings of a published record, or None if it is malformed, too large, or does not hash to the schema it
    is stored under (``subkey``): nobody can attach settings to a schema they do not produce."""
    from swarm_opt.optimizer import identified_schema

    if not isinstance(value, bytes) or len(value) > _MAX_RECORD_BYTES or not isinstance(subkey, str):
        return None
    try:
        record = json.loads(value)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(record, dict) or set(record) != {"settings", "schema"}:
        return None
    settings, schema = record["settings"], record["schema"]
    if not isinstance(settings, dict) or len(settings) > _MAX_SETTINGS or not isinstance(schema, str) \
            or len(schema) > 64:
        return None
    if not all(isinstance(k, str) and len(k) <= 64 and _plain(v) for k, v in settings.items()):
        return None
    if identified_schema(schema, fingerprint(settings)) != subkey:
        return None
    return settings


def _plain(value: Any) -> bool:
    if isinstance(value, list):
        return len(value) <= 128 and all(v is None or isinstance(v, (bool, int, float, str)) for v in value)
    return value is None or isinstance(value, (bool, int, float)) or (isinstance(value, str) and len(value) <= 200)


def check_run_recipe(dht: Any, run_id: str, settings: Mapping[str, Any], model_schema: str, *,
                     flags: Mapping[str, str] = {}, wait: float = 3.0) -> Optional[str]:
    """Why this peer (``settings``, its ``Optimizer.model_schema``) must not join ``run_id``: one phrase naming the
    setting in which it differs from the run's live peers, or None (no live peer, one of them trains as this peer,
    or none published a recipe that explains the difference: they are then only kept apart). Reads the run's
    progress records for up to ``wait`` seconds."""
    import time

    from hivemind.utils import ValueWithExpiration

    from swarm_opt.monitor import RunMonitor

    monitor = RunMonitor(dht, run_id)
    deadline = time.monotonic() + wait
    snapshot = monitor.read()
    while not snapshot.peers and time.monotonic() < deadline:
        time.sleep(0.5)
        snapshot = monitor.read()
    live = {peer.model_schema for peer in snapshot.peers}
    if not live or model_schema in live:
        return None
    found = dht.get(recipe_key(run_id), latest=True)
    entries = found.value if isinstance(found, ValueWithExpiration) and isinstance(found.value, dict) else {}
    for subkey, entry in sorted(entries.items(), key=lambda item: -getattr(item[1], "expiration_time", 0)):
        theirs = parse_record(subkey, getattr(entry, "value", None))
        if theirs is not None and subkey in live:
            return protocol_difference(theirs, settings) or difference(theirs, settings, flags)
    return None


def protocol_difference(theirs: Mapping[str, Any], mine: Mapping[str, Any]) -> Optional[str]:
    """Whether the run's peers speak another protocol than this peer (``swarm_opt.protocol``), as a phrase naming
    the release to install; None if they speak ours, or if ``mine`` does not say (a caller without the setting)."""
    if protocol.SETTING not in mine:
        return None
    ours, found = protocol.parse_label(mine[protocol.SETTING]), protocol.parse_label(theirs.get(protocol.SETTING))
    if ours is None or found is None or found[0] == ours[0]:
        return None
    return f"its live peers run {protocol.mismatch(*found)}"


def recipe_beacon(dht: Any, run_id: str, settings: Mapping[str, Any], base_schema: str, model_schema: str) -> Beacon:
    """This peer's recipe, published under the run's key every ``_RECORD_PERIOD`` seconds until the returned
    beacon's ``stop()``, so that newcomers can compare theirs (``check_run_recipe``). Peers of one recipe share the
    record (its subkey is their schema): stop it with ``stop(withdraw=False)``, leaving it to the others."""
    value = encode_record(settings, base_schema)
    if len(value) > _MAX_RECORD_BYTES:
        raise ConfigError(f"the recipe's settings take {len(value)} bytes, more than the {_MAX_RECORD_BYTES} peers "
                          f"accept: declare fewer parameter groups")
    beacon = Beacon(dht, recipe_key(run_id), model_schema, value, period=_RECORD_PERIOD, ttl=_RECORD_TTL,
                    name="RecipeBeacon")
    return beacon.start()
