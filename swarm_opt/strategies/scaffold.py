"""SCAFFOLD (Karimireddy et al., 2020, option II) without a server, as specified in docs/algorithms.md.

Each peer keeps one tensor per trainable parameter, ``d_i = c - c_i``. After every completed inner step the weights
are corrected, ``p <- p - lr_k * d_i`` (after the step, never through the gradient: momentum would amplify it), and
``S_i`` accumulates the step's learning rate. At a round the peer sends its parameters ``y_i`` and
``u_i = z_i - d_i`` with ``z_i = (x - y_i) / S_i``; with the group's weighted means it sets

    d_i <- mean_w(u) - u_i  =  d_i + mean_w(z) - z_i - mean_w(d)

which is the exact option-II control update followed by re-centring on the group's weighted mean control. That is
the rule of docs/algorithms.md (re-centre when members or weights changed) applied every round: when neither changed,
``Σ w_i d_i`` is already 0 and re-centring is a no-op, so it costs nothing to always do it, and it needs no extra
tensor. ``Σ w_i d_i = 0`` then holds in every group after every round, a departed peer leaves no bias, and a peer
that missed the round keeps its ``d``. A failed round or a round alone leaves ``d`` unchanged.

**Moshpit groups** (``swarm_opt.groups``): a round averages in one line of a grid, along one dimension, and lines
hold different parameters between rounds. Such rounds send ``z_i`` alone and use the K-GT form (Liu et al., 2023),
``d_i <- d_i + mean_w(z) - z_i``: each group keeps its ``Σ w_i d_i``, so the swarm's stays 0 (the groups partition
the swarm). Re-centring on the line's mean instead would pull each control toward its *line's* mean gradient: at
the optimum ``w*`` (``d_i = -g_i(w*)``) it would set ``d_i = mean_line(g(w*)) - g_i(w*)`` and move the peers away
again. With K-GT the optimum is a fixed point (``z_i = 0`` there), and with stationary gradients a pass over the
dimensions of a complete grid gives every peer the swarm's correction ``d_i = mean(g) - g_i``, as one group would.
The price: ``Σ w_i d_i = 0`` holds per swarm, not per group, and churn is not re-centred: a peer that leaves takes
its ``d_i`` with it and the swarm's sum drifts by it (a newcomer's ``d = 0`` adds nothing). One line (a swarm of
at most ``Groups.size`` peers, or no groups) re-centres as above.
"""

from __future__ import annotations

from typing import Any, Dict, List, Sequence

import torch

from swarm_opt.buffers import AveragingResult
from swarm_opt.config import Groups
from swarm_opt.errors import ConfigError
from swarm_opt.strategies.anchor import checked_tensors, copy_into, entry
from swarm_opt.strategies.base import state_dtype
from swarm_opt.strategies.local_updates import Anchored


