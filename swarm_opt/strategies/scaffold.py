"""SCAFFOLD (Karimireddy et al., 2020, option II) without a server, as specified in shared ALGORITHMS.md §3.

Each peer keeps one tensor per trainable parameter, ``d_i = c - c_i``. After every completed inner step the weights
are corrected, ``p <- p - lr_k * d_i`` (after the step, never through the gradient: momentum would amplify it), and
``S_i`` accumulates the step's learning rate. At a round the peer sends its parameters ``y_i`` and
``u_i = z_i - d_i`` with ``z_i = (x - y_i) / S_i``; with the group's weighted means it sets

    d_i <- mean_w(u) - u_i  =  d_i + mean_w(z) - z_i - mean_w(d)

which is the exact option-II control update followed by re-centring on the group's weighted mean control. That is
the rule of ALGORITHMS.md (re-centre when members or weights changed) applied every round: when neither changed,
``Σ w_i d_i`` is already 0 and re-centring is a no-op, so it costs nothing to always do it, and it needs no extra
tensor. ``Σ w_i d_i = 0`` then holds in every group after every round, a departed peer leaves no bias, and a peer
that missed the round keeps its ``d``. A failed round or a round alone leaves ``d`` unchanged. (Moshpit-style
rotating partial groups would need the non-recentred K-GT form, sending ``z`` alone; swarm_opt averages the whole
swarm in one group per round, where partial groups only come from failures.)
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Sequence

import torch

from swarm_opt.averaging import AveragingResult
from swarm_opt.errors import ConfigError, IncompatibleStateError
from swarm_opt.strategies.base import state_dtype
from swarm_opt.strategies.local_updates import LocalUpdates, _checked_tensors, _copy_into, _entry


class Scaffold(LocalUpdates):
    """LocalUpdates with SCAFFOLD control variates; corrects client drift on non-IID data.

    Supports ``torch.optim.SGD`` (with or without momentum). Other inner optimizers are refused: SCAFFOLD's
    correction assumes the step is ``lr * gradient``, and no public work validates it with adaptive optimizers.
    """

    name = "scaffold"

    def bind(self, params: Sequence[torch.Tensor], inner: torch.optim.Optimizer) -> None:
        # Opacus's DPOptimizer wraps an SGD and steps lr * the noised gradient (DP-SGD, swarm_opt.privacy)
        if type(getattr(inner, "original_optimizer", inner)) is not torch.optim.SGD:
            raise ConfigError(
                f"Scaffold supports torch.optim.SGD (with or without momentum), not {type(inner).__name__}: its "
                f"control variates assume steps of lr * gradient. Use optimizer=lambda p: torch.optim.SGD(p, lr=..., "
                f"momentum=0.9), or LocalUpdates()/DiLoCo() with adaptive optimizers"
            )
        super().bind(params, inner)
        self._groups = [[p for p in group["params"] if p.requires_grad] for group in inner.param_groups]
        trainable = [p for group in self._groups for p in group]
        self._d = {p: torch.zeros_like(p, dtype=state_dtype(p)) for p in trainable}
        self._anchor = {p: p.detach().to(state_dtype(p), copy=True) for p in trainable}
        self._index = {p: i for i, p in enumerate(trainable)}
        self._lr_sums = [0.0 for _ in self._groups]

    def averaging_weight(self) -> float:
        """Every peer that stepped counts once. SCAFFOLD's fixed point is the optimum of ``Σ w_i f_i`` only if each
        peer's weight stays the same from round to round; the samples of a round follow each peer's speed, which
        would move the target every round (simulated: 0.27 vs 0.013 from the optimum with ±15 % step jitter)."""
        return 1.0 if self._samples > 0 else 0.0

    @property
    def controls(self) -> List[torch.Tensor]:
        """``d_i = c - c_i`` for every trainable parameter, in parameter order."""
        return list(self._d.values())

    def after_inner_step(self) -> None:
        for index, group in enumerate(self.inner.param_groups):
            lr = float(group["lr"])
            self._lr_sums[index] += lr
            params = [p.detach() for p in self._groups[index]]
            controls = [self._d[p].to(p.dtype) for p in self._groups[index]]
            if params:
                torch._foreach_add_(params, controls, alpha=-lr)  # one fused call, not one per tensor

    def tensors_to_average(self) -> List[torch.Tensor]:
        """The parameters (and averaged optimizer statistics), then one ``u`` per control; ``u`` is written straight
        into the averaging buffers by ``write_round``, so the controls here only give its shapes."""
        return super().tensors_to_average() + self.controls

    def write_round(self, buffers: Sequence[torch.Tensor]) -> None:
        own = super().tensors_to_average()
        for buffer, tensor in zip(buffers, own):
            buffer.copy_(tensor.detach())
        u_buffers = iter(buffers[len(own):])
        for group, lr_sum in zip(self._groups, self._lr_sums):
            for p in group:
                u = next(u_buffers)
                if lr_sum > 0:
                    torch.sub(self._anchor[p], p.detach(), out=u).div_(lr_sum)  # z_i
                else:
                    u.zero_()  # no completed step this round: the peer did not move
                u.sub_(self._d[p])

    def apply_round(self, result: AveragingResult) -> None:
        if result.group_size > 1 and result.averaged is not None:  # alone, d must stay as it is
            # d <- mean(u) - u_i with u_i = z_i - d_i recomputed from the anchor and the parameters, which still hold
            # this peer's y_i (the average is copied into them below): no tensor keeps u_i through the round
            mean_u = result.averaged[len(result.averaged) - len(self._d):]
            for group, lr_sum in zip(self._groups, self._lr_sums):
                for p in group:
                    d, mean = self._d[p], mean_u[self._index[p]]
                    d.add_(mean.to(d.device, d.dtype))
                    if lr_sum > 0:
                        d.sub_(self._anchor[p], alpha=1.0 / lr_sum).add_(p.detach(), alpha=1.0 / lr_sum)
        super().apply_round(result)
        self._restart_round()

    def reset(self) -> None:
        """After downloading the swarm's state the peer is a newcomer: it starts the round from the swarm's anchor
        ``x`` (not from the donor's half-trained local model, so that its ``z`` is measured from the same ``x`` as
        everyone's) with zero controls."""
        super().reset()
        for d in self._d.values():
            d.zero_()
        for p, x in self._anchor.items():
            p.detach().copy_(x)
        self._lr_sums = [0.0 for _ in self._groups]

    def keeps_local_state_when_behind(self, missed_rounds: int) -> bool:
        """A peer that missed a round has an outdated anchor ``x``: its ``z`` would be measured from the wrong point
        and bias everyone's controls (seen in a 4-peer swarm: 0.03 -> 1.1 from the optimum). It downloads."""
        return False

    def _restart_round(self) -> None:
        for p, x in self._anchor.items():
            x.copy_(p.detach())
        self._lr_sums = [0.0 for _ in self._groups]

    def state_dict(self) -> Dict[str, Any]:
        return {"controls": [d.clone() for d in self._d.values()],
                "anchor": [x.clone() for x in self._anchor.values()], "lr_sums": list(self._lr_sums)}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        lr_sums = _entry(state, "lr_sums")
        if not isinstance(lr_sums, list) or len(lr_sums) != len(self._groups) \
                or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < math.inf
                           for v in lr_sums):
            raise IncompatibleStateError("Scaffold lr_sums: expected one finite number >= 0 per param group")
        controls, anchor = list(self._d.values()), list(self._anchor.values())
        saved_controls = _checked_tensors(controls, state.get("controls"), "Scaffold controls")
        saved_anchor = _checked_tensors(anchor, state.get("anchor"), "Scaffold anchor")
        _copy_into(controls, saved_controls)
        _copy_into(anchor, saved_anchor)
        self._lr_sums = [float(v) for v in lr_sums]
