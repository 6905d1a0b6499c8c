"""Local updates with periodic state averaging: local SGD / FedAvg without a server; FedProx on top of it; and
``Anchored``, the base of the variants whose rounds are measured from the swarm's starting point ``x``."""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from swarm_opt.buffers import AveragingResult
from swarm_opt.config import Groups
from swarm_opt.errors import ConfigError, ConfigTypeError, IncompatibleStateError
from swarm_opt.strategies.adaptive import AdaptiveMu
from swarm_opt.strategies.anchor import Anchor, LrSums, entry
from swarm_opt.strategies.base import MAX_ROUNDS_ON_LOCAL_STATE, Strategy, grads_are_finite
from swarm_opt.strategies.partial import DriftedLayers, KeepLocal, mean_over_senders, send_selected
from swarm_opt.strategies.peer_dp import PeerDP
from swarm_opt.strategies.shared_scalars import SharedScalars
from swarm_opt.strategies.statistics import OptimizerStatistics


class LocalUpdates(Strategy):
    """Every ``step()`` applies the inner optimizer at once; each round (one global epoch: the swarm processed
    ``target_batch_size`` samples) peers average their parameters weighted by the samples of the round.

    :param average_optimizer_state: names of inner-optimizer statistics to average with the parameters, e.g.
        ``("momentum_buffer",)`` for SGD or ``("exp_avg", "exp_avg_sq")`` for Adam. Default: none (kept local).
    :param exchange: ``KeepLocal(model, where)``: parameters that never leave this peer (FedBN, FedPer); the others
        are averaged. Default: all are averaged.
    :param select: ``DriftedLayers(threshold)``: each round, send only the layers that drifted since the last average
        (the others travel as zeros, flagged); each layer is averaged over the members that sent it.
    :param peer_dp: ``PeerDP(noise_multiplier=..., clip=...)``: each round's update is clipped and noised before it
        leaves the peer (DP-FedAvg, with ``AdaptiveClip`` for adaptive clipping); every peer then weighs the same.

    A peer whose round failed keeps its local model and joins the next round; one that missed rounds goes on from
    its own model (it is averaged back in at the next round).
    """

    name = "local"
    dp_safe = True  # every round sends parameters (and statistics) that DP-SGD steps computed
    supports_groups = True

    def __init__(self, *, average_optimizer_state: Sequence[str] = (), exchange: Optional[KeepLocal] = None,
                 select: Optional[DriftedLayers] = None, peer_dp: Optional[PeerDP] = None) -> None:
        if isinstance(average_optimizer_state, str) or not all(isinstance(n, str) for n in average_optimizer_state):
            raise ConfigTypeError("average_optimizer_state must be a sequence of state names, e.g. ('exp_avg',)")
        if exchange is not None and not isinstance(exchange, KeepLocal):
            raise ConfigTypeError(f"exchange must be None or swarm_opt.KeepLocal(model, where), got {exchange!r}")
        if peer_dp is not None and not isinstance(peer_dp, PeerDP):
            raise ConfigTypeError(f"peer_dp must be None or swarm_opt.PeerDP(noise_multiplier=..., clip=...), "
                                  f"got {peer_dp!r}")
        if select is not None and not isinstance(select, DriftedLayers):
            raise ConfigTypeError(f"select must be None or swarm_opt.DriftedLayers(threshold), got {select!r}")
        if select is not None and peer_dp is not None:
            raise ConfigError("select=DriftedLayers(...) chooses the layers to send from the data, a choice PeerDP "
                              "does not privatise (the flags travel in clear): drop one of them")
        if peer_dp is not None and average_optimizer_state:
            raise ConfigError("peer_dp=PeerDP(...) clips and noises the parameters' update only: averaged optimizer "
                              "statistics would leave the peer unprotected; drop average_optimizer_state")
        self.average_optimizer_state = tuple(average_optimizer_state)
        self.exchange, self.select, self.peer_dp = exchange, select, peer_dp

    def bind(self, params: Sequence[torch.Tensor], inner: torch.optim.Optimizer) -> None:
        super().bind(params, inner)
        self._samples = 0
        kept = self.exchange.split(self.params) if self.exchange is not None else [False] * len(self.params)
        #: the parameters a round averages, and those that stay on this peer (``exchange``)
        self.shared = [p for p, keep in zip(self.params, kept) if not keep]
        self.personal = [p for p, keep in zip(self.params, kept) if keep]
        self._statistics = OptimizerStatistics.named(inner, self.shared, self.average_optimizer_state)
        if self.peer_dp is not None:
            self.peer_dp.bind(self.shared)
        if self.select is not None:
            self.select.bind(self.shared)

    def personal_parameters(self) -> List[torch.Tensor]:
        return list(self.personal)

    def epsilon(self) -> Optional[float]:
        """``peer_dp``'s ε so far (with ``PeerDP(..., delta=...)``; otherwise None)."""
        return None if self.peer_dp is None else self.peer_dp.epsilon()

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
        """The live tensors a round averages as they are: the shared parameters, then the averaged optimizer
        statistics (the first entries of ``buffer_templates``, ``write_round`` and ``result.averaged``; with
        ``peer_dp``'s adaptive clipping one more small tensor follows them)."""
        return list(self.shared) + self._statistics.tensors()

    def buffer_templates(self) -> List[torch.Tensor]:
        """``averaged_state()``, then the options' small tensors: ``peer_dp``'s (adaptive clipping), ``select``'s
        flags; subclasses append theirs after these."""
        return self.averaged_state() + self._option_templates()

    def _option_templates(self) -> List[torch.Tensor]:
        dp = self.peer_dp.templates() if self.peer_dp is not None else []
        return dp + ([self.select.template()] if self.select is not None else [])

    def write_round(self, buffers: Sequence[torch.Tensor]) -> None:
        state = self.averaged_state()
        for buffer, tensor in zip(buffers, state):
            buffer.copy_(tensor.detach())
        extra = buffers[len(state):len(state) + len(self._option_templates())]
        if self.peer_dp is not None:
            self.peer_dp.privatize(buffers[:len(self.shared)], extra[:len(self.peer_dp.templates())])
        if self.select is not None:
            send_selected(self.select.flags(), buffers[:len(state)], extra[-1])

    def averaging_weight(self) -> float:
        if self.peer_dp is not None:  # DP's sensitivity bound holds only if no peer weighs more than another
            return 1.0 if self._samples > 0 else 0.0
        return float(self._samples)

    def apply_round(self, result: AveragingResult) -> None:
        state = self.averaged_state()
        extra = None if result.averaged is None else \
            result.averaged[len(state):len(state) + len(self._option_templates())]
        if result.averaged is not None:
            means: Sequence[Optional[torch.Tensor]] = result.averaged[:len(state)]
            if self.select is not None:
                means = mean_over_senders(extra[-1], means)
            for tensor, mean in zip(state, means):
                if mean is not None:  # (None: a layer no member sent; this peer keeps its own)
                    tensor.detach().copy_(mean)
        if self.peer_dp is not None:
            self.peer_dp.finish_round(None if extra is None else extra[:len(self.peer_dp.templates())])
        if self.select is not None:
            self.select.anchor.restart()
        self._samples = 0

    def reset(self) -> None:
        self._samples = 0
        if self.peer_dp is not None:
            self.peer_dp.restart()
        if self.select is not None:
            self.select.anchor.restart()

    def keeps_local_state_when_behind(self, missed_rounds: int) -> bool:
        """For a few rounds: local work is averaged back in. A peer that keeps missing its group's rounds (always
        a little late) would otherwise drift on its own model indefinitely; it downloads instead."""
        return missed_rounds <= MAX_ROUNDS_ON_LOCAL_STATE

    def state_dict(self) -> Dict[str, Any]:
        state: Dict[str, Any] = {"peer_dp": self.peer_dp.state()} if self.peer_dp is not None else {}
        if self.select is not None:
            state["select_anchor"] = self.select.anchor.state()
        return state

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        if self.peer_dp is None and self.select is None and type(self).checked_state is LocalUpdates.checked_state:
            super().load_state_dict(state)  # no state: anything else is refused
            return
        self.checked_state(state)()

    def checked_state(self, state: Any) -> Callable[[], None]:
        """Check this class's parts of a saved state; the function returned loads them. A subclass loads its own
        parts only once every part was checked: a state that does not fit changes nothing."""
        if not isinstance(state, dict):
            raise IncompatibleStateError(f"a strategy state must be a dict, got {type(state).__name__}")
        peer_dp = None if self.peer_dp is None else self.peer_dp.check(state.get("peer_dp"), "PeerDP state")
        select = None if self.select is None else \
            self.select.anchor.check(state.get("select_anchor"), "DriftedLayers anchor")

        def load() -> None:
            if self.peer_dp is not None and peer_dp is not None:
                self.peer_dp.load(peer_dp)
            if self.select is not None and select is not None:
                self.select.anchor.load(select)
        return load

    def use_groups(self, groups: Groups) -> None:
        """Accepted: a round's mean is the group's, and the next rounds mix the groups (``swarm_opt.groups``)."""


