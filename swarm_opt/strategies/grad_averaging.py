"""Synchronous large-batch training: accumulate toward the global batch, average gradients, step together."""

from __future__ import annotations

from typing import Any, Dict, List, Sequence

import torch

from swarm_opt.averaging import AveragingResult
from swarm_opt.strategies.base import Strategy, grads_are_finite, state_dtype


class GradientAveraging(Strategy):
    """Each peer keeps the sample-weighted mean of its gradients since the last round; the swarm all-reduces these
    means weighted by samples and every peer applies the inner optimizer to the same average. Without failures and
    compression this equals one process training on the union of all peers' batches.

    Extra memory: one fp32 buffer per parameter (the running mean) plus hivemind's averaging buffer.
    """

    name = "grad"

    def bind(self, params: Sequence[torch.Tensor], inner: torch.optim.Optimizer) -> None:
        super().bind(params, inner)
        self._mean = [torch.zeros_like(p, dtype=state_dtype(p))
                      for p in self.params]
        self._samples = 0

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

    def tensors_to_average(self) -> List[torch.Tensor]:
        return self._mean

    def averaging_weight(self) -> float:
        return float(self._samples)

    def apply_round(self, result: AveragingResult) -> None:
        means = self._mean if result.averaged is None else result.averaged
        for p, mean in zip(self.params, means):
            # the averaged buffer itself when it fits: no copy (it is not touched again until the next round)
            p.grad = mean if (mean.dtype, mean.device) == (p.dtype, p.device) else mean.to(p.device, p.dtype)
        self.inner.step()
        for p in self.params:
            p.grad = None
        self.reset()

    def reset(self) -> None:
        for mean in self._mean:
            mean.zero_()
        self._samples = 0

    def state_dict(self) -> Dict[str, Any]:
        # a round's partial accumulation is local and transient: a resumed or newly joined peer starts a fresh one
        return {}
