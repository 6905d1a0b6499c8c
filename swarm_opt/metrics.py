"""What a training peer tells an observer about itself: the events of its rounds and of its trust checks.

The core calls one ``Metrics`` object at a handful of places (a round concluded, a record refused); the default
observer does nothing, so a peer that nobody watches pays one method call per event and nothing per step. Exporters
(``swarm_opt.monitor.prometheus``, the peer statistics of ``swarm_opt.monitor.stats``) subclass it and are attached
with ``Optimizer.observe(...)``. Figures that exist anyway (epoch, peers, throughput, state uploads) are read by the
exporter when it is asked (pull), not pushed here.
"""

from __future__ import annotations

from typing import Tuple

#: how a round of this peer ended: averaged and committed; given back (no majority, a failure, a disagreement);
#: the swarm's state downloaded instead; the swarm's epoch taken over from the local model (local-update strategies)
ROUND_OUTCOMES = ("committed", "failed", "downloaded", "skipped")
#: why a peer's progress record is not believed for a while (``swarm_opt.trust.ClaimChecker``)
REFUSAL_REASONS = ("epoch_ahead", "implausible_samples")


class Metrics:
    """An observer of a peer's events. Every method is a no-op here; override the ones you need. Methods run in
    the thread where the event happened (the training loop, or the progress tracker's thread for refusals): keep them
    short and never raise."""

    def round_concluded(self, outcome: str, seconds: float, group_size: int) -> None:
        """A round ended with ``outcome`` (one of ``ROUND_OUTCOMES``) after ``seconds`` (0 for a catch-up), in a
        group of ``group_size`` peers (0 when no group formed)."""

    def record_refused(self, reason: str, peer_id: bytes, why: str, seconds: float) -> None:
        """A peer's progress record is ignored for ``seconds`` because of ``reason`` (one of ``REFUSAL_REASONS``);
        ``why`` says it in words."""

    def joined(self, other: Metrics) -> Metrics:
        """An observer that tells both this one and ``other``."""
        if type(self) is Metrics:
            return other
        return _Both((self, other))


class _Both(Metrics):
    def __init__(self, observers: Tuple[Metrics, ...]) -> None:
        self.observers = observers

    def round_concluded(self, outcome: str, seconds: float, group_size: int) -> None:
        for observer in self.observers:
            observer.round_concluded(outcome, seconds, group_size)

    def record_refused(self, reason: str, peer_id: bytes, why: str, seconds: float) -> None:
        for observer in self.observers:
            observer.record_refused(reason, peer_id, why, seconds)


#: the observer of a peer that nobody watches
NO_METRICS = Metrics()