class FedProx(LocalUpdates):
    """LocalUpdates with the proximal term ``mu/2 * ||y - x||^2`` pulling local steps toward the round's starting
    point ``x`` (Li et al., 2020): the gradient gets ``mu * (y - x)`` before each inner step (on the averaged
    parameters: those ``exchange=KeepLocal(...)`` keeps local are not pulled).

    :param mu: strength of the pull; 0 is plain LocalUpdates. Typical values 0.001-1. With ``adaptive``, μ's start.
    :param adaptive: ``AdaptiveMu(...)`` moves μ with the swarm's mean training loss (FL4Health's adaptive
        constraint): each round carries the members' mean losses (reported with ``Optimizer.step(closure)`` or
        ``Optimizer.report_loss``) and every member of a committed round ends it with the same μ.
    """

    name = "fedprox"
    dp_safe = True  # with mu = 0 and no adaptive mu (``privacy_refusal``)
    cli_options = ("fedprox_mu",)

    @classmethod
    def from_options(cls, options: Dict[str, Any]) -> FedProx:
        return cls(mu=options["fedprox_mu"])

    def privacy_refusal(self) -> Optional[str]:
        if self.mu > 0 or self.adaptive is not None:
            return (f"FedProx(mu={self.mu:g}{', adaptive=...' if self.adaptive is not None else ''}) adds its "
                    f"proximal term to p.grad, which Opacus's DPOptimizer replaces with the noised per-sample "
                    f"gradients: the term would be silently dropped. Use strategy=swarm_opt.LocalUpdates() or "
                    f"Scaffold() with DP")
        return super().privacy_refusal()

    def __init__(self, mu: float = 0.01, *, adaptive: Optional[AdaptiveMu] = None,
                 average_optimizer_state: Sequence[str] = (), exchange: Optional[KeepLocal] = None,
                 select: Optional[DriftedLayers] = None, peer_dp: Optional[PeerDP] = None) -> None:
        super().__init__(average_optimizer_state=average_optimizer_state, exchange=exchange, select=select,
                         peer_dp=peer_dp)
        if isinstance(mu, bool) or not isinstance(mu, (int, float)) or not 0 <= mu < math.inf:
            raise ConfigError(f"FedProx mu must be a non-negative number, got {mu!r}; e.g. FedProx(mu=0.01)")
        if adaptive is not None and not isinstance(adaptive, AdaptiveMu):
            raise ConfigTypeError(f"FedProx adaptive must be None or AdaptiveMu(...), got {adaptive!r}")
        self.mu = float(mu)
        self.adaptive = adaptive
        if adaptive is not None:
            adaptive.mu = self.mu
            self._scalars = SharedScalars(AdaptiveMu.names)
        self._losses = (0.0, 0)  # this round's reported losses: sum, count

    def bind(self, params: Sequence[torch.Tensor], inner: torch.optim.Optimizer) -> None:
        super().bind(params, inner)
        self.anchor = Anchor([self.shared])  # the pull's centre: local, restarted from the parameters

    def before_inner_step(self) -> None:
        for p, x in zip(self.anchor.params, self.anchor.tensors):
            if p.grad is not None:
                p.grad.add_((p.detach() - x.to(p.device, p.dtype)), alpha=self.mu)

    def observe_loss(self, loss: float) -> None:
        total, count = self._losses
        self._losses = (total + loss, count + 1)

    def buffer_templates(self) -> List[torch.Tensor]:
        """With ``adaptive``, one more small tensor carries the round's loss and μ's schedule (``SharedScalars``)."""
        extra = [self._scalars.template()] if self.adaptive is not None else []
        return super().buffer_templates() + extra

    def write_round(self, buffers: Sequence[torch.Tensor]) -> None:
        super().write_round(buffers)
        if self.adaptive is not None:
            self._scalars.encode(self._round_scalars(), buffers[-1])

    def apply_round(self, result: AveragingResult) -> None:
        super().apply_round(result)
        if self.adaptive is not None:
            group = self._round_scalars() if result.averaged is None else self._scalars.decode(result.averaged[-1])
            self.mu = self.adaptive.update(group)
        self._losses = (0.0, 0)
        self.anchor.restart()

    def _round_scalars(self) -> Dict[str, Optional[float]]:
        assert self.adaptive is not None
        total, count = self._losses
        return self.adaptive.scalars(total / count if count else None)

    def reset(self) -> None:
        super().reset()
        self._losses = (0.0, 0)
        self.anchor.restart()

    def state_dict(self) -> Dict[str, Any]:
        state: Dict[str, Any] = {**super().state_dict(), "anchor": self.anchor.state()}
        if self.adaptive is not None:
            state["adaptive"] = self.adaptive.state()
        return state

    def checked_state(self, state: Any) -> Callable[[], None]:
        load_base = super().checked_state(state)
        anchor = self.anchor.check(entry(state, "anchor"), "FedProx anchor")
        adaptive = None if self.adaptive is None else self.adaptive.check(state.get("adaptive"), "FedProx adaptive")

        def load() -> None:
            load_base()
            self.anchor.load(anchor)
            if self.adaptive is not None and adaptive is not None:
                self.adaptive.load(adaptive)
                self.mu = self.adaptive.mu
        return load


