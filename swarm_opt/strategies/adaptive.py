"""Hyper-parameters that a swarm adapts round by round from scalars its rounds average (``SharedScalars``).

``AdaptiveMu``: FedProx's μ follows the swarm's mean training loss, FL4Health's adaptive constraint (after the
FedProx paper's appendix C.3.3) without its server: every member of a round sends its mean loss of the round and
its view of the schedule (μ, the previous loss, the streak of improvements), and applies the same rule to the
same averaged values, so that every member of a committed round ends it with the same μ, even one whose view had
drifted (a peer that missed rounds, or joined late).
"""

from __future__ import annotations

import math
from typing import Any, Dict, Optional

from swarm_opt.errors import ConfigError, IncompatibleStateError

_MAX_MU = 1e6  # a μ beyond this (only reachable by tampering: each round moves μ by one delta) is bounded to it


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class AdaptiveMu:
    """μ rises by ``delta`` after a round whose mean training loss did not improve on the previous round's, and falls
    by ``delta`` (not below 0) once the loss improved (or held) ``patience`` rounds in a row; FL4Health's rule
    (``FedAvgWithAdaptiveConstraint``) and defaults. The loss is the one each peer reports
    (``Optimizer.step(closure)`` or ``Optimizer.report_loss``), without FedProx's proximal term; rounds no member
    reported a loss for leave μ as it is.

    :param delta: how much μ moves at a time (> 0).
    :param patience: how many improving rounds in a row lower μ (>= 1).
    """

    names = ("loss", "mu", "previous_loss", "streak")  # the scalars a round carries (SharedScalars)

    def __init__(self, *, delta: float = 0.1, patience: int = 5) -> None:
        if not _number(delta) or not 0 < delta < math.inf:
            raise ConfigError(f"AdaptiveMu delta must be a positive number, got {delta!r}; e.g. AdaptiveMu(delta=0.1)")
        if isinstance(patience, bool) or not isinstance(patience, int) or patience < 1:
            raise ConfigError(f"AdaptiveMu patience must be an int >= 1, got {patience!r}; e.g. AdaptiveMu(patience=5)")
        self.delta, self.patience = float(delta), patience
        self.mu = 0.0  # set by FedProx from its mu= when bound
        self.previous_loss: Optional[float] = None  # the swarm's mean loss of the last round that had one
        self.streak = 0  # improving rounds in a row since μ last moved

    def __repr__(self) -> str:
        return f"AdaptiveMu(delta={self.delta}, patience={self.patience})"

    def scalars(self, loss: Optional[float]) -> Dict[str, Optional[float]]:
        """What this peer sends in a round: its mean loss of the round (``None``: none reported) and its schedule."""
        return {"loss": loss, "mu": self.mu, "previous_loss": self.previous_loss, "streak": float(self.streak)}

    def update(self, group: Dict[str, Optional[float]]) -> float:
        """Apply the round: take the group's schedule (its members' mean; the same on every member), then move it by
        the group's mean loss. Returns the new μ. ``group`` comes from the groupmates: it is bounded here."""
        group = {k: (v if v is not None and math.isfinite(v) else None) for k, v in group.items()}
        if group.get("mu") is not None:
            self.mu = min(max(float(group["mu"]), 0.0), _MAX_MU)
        if group.get("streak") is not None:
            self.streak = min(max(int(round(float(group["streak"]))), 0), self.patience - 1)
        self.previous_loss = group.get("previous_loss")
        loss = group.get("loss")
        if loss is None:
            return self.mu
        if self.previous_loss is None or loss <= self.previous_loss:
            self.streak += 1
            if self.streak >= self.patience:
                self.mu, self.streak = max(0.0, self.mu - self.delta), 0
        else:
            self.mu, self.streak = min(self.mu + self.delta, _MAX_MU), 0
        self.previous_loss = float(loss)
        return self.mu

    def state(self) -> Dict[str, Any]:
        return {"mu": self.mu, "previous_loss": self.previous_loss, "streak": self.streak}

    def check(self, saved: Any, what: str) -> Dict[str, Any]:
        """A saved ``state()`` checked (it may come from another strategy, or a hostile peer): the function's value is
        what ``load`` takes."""
        if not isinstance(saved, dict) or set(saved) != {"mu", "previous_loss", "streak"}:
            raise IncompatibleStateError(f"{what}: expected a dict with mu, previous_loss and streak")
        mu, previous, streak = saved["mu"], saved["previous_loss"], saved["streak"]
        if not (_number(mu) and 0 <= mu <= _MAX_MU) or not (previous is None or _number(previous)
                                                            and math.isfinite(previous)) \
                or isinstance(streak, bool) or not isinstance(streak, int) or not 0 <= streak < self.patience:
            raise IncompatibleStateError(f"{what}: mu, previous_loss or streak out of range")
        return {"mu": float(mu), "previous_loss": None if previous is None else float(previous), "streak": streak}

    def load(self, checked: Dict[str, Any]) -> None:
        self.mu, self.previous_loss, self.streak = checked["mu"], checked["previous_loss"], checked["streak"]
