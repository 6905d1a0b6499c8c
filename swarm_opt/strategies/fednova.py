"""FedNova (Wang et al., 2020, "Tackling the Objective Inconsistency Problem in Heterogeneous Federated
Optimization"): normalized averaging, so that peers taking more local steps do not pull the model toward their own
objective."""

from __future__ import annotations

from typing import Iterator, List, Sequence, Tuple

import torch

from swarm_opt.buffers import AveragingResult
from swarm_opt.strategies.local_updates import Anchored


class FedNova(Anchored):
    """Local updates whose rounds average each peer's update normalized by the steps it took.

    Peer ``i`` starts the round at the swarm's ``x`` and completes local steps with learning rates ``η_k`` up to
    ``y_i``; ``S_i = Σ_k η_k`` (per param group). It sends ``d_i = (x - y_i) / S_i`` and ``S_i``; with the group's
    weights ``p_i = w_i / Σ_j w_j`` every member computes

        x⁺ = x - S_eff · Σ_i p_i d_i,    S_eff = Σ_i p_i S_i.

    With a constant learning rate ``η`` and ``τ_i`` steps, ``S_i = η τ_i`` and this is the paper's update for plain
    SGD (``a_i = τ_i``): ``x⁺ = x - τ_eff Σ_i p_i (x - y_i) / τ_i`` with ``τ_eff = Σ_i p_i τ_i``. Measuring steps by
    their learning rates keeps it right under schedules and warm-up. With momentum the paper's ``a_i`` is
    ``(τ_i - ρ(1 - ρ^τ_i)/(1 - ρ)) / (1 - ρ)``, proportional to ``τ_i`` once ``τ_i`` is past a few ``1/(1 - ρ)``:
    the common factor cancels between the normalization and ``S_eff``.

    FedAvg (``LocalUpdates``) averages ``y_i`` weighted by samples, so a peer's pull grows with its number of steps:
    its fixed point minimises an objective weighted toward the fastest peers. FedNova's is the minimum of
    ``Σ_i p_i f_i``, up to the drift of local steps themselves (O(lr), as for FedAvg with equal steps).
    Every peer that stepped weighs the same (``p_i = 1/n``): weights following each round's samples would bring the
    speed-weighting back.

    With ``exchange=KeepLocal(...)`` the kept parameters are neither normalized nor sent: the inner optimizer alone
    trains them (``Anchored``).

    Costs an anchor (1x the trainable parameters, fp32, on the CPU) and one scalar per param group in each round.
    ``Mean()``'s default norm bound applies to ``S_i`` as to any averaged part: a peer whose ``S_i`` exceeds 10x the
    group's median counts as if it had that much (``Mean(max_norm_ratio=None)`` lifts it).
    """

    name = "fednova"

    def averaging_weight(self) -> float:
        return 1.0 if self._samples > 0 else 0.0

    def buffer_templates(self) -> List[torch.Tensor]:
        """The parameters' slots carry ``d_i``; one more tensor carries ``S_i`` per param group."""
        return super().buffer_templates() + [torch.zeros(len(self.lr_sums.values), dtype=torch.float64)]

    def write_round(self, buffers: Sequence[torch.Tensor]) -> None:
        super().write_round(buffers)  # y_i (and averaged optimizer statistics)
        for slot, x, group in self._slots(buffers):
            lr_sum = self.lr_sums.values[group]
            if lr_sum > 0:
                slot.neg_().add_(x).div_(lr_sum)  # d_i = (x - y_i) / S_i
            else:
                slot.zero_()  # no completed step: the peer did not move
        buffers[-1].copy_(torch.tensor(self.lr_sums.values, dtype=buffers[-1].dtype))

    def apply_round(self, result: AveragingResult) -> None:
        if result.averaged is not None:  # (alone, the parameters already hold the result: x - S_i d_i = y_i)
            lr_effective = result.averaged[-1].tolist()
            for slot, x, group in self._slots(result.averaged):
                slot.mul_(-lr_effective[group]).add_(x)  # x⁺ = x - S_eff · mean(d), copied into the parameters
        super().apply_round(result)

    def _slots(self, buffers: Sequence[torch.Tensor]) -> Iterator[Tuple[torch.Tensor, torch.Tensor, int]]:
        """(the buffer of each averaged trainable parameter, its anchor ``x``, the index of its param group)."""
        position = {p: i for i, p in enumerate(self.shared)}  # the buffers' order (KeepLocal's are not in them)
        anchors = iter(self.anchor.tensors)
        for index, group in enumerate(self.anchor.groups):
            for p in group:
                yield buffers[position[p]], next(anchors), index
