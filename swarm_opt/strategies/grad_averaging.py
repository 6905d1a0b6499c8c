"""Synchronous large-batch training: accumulate toward the global batch, average gradients, step together; or, with
``Overlap()``, average each round's gradients in the background while the next round's are computed."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

import torch

from swarm_opt.averaging import AveragingResult
from swarm_opt.config import Groups
from swarm_opt.errors import ConfigError, ConfigTypeError
from swarm_opt.groups import ONE_GROUP, RoundPlan
from swarm_opt.round import Round
from swarm_opt.strategies.base import Strategy, grads_are_finite, state_dtype


@dataclass(frozen=True)
class Overlap:
    """Average a round's gradients in the background while the peer computes the next round's (delayed updates):
    ``GradientAveraging(overlap=Overlap())``.

    When the swarm reaches the global batch, the peer sets its accumulated gradients aside for the round and goes on
    computing; the round's update is applied at the first ``step()`` after the all-reduce finished. **Staleness:**
    gradients computed while a round is in flight use parameters one update behind, so a round that takes a fraction
    ``f`` of an epoch's compute leaves about ``f`` of the next epoch's gradients one step stale (all of them when
    averaging is slower than computing: then this is one-step-delayed SGD, as hivemind's ``delay_optimizer_step``).
    Never more than one step: a round starts only after the previous one was applied. A round that fails gives its
    gradients back to the next round, as without overlap.

    Costs one more fp32 buffer per parameter (the round set aside while the next one accumulates). Worth it when
    the all-reduce takes a noticeable share of an epoch (large models, slow links); it does not change the maths of
    a round, so every peer still applies the same update.
    """


class GradientAveraging(Strategy):
    """Each peer keeps the sample-weighted mean of its gradients since the last round; the swarm all-reduces these
    means weighted by samples and every peer applies the inner optimizer to the same average. Without failures and
    compression this equals one process training on the union of all peers' batches.

    :param overlap: ``Overlap()`` averages in the background while the next round's gradients are computed (see
        ``Overlap`` for the staleness this implies). Default: rounds block ``step()`` until they are applied.

    Extra memory: one fp32 buffer per parameter (the running mean) plus hivemind's averaging buffer; one more with
    ``Overlap()``.
    """

    name = "grad"

    def __init__(self, *, overlap: Optional[Overlap] = None) -> None:
        if overlap is not None and not isinstance(overlap, Overlap):
            raise ConfigTypeError(f"overlap must be swarm_opt.Overlap() or None, got {overlap!r}")
        self.overlap = overlap

    @property
    def shares_parameters(self) -> bool:
        return True

    def bind(self, params: Sequence[torch.Tensor], inner: torch.optim.Optimizer) -> None:
        super().bind(params, inner)
        self._mean = [torch.zeros_like(p, dtype=state_dtype(p)) for p in self.params]
        self._samples = 0
        self._spare: Optional[List[torch.Tensor]] = None  # a zeroed mean to accumulate into while a round is held
        self._held: Optional[_HeldGradients] = None  # a round set aside (Overlap), until it is applied or given back

    def local_step(self, batch_size: int) -> bool:
        grads = [p.grad for p in self.params if p.grad is not None]
        if not grads_are_finite(grads):
            return False
        fraction = batch_size / (self._samples + batch_size)
        for mean, p in zip(self._mean, self.params):
            if p.grad is None:
                mean.mul_(1.0 - fraction)
            else:
                mean.lerp_(p.grad.detach().to(mean.dtype), fraction)
        self._samples += batch_size
        return True

    def buffer_templates(self) -> List[torch.Tensor]:
        return self._mean

    def write_round(self, buffers: Sequence[torch.Tensor]) -> None:
        for buffer, mean in zip(buffers, self._mean):
            buffer.copy_(mean)

    def averaging_weight(self) -> float:
        return float(self._samples)

    def apply_round(self, result: AveragingResult) -> None:
        self._step_with(self._mean if result.averaged is None else result.averaged)
        self.reset()

    def use_groups(self, groups: Groups) -> None:
        """Refused. Gradient averaging's promise is sync-equivalence: every peer applies the same mean gradient of
        the global batch, so every peer holds the same parameters, those of one process training on all batches.
        With groups each group would step on its own group's mean gradient and the peers' parameters would drift
        apart for good (nothing averages parameters back). Averaging the parameters is what LocalUpdates does."""
        raise ConfigError(
            f"GradientAveraging cannot average in groups ({groups!r}): every peer must apply the same global "
            f"gradient to stay identical (sync-equivalence), and groups would let peers diverge. For large swarms use "
            f"strategy=LocalUpdates() (or Scaffold() on non-IID data) with groups={groups!r}, or groups=None")

    def begin_round(self, plan: RoundPlan = ONE_GROUP) -> Round:
        """Without overlap, a round over the running mean (the loop waits for it); with ``Overlap()`` the round
        takes the mean with it (the loop polls it) and the next round accumulates into a spare buffer."""
        self.round_plan = plan
        if self.overlap is None:
            return super().begin_round(plan)
        assert self._held is None, "one round at a time"
        spare = self._spare if self._spare is not None else [torch.zeros_like(m) for m in self._mean]
        self._held = _HeldGradients(self, self._mean, self._samples)
        self._mean, self._spare, self._samples = spare, None, 0
        return self._held

    def _step_with(self, means: Sequence[torch.Tensor]) -> None:
        for p, mean in zip(self.params, means):
            # the averaged buffer itself when it fits: no copy (it is not touched again until the next round)
            p.grad = mean if (mean.dtype, mean.device) == (p.dtype, p.device) else mean.to(p.device, p.dtype)
        self.inner.step()
        for p in self.params:
            p.grad = None

    def _release(self, held: _HeldGradients) -> None:
        for mean in held.means:
            mean.zero_()
        self._spare, self._held = held.means, None

    def reset(self) -> None:
        for mean in self._mean:
            mean.zero_()
        self._samples = 0
        if self._held is not None:
            self._release(self._held)

    def state_dict(self) -> Dict[str, Any]:
        # a round's partial accumulation is local and transient: a resumed or newly joined peer starts a fresh one
        return {}


class _HeldGradients(Round):
    """The mean gradient of a round set aside while it is averaged in the background."""

    in_background = True

    def __init__(self, owner: GradientAveraging, means: List[torch.Tensor], samples: int) -> None:
        self.owner, self.means, self.samples = owner, means, samples

    @property
    def weight(self) -> float:
        return float(self.samples)

    def write(self, buffers: Sequence[torch.Tensor]) -> None:
        for buffer, mean in zip(buffers, self.means):
            buffer.copy_(mean)

    def apply(self, result: AveragingResult) -> None:
        if self.owner._held is self:  # not dropped by a reset meanwhile
            self.owner._step_with(self.means if result.averaged is None else result.averaged)
            self.owner._release(self)

    def give_back(self) -> None:
        if self.owner._held is not self:
            return
        owner, total = self.owner, self.samples + self.owner._samples
        if total > 0:  # the pooled mean: what one accumulation over both would hold
            for mean, held in zip(owner._mean, self.means):
                mean.lerp_(held, self.samples / total)
        owner._samples = total
        owner._release(self)
