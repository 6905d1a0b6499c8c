"""Top-k sparsification with error feedback: what ``swarm_opt.TopK`` does to a peer's values before a round.

Each round a peer sends, per tensor, only the ``k`` values of largest magnitude of ``x + R/w`` (``x`` its values of the
round, ``w`` its weight in the round, ``R`` its residual) and keeps the rest for later rounds:
``R ← w·(x + R/w − sent)``. The wire then carries the sparse tensors exactly (COO, ``swarm_opt.compression.TopK``), so
the group's weighted mean of what was sent reaches every member identically, and what a round leaves out is
delivered, with the same total weight, by later rounds: for every peer, over any number of committed rounds,
``Σ w·sent + R = Σ w·x`` exactly (up to float rounding).

Why the residual is kept in units of ``w·x`` (a sum over samples) and not of ``x``: gradient averaging's mean is
``Σ_i w_i x_i / W``, each sample counting once whatever the round. A residual in units of ``w·x`` re-enters with its
own samples' weight even when a peer's weight changes from round to round; one in units of ``x`` would be counted
with the weight of the round it re-enters in.

Where the state lives, and why: in the peer's own process (``TensorAverager`` calls ``select`` on the averaging
buffers right after the strategy wrote them, and ``commit`` when the optimizer applied the round), not in the
averager process and not in the codec object on the wire. The host is the one place that knows whether a round was
*applied*: an all-reduce that failed, or that completed but was discarded (a minority group, a group that mixed
rounds), must change nothing, or the residual would lose values (never applied) or count them twice (applied again
after a retry). So ``select`` computes the new residual as a *candidate* from the residual of the last committed
round, and ``commit`` adopts it only for the round it was selected for; a retry selects again from the same committed
residual. A round alone applies the peer's own full values, so it keeps the residual (it is still owed). A peer that
did not take part in the swarm's last round (it caught up by downloading the swarm's state, or resumed from a
checkpoint) drops its residual: those values belong to parameters it no longer has (PowerSGD does the same).
Selecting before the wire also keeps the wire exact: hivemind's reducer hands its own share to the reduction
unencoded, and re-encodes the mean it sends back; both are exact for values that are already sparse.
"""

from __future__ import annotations

import math
from typing import List, Optional, Sequence

import torch


def top_k_count(numel: int, fraction: float) -> int:
    """How many values of a tensor of ``numel`` values a round sends: ``ceil(fraction·numel)``, at least one."""
    return min(numel, max(1, math.ceil(fraction * numel)))


def select_top_k(values: torch.Tensor, residual: torch.Tensor, new_residual: torch.Tensor, weight: float,
                 k: int) -> None:
    """In place: ``values`` ← the ``k`` largest magnitudes of ``values + residual/weight`` (zeros elsewhere),
    ``new_residual`` ← ``weight·`` what was left out. ``residual`` is read only."""
    flat, left_out = values.view(-1), new_residual.view(-1)
    flat.add_(residual.view(-1), alpha=1.0 / weight)
    if k >= flat.numel():
        left_out.zero_()
        return
    kept = flat.abs().topk(k, sorted=False).indices
    left_out.copy_(flat)
    left_out[kept] = 0
    left_out.mul_(weight)
    chosen = flat[kept]
    flat.zero_()
    flat[kept] = chosen


class SparseFeedback:
    """One peer's residuals between rounds, for tensors shaped like ``templates`` (see the module docstring)."""

    def __init__(self, templates: Sequence[torch.Tensor], fraction: float) -> None:
        self.fraction = fraction
        # two sets: the committed residuals and the candidates of the round in progress (a swap on commit)
        self._residuals: List[Optional[torch.Tensor]] = [_state_like(t) for t in templates]
        self._candidates: List[Optional[torch.Tensor]] = [_state_like(t) for t in templates]
        self._staged_round: Optional[int] = None
        self._committed_round: Optional[int] = None

    @property
    def residuals(self) -> List[Optional[torch.Tensor]]:
        """The committed residuals (None for tensors that are sent whole: integers)."""
        return self._residuals

    def select(self, buffers: Sequence[torch.Tensor], weight: float, round_id: int) -> None:
        """Sparsify this round's values in ``buffers`` (in place) and stage the residuals they leave."""
        self._staged_round = None
        if self._committed_round is not None and round_id != self._committed_round + 1:
            for residual in self._residuals:  # this peer missed the swarm's last round
                if residual is not None:
                    residual.zero_()
        if not weight > 0:  # a member without samples: its values carry no weight, and it owes nothing new
            return
        for buffer, residual, candidate in zip(buffers, self._residuals, self._candidates):
            if residual is not None and candidate is not None:
                select_top_k(buffer, residual, candidate, weight, top_k_count(buffer.numel(), self.fraction))
        self._staged_round = round_id

    def commit(self, round_id: int, *, averaged: bool) -> None:
        """The optimizer applied round ``round_id``: an averaged one adopts the residuals its selection staged, a
        round alone (``averaged=False``: the peer applied its own full values) keeps the current ones."""
        if averaged and self._staged_round == round_id:
            self._residuals, self._candidates = self._candidates, self._residuals
        self._staged_round = None
        self._committed_round = round_id


def _state_like(tensor: torch.Tensor) -> Optional[torch.Tensor]:
    return torch.zeros_like(tensor, device="cpu") if tensor.is_floating_point() else None
