"""The inner optimizer's statistics (SGD's momentum buffers, Adam's moments and step) as rounds average them.

``LocalUpdates(average_optimizer_state=names)`` averages the statistics its user names, over the averaged parameters.
``GradientAveraging`` in groups averages every statistic the inner optimizer keeps, so that the members of a group
start the round's step from one state: which ones is found by a probe, one step of a copy of the inner optimizer on a
two-element parameter per parameter group (any ``torch.optim.Optimizer`` built as ``type(inner)(param_groups)``).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch

from swarm_opt.errors import ConfigError
from swarm_opt.strategies.base import state_dtype


class OptimizerStatistics:
    """Statistics ``(parameter, name)`` of an inner optimizer, each read live at every round.

    A statistic the optimizer has not created yet (before its first step) is averaged as a zero template: the
    group's mean lands in the template and changes nothing here, except where ``adopt`` may create it.
    """

    def __init__(self, inner: torch.optim.Optimizer, entries: Sequence[Tuple[torch.Tensor, str, torch.Tensor]],
                 creatable: Sequence[Tuple[torch.dtype, torch.device]] = ()) -> None:
        self.inner = inner
        self.entries = [(p, name) for p, name, _ in entries]
        self._templates = [template for _, _, template in entries]
        #: ``kept_by``: the dtype and device of each statistic as the optimizer creates it (its entries are all the
        #: optimizer keeps, so a state can be made of them); otherwise empty
        self._creatable = list(creatable)

    @classmethod
    def named(cls, inner: torch.optim.Optimizer, params: Sequence[torch.Tensor], names: Sequence[str]
              ) -> OptimizerStatistics:
        """The statistics ``names`` of every parameter in ``params``, shaped as the parameter (name by name)."""
        return cls(inner, [(p, name, torch.zeros_like(p, dtype=state_dtype(p))) for name in names for p in params])

    @classmethod
    def kept_by(cls, inner: torch.optim.Optimizer) -> OptimizerStatistics:
        """Every statistic ``inner`` keeps per parameter (floating point, shaped as the parameter or a scalar such
        as Adam's ``step``), found by a probe step; a ``ConfigError`` if the probe fails or finds others."""
        entries, creatable = [], []
        for group in inner.param_groups:
            if not group["params"]:
                continue
            kept = _probe(inner, group)
            for p in group["params"]:
                for name, value in kept.items():
                    shape = p.shape if value.dim() else ()
                    entries.append((p, name, torch.zeros(shape, dtype=state_dtype(value))))
                    creatable.append((value.dtype, value.device))
        return cls(inner, entries, creatable)

    def tensors(self) -> List[torch.Tensor]:
        """The live statistics, in the entries' order (templates where missing or of another shape)."""
        stats = []
        for (p, name), template in zip(self.entries, self._templates):
            live = self._live(p, name, template)
            stats.append(template if live is None else live)
        return stats

    def adopt(self, means: Sequence[torch.Tensor]) -> None:
        """Take a group's means (in the entries' order) as this peer's statistics. With ``kept_by``'s entries, a
        parameter the optimizer keeps no state for yet gets the means as its state where a member had one (a mean
        not zero), so that it steps as its groupmates do; otherwise a missing statistic stays missing."""
        missing: Dict[torch.Tensor, Dict[str, torch.Tensor]] = {}
        for i, ((p, name), template, mean) in enumerate(zip(self.entries, self._templates, means)):
            live = self._live(p, name, template)
            if live is not None:
                live.copy_(mean)
            elif self._creatable:
                dtype, device = self._creatable[i]
                missing.setdefault(p, {})[name] = mean.to(device=device, dtype=dtype, copy=True)
        for p, state in missing.items():
            if not self.inner.state.get(p) and any(bool(value.any()) for value in state.values()):
                self.inner.state[p] = state

    def _live(self, p: torch.Tensor, name: str, template: torch.Tensor) -> Optional[torch.Tensor]:
        value = self.inner.state.get(p, {}).get(name)
        return value if isinstance(value, torch.Tensor) and value.shape == template.shape else None


def _probe(inner: torch.optim.Optimizer, group: dict) -> Dict[str, torch.Tensor]:
    """The statistics one step of ``type(inner)`` with ``group``'s settings creates for a parameter like the
    group's first: floating-point tensors shaped as the parameter, or scalars."""
    first = group["params"][0]
    probe = torch.zeros(2, dtype=first.dtype, device=first.device, requires_grad=True)
    settings = {key: value for key, value in group.items() if key != "params"}
    fix = "Use a torch.optim optimizer, or groups=None"
    try:
        copy = type(inner)([{**settings, "params": [probe]}])
        probe.grad = torch.ones_like(probe)
        copy.step()
    except Exception as e:  # noqa: BLE001 - any optimizer's own error: the user's fix is the same
        raise ConfigError(
            f"GradientAveraging in groups averages the inner optimizer's statistics, and could not find those of "
            f"{type(inner).__name__} (a probe step of {type(inner).__name__}(param_groups) failed: {e!r}). {fix}"
        ) from e
    state = copy.state[probe]
    kept = {name: value for name, value in state.items() if isinstance(value, torch.Tensor)
            and value.is_floating_point() and value.shape in (probe.shape, ())}
    others = sorted(str(name) for name in state if name not in kept)
    if others:
        raise ConfigError(
            f"GradientAveraging in groups averages the inner optimizer's statistics, and {type(inner).__name__} "
            f"keeps some it cannot average ({', '.join(others)}: not floating-point tensors shaped as their "
            f"parameter). {fix}")
    return kept
