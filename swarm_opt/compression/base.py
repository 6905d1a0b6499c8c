"""What every ``compression=`` declares, so that the layers using it ask the codec and nothing else.

``Compression`` is the one base of the elementwise codecs (``Codec``) and of ``PowerSGD``. The transport and the
option checks ask a codec only through it:

* ``lane_dtype``: the dtype the gloo lane carries its values in (``None``: the lane cannot carry it);
* ``elementwise``: whether its values travel inside hivemind's all-reduce, part by part (auxiliary peers can then
  reduce them); ``False`` for a protocol of its own, whose engine the transport picks (``swarm_opt._hivemind``);
* ``needs_changes`` / ``needs_gradients``: what it needs of a strategy's rounds (``Strategy.sends_changes``,
  ``Strategy.averages_gradients``), checked by ``check_strategy``;
* ``check_aggregation``: the aggregation it averages with (``aggregation=`` or its default);
* ``feedback``: the state it keeps between a peer's rounds (``TopK``'s residuals), if any.

A codec never picks its transport or engine, and imports neither strategies nor the transport.
"""

from __future__ import annotations

from typing import Any, ClassVar, Optional, Protocol, Sequence

import torch

from swarm_opt.aggregation import Aggregation, Mean
from swarm_opt.errors import ConfigError

__all__ = ["Compression", "Feedback", "StrategyTraits"]


class StrategyTraits(Protocol):
    """What a codec may ask of a strategy (declared on ``swarm_opt.strategies.base.Strategy``)."""

    @property
    def sends_changes(self) -> bool: ...

    @property
    def averages_gradients(self) -> bool: ...


class Feedback(Protocol):
    """State a codec keeps between a peer's rounds (``swarm_opt.compression.sparse.SparseFeedback``)."""

    def select(self, buffers: Sequence[torch.Tensor], weight: float, round_id: int) -> None: ...

    def commit(self, round_id: int, *, averaged: bool) -> None: ...


class Compression:
    """The capabilities of a ``compression=`` (see the module docstring); the defaults are an exact, elementwise
    codec that serves every strategy and aggregation and keeps no state."""

    #: its values travel inside hivemind's all-reduce, part by part (False: a protocol of its own, e.g. PowerSGD)
    elementwise: ClassVar[bool] = True
    #: it serves only strategies whose every averaged value is a change (``Strategy.sends_changes``)
    needs_changes: ClassVar[bool] = False
    #: it serves only strategies whose rounds average one round's gradients (``Strategy.averages_gradients``)
    needs_gradients: ClassVar[bool] = False

    @property
    def lane_dtype(self) -> Optional[torch.dtype]:
        """The dtype the gloo lane carries this codec's values in; None: the lane cannot carry them."""
        return None

    def check_strategy(self, strategy: StrategyTraits) -> None:
        """Refuse a strategy whose rounds do not send what this codec needs (ConfigError naming the fix)."""
        if (self.needs_changes and not strategy.sends_changes) or (
                self.needs_gradients and not strategy.averages_gradients):
            raise ConfigError(self.refusal(strategy))

    def refusal(self, strategy: Any) -> str:
        """Why ``check_strategy`` refuses ``strategy``, and what to use instead."""
        return f"{self!r} cannot compress what {type(strategy).__name__}'s rounds send; use compression=None"

    def check_aggregation(self, aggregation: Optional[Aggregation]) -> Aggregation:
        """The aggregation this codec averages with, given ``aggregation=`` (None: the default, ``Mean()``); one it
        cannot average with is refused (ConfigError)."""
        return Mean() if aggregation is None else aggregation

    def feedback(self, buffers: Sequence[torch.Tensor]) -> Optional[Feedback]:
        """State this codec keeps between a peer's rounds, for averaging buffers like ``buffers`` (None: none)."""
        return None
