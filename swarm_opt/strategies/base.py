"""The interface between the optimizer's fixed step loop and an algorithm.

The loop calls ``local_step`` on every ``Optimizer.step()``. When the swarm has processed ``target_batch_size``
samples it begins a round, ``begin_round() -> Round`` (below; ``swarm_opt.round`` runs it): the round writes this
peer's values into averaging buffers shaped like ``buffer_templates()``, they are all-reduced weighted by
``Round.weight``, and the round either applies the group's mean or, if it failed, gives its values back to be
averaged next time.

Writing an algorithm: most override ``buffer_templates`` (the shapes of what a round averages), ``write_round``
(the values this peer sends), ``averaging_weight`` and ``apply_round`` (what to do with the group's mean); the
default ``begin_round`` wraps these in a round over the strategy's live state, which the loop waits for. A strategy
whose rounds run while training goes on returns a ``Round`` of its own that sets its values aside
(``GradientAveraging(overlap=Overlap())``). Algorithms that average parameters build on ``LocalUpdates`` and,
when rounds are measured from the swarm's starting point ``x``, on ``Anchored`` (both in
``swarm_opt.strategies.local_updates``; ``x`` itself is a ``swarm_opt.strategies.anchor.Anchor``): FedNova
(``fednova.py``) is an example in a few lines.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, Dict, List, Optional, Sequence, Tuple

import torch

from swarm_opt.buffers import AveragingResult, scale_and_check
from swarm_opt.config import Groups
from swarm_opt.errors import ConfigError, IncompatibleStateError
from swarm_opt.groups import ONE_GROUP, RoundPlan

#: rounds the swarm may finish without a peer that averages its parameters before it downloads the swarm's state
#: instead of going on from its own (``Strategy.keeps_local_state_when_behind``: its work is averaged back in if it
#: rejoins sooner)
MAX_ROUNDS_ON_LOCAL_STATE = 3


@dataclass(frozen=True)
class Overlap:
    """Average each round in the background while the peer trains on: ``GradientAveraging(overlap=Overlap())``,
    ``DiLoCo(..., overlap=Overlap())``.

    When the swarm reaches the global batch, the peer sets the round's values aside and goes on computing; the round
    is applied at the first ``step()`` after its all-reduce finished, so the all-reduce costs no compute time.
    **Staleness:** the steps computed while a round is in flight use parameters one update behind (gradient
    averaging: their gradients are one step stale, as with hivemind's ``delay_optimizer_step``; DiLoCo: the outer
    step lands on top of the inner steps made meanwhile). Never more than one update: a round starts only after the
    previous one was applied. A round that fails gives its values back to the next round, as without overlap, and
    it does not change the maths of a round: every member applies the same update.

    Costs one more fp32 buffer per parameter (the round set aside while training goes on). Worth it when the
    all-reduce takes a noticeable share of the time between rounds (large models, slow links).
    """


class Round(ABC):
    """One peer's part of one averaging round. ``write`` (and ``weight``) may run in another thread than the
    training loop's; ``apply`` or ``give_back`` run in the loop's, after the all-reduce ended."""

    #: True if the round set its values aside, so that local steps may go on while it averages
    in_background: bool = False

    @property
    @abstractmethod
    def weight(self) -> float:
        """This peer's weight in the round's weighted mean (fixed when the round began)."""

    @abstractmethod
    def write(self, buffers: Sequence[torch.Tensor]) -> None:
        """Write this peer's values into the averaging buffers (fp32 or wider, on the CPU, shaped like
        ``Strategy.buffer_templates()``)."""

    @abstractmethod
    def apply(self, result: AveragingResult) -> None:
        """The round committed: finish it from the group's mean ``result.averaged`` (``None`` for a round alone,
        whose mean is this peer's own values)."""

    @abstractmethod
    def give_back(self) -> None:
        """The round failed: leave this peer's values to the next round (a no-op for a round over live state)."""