class Scaffold(Anchored):
    """LocalUpdates with SCAFFOLD control variates; corrects client drift on non-IID data.

    Supports ``torch.optim.SGD`` (with or without momentum). Other inner optimizers are refused: SCAFFOLD's
    correction assumes the step is ``lr * gradient``, and no public work validates it with adaptive optimizers.

    With ``exchange=KeepLocal(...)`` (FedPer, FedBN) the kept parameters have no control: each peer's own objective is
    the only one they serve, so there is no drift to correct (``c_i = c``); they are trained by the inner optimizer
    alone and nothing of them is sent.
    """

    name = "scaffold"
    dp_safe = True  # controls are computed from the model's change over DP-SGD steps
    supports_groups = True

    def use_groups(self, groups: Groups) -> None:
        """Accepted: the next round starts from the group's mean, and rounds in partial groups update the controls
        in the K-GT form (module docstring)."""

    def bind(self, params: Sequence[torch.Tensor], inner: torch.optim.Optimizer) -> None:
        # Opacus's DPOptimizer wraps an SGD and steps lr * the noised gradient (DP-SGD, swarm_opt.privacy)
        if type(getattr(inner, "original_optimizer", inner)) is not torch.optim.SGD:
            raise ConfigError(
                f"Scaffold supports torch.optim.SGD (with or without momentum), not {type(inner).__name__}: its "
                f"control variates assume steps of lr * gradient. Use optimizer=lambda p: torch.optim.SGD(p, lr=..., "
                f"momentum=0.9), or LocalUpdates()/DiLoCo() with adaptive optimizers"
            )
        super().bind(params, inner)
        self._d = [torch.zeros_like(p, dtype=state_dtype(p)) for p in self.anchor.params]

    def averaging_weight(self) -> float:
        """Every peer that stepped counts once. SCAFFOLD's fixed point is the optimum of ``Σ w_i f_i`` only if each
        peer's weight stays the same from round to round; the samples of a round follow each peer's speed, which
        would move the target every round (simulated: 0.27 vs 0.013 from the optimum with ±15 % step jitter)."""
        return 1.0 if self._samples > 0 else 0.0

    @property
    def controls(self) -> List[torch.Tensor]:
        """``d_i = c - c_i`` for every trainable parameter, in parameter order."""
        return self._d

    def after_inner_step(self) -> None:
        super().after_inner_step()
        start = 0
        for group, spec in zip(self.anchor.groups, self.inner.param_groups):
            controls = self._d[start:start + len(group)]
            start += len(group)
            if group:  # one fused call, not one per tensor
                torch._foreach_add_([p.detach() for p in group], [d.to(p.dtype) for d, p in zip(controls, group)],
                                    alpha=-float(spec["lr"]))

    def _per_parameter(self):
        """(parameter, its anchor x, its control d, its group's lr sum S) for every trainable parameter."""
        lr_sums = [s for group, s in zip(self.anchor.groups, self.lr_sums.values) for _ in group]
        return zip(self.anchor.params, self.anchor.tensors, self._d, lr_sums)

    def buffer_templates(self) -> List[torch.Tensor]:
        """The parameters (and averaged optimizer statistics), then one ``u`` per control."""
        return super().buffer_templates() + self.controls

    def write_round(self, buffers: Sequence[torch.Tensor]) -> None:
        """The parameters, then ``u_i = z_i - d_i`` (a round of the whole swarm) or ``z_i`` (a round in one line of a
        Moshpit grid, see the module docstring)."""
        super().write_round(buffers)
        u_buffers = buffers[len(buffers) - len(self._d):]
        for u, (p, x, d, lr_sum) in zip(u_buffers, self._per_parameter()):
            if lr_sum > 0:
                torch.sub(x, p.detach().to(x.device), out=u).div_(lr_sum)  # z_i
            else:
                u.zero_()  # no completed step this round: the peer did not move
            if self.round_plan.whole_swarm:
                u.sub_(d.to(u.device))

    def apply_round(self, result: AveragingResult) -> None:
        if result.group_size > 1 and result.averaged is not None:  # alone, d must stay as it is
            # d <- d + mean(u) - z_i (= mean(u) - u_i when u_i = z_i - d_i), z_i recomputed from the anchor and the
            # parameters, which still hold this peer's y_i (the average is copied into them below): no tensor keeps
            # u_i through the round
            mean_u = result.averaged[len(result.averaged) - len(self._d):]
            for mean, (p, x, d, lr_sum) in zip(mean_u, self._per_parameter()):
                d.add_(mean.to(d.device, d.dtype))
                if lr_sum > 0:
                    d.sub_(x.to(d.device), alpha=1.0 / lr_sum).add_(p.detach(), alpha=1.0 / lr_sum)
        super().apply_round(result)

    def reset(self) -> None:
        """After downloading the swarm's state the peer is a newcomer: it starts the round from the swarm's anchor
        ``x`` (not from the donor's half-trained local model, so that its ``z`` is measured from the same ``x`` as
        everyone's) with zero controls."""
        super().reset()
        for d in self._d:
            d.zero_()

    def state_dict(self) -> Dict[str, Any]:
        return {**super().state_dict(), "controls": [d.clone() for d in self._d]}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        controls = checked_tensors(self._d, entry(state, "controls"), "Scaffold controls")
        self.checked_state(state)()
        copy_into(self._d, controls)
