"""Local updates with periodic state averaging: local SGD / FedAvg without a server; FedProx on top of it; and
``Anchored``, the base of the variants whose rounds are measured from the swarm's starting point ``x``."""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Sequence

import torch

from swarm_opt.averaging import AveragingResult
from swarm_opt.config import Groups
from swarm_opt.errors import ConfigError, ConfigTypeError
from swarm_opt.strategies.anchor import Anchor, LrSums, entry
from swarm_opt.strategies.base import Strategy, grads_are_finite, state_dtype


class LocalUpdates(Strategy):
    """Every ``step()`` applies the inner optimizer at once; each round (one global epoch: the swarm processed
    ``target_batch_size`` samples) peers average their parameters weighted by the samples of the round.

    :param average_optimizer_state: names of inner-optimizer statistics to average with the parameters, e.g.
        ``("momentum_buffer",)`` for SGD or ``("exp_avg", "exp_avg_sq")`` for Adam. Default: none (kept local).

    A peer whose round failed keeps its local model and joins the next round; one that missed rounds goes on from
    its own model (it is averaged back in at the next round).
    """

    name = "local"

    def __init__(self, *, average_optimizer_state: Sequence[str] = ()) -> None:
        if isinstance(average_optimizer_state, str) or not all(isinstance(n, str) for n in average_optimizer_state):
            raise ConfigTypeError("average_optimizer_state must be a sequence of state names, e.g. ('exp_avg',)")
        self.average_optimizer_state = tuple(average_optimizer_state)

    def bind(self, params: Sequence[torch.Tensor], inner: torch.optim.Optimizer) -> None:
        super().bind(params, inner)
        self._samples = 0
        # statistics the inner optimizer has not created yet are averaged as zeros with zero effect on us
        self._stat_templates = [torch.zeros_like(p, dtype=state_dtype(p)) for _ in self.average_optimizer_state
                                for p in self.params]

    # --- the local step -------------------------------------------------------------------------------------------
    def local_step(self, batch_size: int) -> bool:
        grads = [p.grad for p in self.params if p.grad is not None]
        if not grads_are_finite(grads):
            return False
        self.before_inner_step()
        self.inner.step()
        self.after_inner_step()
        self._samples += batch_size
        return True

    def before_inner_step(self) -> None:
        """Hook for variants that change the gradient (FedProx)."""

    def after_inner_step(self) -> None:
        """Hook for variants that correct the weights after the step (SCAFFOLD)."""

    # --- the round ----------------------------------------------------------------------------------------------------
    def averaged_state(self) -> List[torch.Tensor]:
        """The live tensors a round averages as they are: the parameters, then the averaged optimizer statistics
        (the first entries of ``buffer_templates``, ``write_round`` and ``result.averaged``)."""
        return list(self.params) + self._optimizer_statistics()

    def _optimizer_statistics(self) -> List[torch.Tensor]:
        stats, i = [], 0
        for name in self.average_optimizer_state:
            for p in self.params:
                value = self.inner.state.get(p, {}).get(name)
                stats.append(value if isinstance(value, torch.Tensor) and value.shape == p.shape
                             else self._stat_templates[i])
                i += 1
        return stats

    def buffer_templates(self) -> List[torch.Tensor]:
        return self.averaged_state()

    def write_round(self, buffers: Sequence[torch.Tensor]) -> None:
        for buffer, tensor in zip(buffers, self.averaged_state()):
            buffer.copy_(tensor.detach())

    def averaging_weight(self) -> float:
        return float(self._samples)

    def apply_round(self, result: AveragingResult) -> None:
        if result.averaged is not None:
            for tensor, mean in zip(self.averaged_state(), result.averaged):
                tensor.detach().copy_(mean)
        self._samples = 0

    def reset(self) -> None:
        self._samples = 0

    def keeps_local_state_when_behind(self, missed_rounds: int) -> bool:
        return True

    def use_groups(self, groups: Groups) -> None:
        """Accepted: a round's mean is the group's, and the next rounds mix the groups (``swarm_opt.groups``)."""