class Strategy(ABC):
    """One training algorithm. Instances are bound to one optimizer; pass a fresh instance per optimizer."""

    #: a short stable name; peers only average with peers running the same strategy
    name: str = "strategy"
    _bound = False  # set by ``bind``: an instance serves one optimizer

    # --- capabilities, declared by each class (the optimizer, the privacy check and the command line read them) ---
    #: every value its rounds send is computed from the inner optimizer's steps, so that DP-SGD steps
    #: (``privacy=OpacusPrivacy(...)``) keep the run private (``swarm_opt.privacy``). Read from the class itself, not
    #: inherited: a subclass may send more, so it declares ``dp_safe = True`` itself (``privacy_refusal``)
    dp_safe: ClassVar[bool] = False
    #: it stays correct when rounds average in Moshpit groups (``groups=Groups(...)``: ``use_groups``)
    supports_groups: ClassVar[bool] = False
    #: the command line's options it is built from (their argparse dests, e.g. ``("fedprox_mu",)``: ``from_options``)
    cli_options: ClassVar[Tuple[str, ...]] = ()
    #: those of ``cli_options`` that the run's peers must share (they join the run's identity); None: all of them.
    #: Options that ``variant`` already carries need not
    cli_settings: ClassVar[Optional[Tuple[str, ...]]] = None

    @classmethod
    def from_options(cls, options: Dict[str, Any]) -> Strategy:
        """An instance built from the values of its ``cli_options`` (by dest); default: the class's defaults."""
        return cls()

    @classmethod
    def identity_options(cls) -> Tuple[str, ...]:
        """The command-line options whose values the run's peers must share (``cli_settings``)."""
        return cls.cli_options if cls.cli_settings is None else cls.cli_settings

    def privacy_refusal(self) -> Optional[str]:
        """Why DP-SGD local steps would not keep a run with this strategy private (None: they do). Default: refused
        unless the class itself declares ``dp_safe``."""
        if type(self).__dict__.get("dp_safe", False):
            return None
        name = type(self).__name__
        return (f"{name} is not known to keep DP-SGD private in a swarm (see swarm_opt.privacy); use LocalUpdates(), "
                f"Scaffold() or DiLoCo(...), or, if every value {name}'s rounds send is computed from its DP-SGD "
                f"steps, declare dp_safe = True on {name}")

    def bind(self, params: Sequence[torch.Tensor], inner: torch.optim.Optimizer) -> None:
        """Attach to the trainable parameters and the inner optimizer; allocate buffers."""
        if self._bound:
            raise ConfigError(
                f"This {type(self).__name__} instance is already used by another optimizer; "
                f"pass a new instance, e.g. strategy={type(self).__name__}()"
            )
        self._bound = True
        self.params: List[torch.Tensor] = list(params)
        self.inner = inner

    @abstractmethod
    def local_step(self, batch_size: int) -> bool:
        """Consume the gradients of one local step of ``batch_size`` samples. Return False if the step was skipped
        (non-finite gradients): its samples then do not count."""

    @abstractmethod
    def buffer_templates(self) -> List[torch.Tensor]:
        """Tensors whose shapes and dtypes (the same every round) size the averaging buffers, in ``write_round``'s
        order; their values do not matter."""

    @abstractmethod
    def write_round(self, buffers: Sequence[torch.Tensor]) -> None:
        """Write this peer's values of the round into the averaging buffers (fp32 or wider, on the CPU)."""

    @abstractmethod
    def averaging_weight(self) -> float:
        """This peer's weight in the round's weighted mean."""

    @abstractmethod
    def apply_round(self, result: AveragingResult) -> None:
        """Finish the round from the group's mean, ``result.averaged`` (in ``write_round``'s order; ``None`` for a
        round alone, whose mean is this peer's own values). The buffers are the round's: they may be changed."""

    #: where the round begun last averages (``swarm_opt.groups``): which grid dimension, in which line
    round_plan: RoundPlan = ONE_GROUP

    def begin_round(self, plan: RoundPlan = ONE_GROUP) -> Round:
        """Begin a round that averages where ``plan`` says (kept as ``round_plan``); the loop ends it with
        ``Round.apply`` or ``Round.give_back``. Default: a round over the live state (``write_round`` /
        ``apply_round``), so local steps wait until it ended."""
        self.round_plan = plan
        return LiveRound(self)

    def personal_parameters(self) -> List[torch.Tensor]:
        """Parameters that never leave this peer (``exchange=KeepLocal(...)``): the optimizer serves neither them nor
        their inner-optimizer state to peers downloading its state, and keeps its own when it downloads. Default:
        none."""
        return []

    def own_state(self) -> Tuple[str, ...]:
        """Entries of ``state_dict()`` that are this peer's own, not the swarm's (``WorkerMomentum``'s momentum):
        no majority vouches for a donor's, so a peer that downloads the swarm's state keeps its own entries (or
        none) instead of its donor's. Default: none."""
        return ()

    def epsilon(self) -> Optional[float]:
        """The privacy this peer spent through the strategy's own mechanism so far (ε of peer-level DP,
        ``LocalUpdates(peer_dp=PeerDP(..., delta=...))``), reported in ``Optimizer.progress`` and the rounds' log
        lines. Default: None (the strategy releases nothing private of its own)."""
        return None

    def observe_loss(self, loss: float) -> None:
        """The training loss of a local step (``Optimizer.step(closure)``'s, or ``Optimizer.report_loss``), finite.
        Default: ignored; strategies that adapt to the loss (``FedProx(adaptive=AdaptiveMu())``) override it."""
        return None

    def use_groups(self, groups: Groups) -> None:
        """The optimizer averages in Moshpit groups (``swarm_opt.Groups``): members of different groups then hold
        different values after a round. Strategies that stay correct with that (``supports_groups``) accept it."""
        if self.supports_groups:
            return
        raise ConfigError(
            f"{type(self).__name__} does not average in groups (groups={groups!r}): use GradientAveraging(), "
            f"LocalUpdates(), FedProx(), Scaffold() or DiLoCo(), or groups=None")

    @abstractmethod
    def reset(self) -> None:
        """Forget local progress of the current round (after the peer caught up by downloading the swarm's state)."""

    @property
    def variant(self) -> str:
        """What peers of this strategy must agree on beyond its ``name`` (an option that changes what a round
        averages, e.g. ``GradientAveraging(momentum=...)``): peers only average with, and download state from, peers
        of the same name and variant. Default: none."""
        return ""

    @property
    def shares_parameters(self) -> bool:
        """Whether every member must start each round with the same parameters (true when rounds average updates,
        not the parameters themselves): members then compare digests of their parameters, and one outside its
        group's majority downloads the state of a member of the majority (``swarm_opt.digest``)."""
        return False

    @property
    def sends_changes(self) -> bool:
        """Whether every value a round averages is a change (a gradient, DiLoCo's pseudo-gradient ``x - y``) whose
        mean the strategy applies as a step: a codec with error feedback (``TopK``) may then delay part of it to
        later rounds. Not for model states (parameters, optimizer statistics), whose values cannot be left out."""
        return False

    @property
    def averages_gradients(self) -> bool:
        """Whether a round averages this peer's gradients of the round and nothing else (the mean of which the inner
        optimizer steps on): a codec of gradients (``PowerSGD``'s low-rank factors) serves only such strategies."""
        return False

    def keeps_local_state_when_behind(self, missed_rounds: int) -> bool:
        """The swarm is ``missed_rounds`` rounds past the last one this peer averaged in (or the state it
        downloaded). Return True if the strategy can go on from its local state (it will be averaged back in next
        round); False if the peer must download the swarm's state (the default: e.g. gradient averaging must never
        step from stale parameters)."""
        return False

    def state_dict(self) -> Dict[str, Any]:
        return {}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore ``state_dict()``'s output; a state that does not fit raises ``IncompatibleStateError``."""
        if not isinstance(state, dict):
            raise IncompatibleStateError(f"{type(self).__name__} state must be a dict, got {type(state).__name__}")
        if state:
            raise IncompatibleStateError(f"{type(self).__name__} has no state, but got keys {sorted(map(str, state))}")


class LiveRound(Round):
    """A round over the strategy's live state: nothing is set aside, so a failed round has nothing to give back."""

    def __init__(self, strategy: Strategy) -> None:
        self.strategy = strategy
        self._weight = strategy.averaging_weight()

    @property
    def weight(self) -> float:
        return self._weight

    def write(self, buffers: Sequence[torch.Tensor]) -> None:
        self.strategy.write_round(buffers)

    def apply(self, result: AveragingResult) -> None:
        self.strategy.apply_round(result)

    def give_back(self) -> None:
        pass


def state_dtype(tensor: torch.Tensor) -> torch.dtype:
    """Buffers that accumulate over many steps (means, anchors, controls) keep at least fp32 precision."""
    return torch.promote_types(tensor.dtype, torch.float32)


def grads_are_finite(grads: List[torch.Tensor]) -> bool:
    """One fused pass over the gradients (the kernel GradScaler uses), scaling them by 1."""
    return scale_and_check(grads, 1.0)