class Anchored(LocalUpdates):
    """LocalUpdates measured from the swarm's starting point of the round, ``x`` (``self.anchor``, over the trainable
    parameters), with ``self.lr_sums`` the learning rates spent since: DiLoCo, SCAFFOLD and FedNova build on it,
    overriding what a round sends (``buffer_templates``, ``write_round``), what it makes of the group's mean
    (``apply_round``; ``super().apply_round`` copies the mean into the parameters) and where the next round starts
    (``start_next_round``).

    ``x`` is the swarm's: every peer ends a committed round from the same one, a peer that missed a round holds an
    outdated ``x`` and downloads the swarm's state, and after a download it continues from the swarm's ``x`` (not
    from the donor's half-finished local model). ``x`` and the learning rates spent since are part of the state.

    ``exchange=KeepLocal(...)``: the kept parameters are no part of ``x`` (nor of a variant's state built on it, such
    as SCAFFOLD's controls or DiLoCo's outer optimizer): each peer trains them with its inner optimizer alone, and
    they never leave it. ``select=`` and ``peer_dp=`` are refused (see ``__init__``).
    """

    supports_groups = False  # unless the variant says otherwise (``use_groups``)

    def __init__(self, *, average_optimizer_state: Sequence[str] = (), exchange: Optional[KeepLocal] = None,
                 select: Optional[DriftedLayers] = None, peer_dp: Optional[PeerDP] = None) -> None:
        super().__init__(average_optimizer_state=average_optimizer_state, exchange=exchange, select=select,
                         peer_dp=peer_dp)
        name = type(self).__name__
        if select is not None:
            raise ConfigError(
                f"{name} does not take select=DriftedLayers(...): its rounds are measured from the swarm's common "
                f"starting point x, and a layer a peer did not send would start its next round from that peer's own "
                f"values. Use exchange=KeepLocal(...) for layers that always stay local, or LocalUpdates(select=...) "
                f"/ FedProx(select=...)")
        if peer_dp is not None:
            raise ConfigError(
                f"{name} does not take peer_dp=PeerDP(...): its rounds send or compute more than the clipped, noised "
                f"update (SCAFFOLD's controls, FedNova's division by each peer's steps, DiLoCo's outer step from x), "
                f"so the noise would not bound what one peer reveals. Use LocalUpdates(peer_dp=...) or "
                f"FedProx(peer_dp=...)")

    def bind(self, params: Sequence[torch.Tensor], inner: torch.optim.Optimizer) -> None:
        super().bind(params, inner)
        self.anchor = Anchor.of_trainable(inner, among=self.shared)
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
        (FedNova's ``x - S_eff mean(d)``) would leave the members of one group with different parameters. SCAFFOLD
        restarts ``x`` from the group's mean, DiLoCo averages ``x`` and its outer state too: both accept groups."""
        raise ConfigError(
            f"{type(self).__name__} does not average in groups yet ({groups!r}): its rounds step from the swarm's "
            f"common anchor x, which groups do not share. Use LocalUpdates(), FedProx(), Scaffold() or DiLoCo() with "
            f"groups, or groups=None")

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