class FedProx(LocalUpdates):
    """LocalUpdates with the proximal term ``mu/2 * ||y - x||^2`` pulling local steps toward the round's starting
    point ``x`` (Li et al., 2020): the gradient gets ``mu * (y - x)`` before each inner step.

    :param mu: strength of the pull; 0 is plain LocalUpdates. Typical values 0.001-1.
    """

    name = "fedprox"

    def __init__(self, mu: float = 0.01, *, average_optimizer_state: Sequence[str] = ()) -> None:
        super().__init__(average_optimizer_state=average_optimizer_state)
        if isinstance(mu, bool) or not isinstance(mu, (int, float)) or not mu >= 0:
            raise ConfigError(f"FedProx mu must be a non-negative number, got {mu!r}; e.g. FedProx(mu=0.01)")
        self.mu = float(mu)

    def bind(self, params: Sequence[torch.Tensor], inner: torch.optim.Optimizer) -> None:
        super().bind(params, inner)
        self.anchor = Anchor([self.params])  # the pull's centre: local, restarted from the parameters

    def before_inner_step(self) -> None:
        for p, x in zip(self.anchor.params, self.anchor.tensors):
            if p.grad is not None:
                p.grad.add_((p.detach() - x.to(p.device, p.dtype)), alpha=self.mu)

    def apply_round(self, result: AveragingResult) -> None:
        super().apply_round(result)
        self.anchor.restart()

    def reset(self) -> None:
        super().reset()
        self.anchor.restart()

    def state_dict(self) -> Dict[str, Any]:
        return {"anchor": self.anchor.state()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.anchor.load(self.anchor.check(entry(state, "anchor"), "FedProx anchor"))


class Anchored(LocalUpdates):
    """LocalUpdates measured from the swarm's starting point of the round, ``x`` (``self.anchor``, over the trainable
    parameters), with ``self.lr_sums`` the learning rates spent since: DiLoCo, SCAFFOLD and FedNova build on it,
    overriding what a round sends (``buffer_templates``, ``write_round``), what it makes of the group's mean
    (``apply_round``; ``super().apply_round`` copies the mean into the parameters) and where the next round starts
    (``start_next_round``).

    ``x`` is the swarm's: every peer ends a committed round from the same one, a peer that missed a round holds an
    outdated ``x`` and downloads the swarm's state, and after a download it continues from the swarm's ``x`` (not
    from the donor's half-finished local model). ``x`` and the learning rates spent since are part of the state.
    """

    def bind(self, params: Sequence[torch.Tensor], inner: torch.optim.Optimizer) -> None:
        super().bind(params, inner)
        self.anchor = Anchor.of_trainable(inner)
        self.lr_sums = LrSums(inner)

    def after_inner_step(self) -> None:
        self.lr_sums.add_step()

    def apply_round(self, result: AveragingResult) -> None:
        super().apply_round(result)
        self.start_next_round()

    def start_next_round(self) -> None:
        """The round's result is in the parameters; the next round starts from them: ``x <- p``."""
        self.anchor.restart()
        self.lr_sums.clear()

    def reset(self) -> None:
        super().reset()
        self.anchor.restore()
        self.lr_sums.clear()

    def keeps_local_state_when_behind(self, missed_rounds: int) -> bool:
        """No: this peer's ``x`` is a round behind the swarm's, and its next update would be measured from it."""
        return False

    def use_groups(self, groups: Groups) -> None:
        """Refused unless the variant says otherwise: members of a group then come from different groups of the
        previous round and hold different anchors ``x``, so an update measured from each member's own ``x``
        (FedNova's ``x - S_eff mean(d)``, DiLoCo's outer step with each peer's outer state) would leave the members
        of one group with different parameters. SCAFFOLD restarts ``x`` from the group's mean and accepts groups."""
        raise ConfigError(
            f"{type(self).__name__} does not average in groups yet ({groups!r}): its rounds step from the swarm's "
            f"common anchor x, which groups do not share. Use LocalUpdates(), FedProx() or Scaffold() with groups, "
            f"or groups=None")

    def state_dict(self) -> Dict[str, Any]:
        return {"anchor": self.anchor.state(), "lr_sums": list(self.lr_sums.values)}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.checked_state(state)()

    def checked_state(self, state: Any) -> Callable[[], None]:
        """Check this class's parts of a saved state; the function returned loads them. A subclass loads its own
        parts only once every part was checked: a state that does not fit changes nothing."""
        name = type(self).__name__
        lr_sums = self.lr_sums.check(entry(state, "lr_sums"), f"{name} lr_sums")
        anchor = self.anchor.check(state.get("anchor"), f"{name} anchor")

        def load() -> None:
            self.anchor.load(anchor)
            self.lr_sums.values = lr_sums
        return load
