"""Options resolved once: ``resolve(...)`` turns the averaging keywords that ``Optimizer``, ``AuxiliaryPeer`` and the
framework callbacks (``swarm_opt.lightning.SwarmCallback``, ``swarm_opt.transformers.SwarmCallback``) share into one
frozen ``Averaging``. Every rule that pairs two options lives here, with its message, and runs before anything is
bound or started (a refused option leaves the strategy object usable for the next try):

* strategy × groups: a strategy averages in Moshpit groups if its class says so (``Strategy.supports_groups``);
* compression × strategy: what the codec needs of the strategy's rounds (``Compression.check_strategy``: TopK
  changes, PowerSGD gradients); checked again once the strategy is bound (``Averaging.check_bound``: DiLoCo learns
  at bind whether a frozen parameter travels as it is);
* aggregation × compression: the codec has the last word (``Compression.check_aggregation``: PowerSGD and TopK
  average with the weighted mean only);
* transport × aggregation: the gloo lane averages with gloo's plain weighted mean;
* transport × compression: the lane carries the dtypes of ``Compression.lane_dtype`` only;
* privacy × strategy: DP-SGD stays private only with strategies that declare it (``Strategy.privacy_refusal``);
  privacy × clip_grad_norm: Opacus clips each sample's gradient itself;
* auxiliary × compression: a helper reduces parts of elementwise codecs only;
* timeouts: ``timeouts=Timeouts(...)`` is the one documented way; hivemind's ``matchmaking_time`` and
  ``averaging_timeout`` keywords are accepted as aliases, not together with it.

What needs the inner optimizer (``OpacusPrivacy.check_optimizer``) or the model is checked where those exist.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Optional

from swarm_opt.aggregation import Aggregation, as_aggregation
from swarm_opt.clipping import checked_max_norm
from swarm_opt.compression import Compression, as_codec
from swarm_opt.config import Groups, Timeouts
from swarm_opt.errors import ConfigError, ConfigTypeError
from swarm_opt.gloo_lane import Gloo, lane_codec_dtype
from swarm_opt.privacy import OpacusPrivacy
from swarm_opt.strategies.base import Strategy
from swarm_opt.strategies.grad_averaging import GradientAveraging

__all__ = ["Averaging", "resolve", "resolve_timeouts"]


@dataclass(frozen=True)
class Averaging:
    """How a peer averages, every pairing of options checked (``resolve``). ``strategy`` is the caller's object,
    told its ``groups``; it is bound later by the optimizer."""

    strategy: Strategy
    compression: Compression
    aggregation: Aggregation
    timeouts: Timeouts
    transport: Optional[Gloo] = None
    groups: Optional[Groups] = None
    privacy: Optional[OpacusPrivacy] = None
    clip_grad_norm: Optional[float] = None
    auxiliary: bool = False

    def check_bound(self) -> None:
        """The rules that depend on what the bound strategy sends (``Strategy.bind`` may change it): compression ×
        strategy again."""
        self.compression.check_strategy(self.strategy)


def resolve(
    *,
    strategy: Optional[Strategy] = None,
    compression: Optional[Compression] = None,
    aggregation: Optional[Aggregation] = None,
    transport: Optional[Gloo] = None,
    groups: Optional[Groups] = None,
    privacy: Optional[OpacusPrivacy] = None,
    timeouts: Optional[Timeouts] = None,
    matchmaking_time: Optional[float] = None,
    averaging_timeout: Optional[float] = None,
    clip_grad_norm: Optional[float] = None,
    auxiliary: bool = False,
) -> Averaging:
    """The ``Averaging`` of these options (defaults: ``GradientAveraging()``, ``NoCompression()``, the codec's
    aggregation, hivemind's path, one group, no privacy, ``Timeouts()``); a conflict raises ``ConfigError`` (a
    wrong type ``ConfigTypeError``) naming the fix, before anything is bound."""
    max_norm = checked_max_norm(clip_grad_norm)
    timeouts = resolve_timeouts(timeouts, matchmaking_time=matchmaking_time, averaging_timeout=averaging_timeout)
    strategy = GradientAveraging() if strategy is None else strategy
    if not isinstance(strategy, Strategy):
        raise ConfigTypeError(f"strategy must be a swarm_opt strategy, e.g. GradientAveraging(), got {strategy!r}")
    if transport is not None and not isinstance(transport, Gloo):
        raise ConfigTypeError(f"transport must be None (hivemind's path) or swarm_opt.Gloo(host=...), "
                              f"got {transport!r}")
    if groups is not None and not isinstance(groups, Groups):
        raise ConfigTypeError(f"groups must be swarm_opt.Groups(size=...) or None, got {groups!r}")
    if privacy is not None and not isinstance(privacy, OpacusPrivacy):
        raise ConfigTypeError(f"privacy must be swarm_opt.OpacusPrivacy(engine, delta=...) or None, got {privacy!r}")
    # the checks see the strategy as it will average (in groups or not); the caller's object is told only once
    # every check passed, so that a refused option leaves it as it was
    grouped = strategy
    if groups is not None:
        grouped = copy.copy(strategy)
        grouped.use_groups(groups)
    if privacy is not None:
        privacy.check_strategy(grouped)
        if max_norm is not None:
            raise ConfigError("clip_grad_norm with privacy=OpacusPrivacy(...): Opacus's DP-SGD clips each sample's "
                              "gradient itself (make_private(..., max_grad_norm=...)) and replaces the gradient "
                              "inside its step, so this clipping would do nothing; drop clip_grad_norm")
    codec = as_codec(compression, grouped)
    if auxiliary and not codec.elementwise:
        raise ConfigError(f"{codec!r} averages through a protocol of its own that auxiliary peers cannot join; "
                          f"help runs that use an elementwise codec (Float16(), Int8Blockwise(), ...)")
    if transport is not None:
        if aggregation is not None:
            raise ConfigError("the gloo lane averages with gloo's all-reduce, a plain weighted mean: aggregation= "
                              "(robust aggregation, Mean's norm bound) needs hivemind's path; drop transport= or "
                              "aggregation=")
        lane_codec_dtype(codec)  # a codec the lane cannot carry is refused
    aggregation = as_aggregation(aggregation, codec)
    if groups is not None:
        strategy.use_groups(groups)
    return Averaging(strategy=strategy, compression=codec, aggregation=aggregation, timeouts=timeouts,
                     transport=transport, groups=groups, privacy=privacy, clip_grad_norm=max_norm,
                     auxiliary=auxiliary)


def resolve_timeouts(timeouts: Any, **aliases: Optional[float]) -> Timeouts:
    """``timeouts=Timeouts(...)``, or hivemind's keywords ``matchmaking_time`` / ``averaging_timeout`` (accepted
    aliases), not both: one of them would be silently ignored."""
    given = {name: value for name, value in aliases.items() if value is not None}
    if timeouts is None:
        return Timeouts(**given)
    if not isinstance(timeouts, Timeouts):
        raise ConfigTypeError(f"timeouts must be swarm_opt.Timeouts(...) or None, got {timeouts!r}")
    if given:
        names = " and ".join(given)
        raise ConfigError(f"{names} given both as keyword and in timeouts=Timeouts(...): pass "
                          f"Timeouts({', '.join(f'{n}={v}' for n, v in given.items())}, ...) alone")
    return timeouts
