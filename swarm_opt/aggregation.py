"""How a reducer combines the members' copies of one averaged part: pass one as
``swarm_opt.Optimizer(aggregation=swarm_opt.CenteredClip())``.

In the butterfly all-reduce each member reduces one share of the averaged tensors for the whole group: it receives
every member's copy of each part of its share, combines them here, and sends every member the same encoded result
(``swarm_opt._hivemind.allreduce``). Replacing the weighted mean with a robust estimate therefore costs no extra
round trip, and every member still ends a round with identical values.

=======================  ===========================================================================  ==============
aggregation              what one part becomes (``n`` copies of ``d`` values)                          cost per part
=======================  ===========================================================================  ==============
``Mean()`` (default)     the weighted mean; a copy whose norm exceeds ``max_norm_ratio`` × the         O(n·d)
                         group's median norm is scaled down to that norm first
``TrimmedMean(f)``       per coordinate, drop the ``⌈f·n⌉`` lowest and highest values, mean the rest   O(n·d·log n)
``CenteredClip(τ, l)``   ``l`` steps of ``v += mean_i clip(x_i − v, τ·r)`` from the coordinate-wise   O(n·d·(l + log n))
                         median, ``r`` the median distance of the copies to it
=======================  ===========================================================================  ==============

``Audited(a)`` reduces with ``a``, each part twice by two different members, compared by every member: it contains
a reducer that lies (2× the bytes of a round; see its docstring and ``docs/security.md``).
``Reputation(a)`` reduces with ``a`` the copies of the members that the group still trusts: each reducer remembers
how every sender's copies sat against the results, across rounds, and a group leaves out a sender that more than
half of its members distrust. It contains attackers that stay inside one round's honest spread (see its docstring).

What every aggregation does first: a copy with NaN/inf values, or whose weight is not a finite number ≥ 0, counts
with weight 0 (a hostile or broken member; honest members never send such values, see ``TensorAverager``), and a
copy of weight 0 takes no part at all. If no copy is left the part, and so the round, fails (hivemind divided by
zero).

Weights are claims of the senders (their samples), network input like the values: the robust aggregations count
each member at most at the group's median weight, so that a member cannot buy influence by claiming a huge weight.

Codecs: the aggregations combine what the reducer decodes, so they work with every elementwise codec
(``NoCompression``, ``Float16``, ``Int8Blockwise``, ``Uniform8Bit``), and with every strategy: gradient averaging
combines gradients; the parameter-averaging strategies (``LocalUpdates``, ``FedProx``, ``Scaffold``, ``DiLoCo``)
combine parameters (and SCAFFOLD's control variates). ``PowerSGD`` averages factors pre-scaled by each member's
weight, and the group's total weight as one more part: a robust estimate of those is no robust estimate of the
gradients, and a norm bound would cut honest members with more samples; it averages with ``Mean(max_norm_ratio=
None)`` and refuses the others.

Every peer of a run passes the same aggregation (auxiliary peers too: they reduce shares): members tell theirs when
they form a group, and a group that mixes them discards its round (``TensorAverager.all_reduce``).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field, fields
from typing import Any, Dict, Optional, Sequence, Set, Tuple, Type

import torch

from swarm_opt.errors import ConfigError, ConfigTypeError


class Aggregation(ABC):
    """Combines ``n`` members' copies of one part into the value every member receives."""

    #: how many members reduce each part: 1, or 2 (``Audited``: every member compares the two results; the averager
    #: runs a second all-reduce for the second reducers)
    reducers_per_part: int = 1

    @abstractmethod
    def combine(self, parts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """``parts``: (n, d) finite copies, ``weights``: (n,) each > 0, both float32 (float64 where float32
        overflowed); returns (d,) in their dtype."""


@dataclass(frozen=True)
class Mean(Aggregation):
    """The weighted mean, with the norm of each copy bounded by ``max_norm_ratio`` × the group's median norm.

    Why the bound is on by default: one member's finite but absurd values (gradients 10⁶× too large) would
    otherwise set the whole group's result, and overflow its parameters. The median norm (the lower median, so that
    in a group of two the larger copy is bounded by the smaller) is an honest member's while a majority is honest.
    Honest copies of one part have norms of the same order (gradients of the same model on the same task, or
    parameters that were averaged last round), far below 10×, so the bound changes nothing for them. It does not
    make the mean robust (a member within the bound still moves it by up to ``max_norm_ratio``/n times an honest
    norm): use ``CenteredClip`` or ``TrimmedMean`` for that. A part whose median norm is 0 is not bounded.

    :param max_norm_ratio: a number > 1 (default 10), or None for the plain weighted mean.
    """

    max_norm_ratio: Optional[float] = 10.0

    def __post_init__(self) -> None:
        if self.max_norm_ratio is not None:
            _check_number("Mean(max_norm_ratio=...)", self.max_norm_ratio, "10, or None for no bound")
            if not 1.0 < self.max_norm_ratio < math.inf:
                raise ConfigError(f"Mean(max_norm_ratio={self.max_norm_ratio!r}) must be a number > 1 (e.g. 10), or "
                                  f"None for the plain weighted mean")

    def combine(self, parts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        if self.max_norm_ratio is not None and len(parts) > 1:
            norms = parts.norm(dim=1)
            bound = self.max_norm_ratio * norms.median()
            if bound > 0 and bool((norms > bound).any()):
                parts = parts * (bound / norms).clamp(max=1.0).unsqueeze(1)
        return weights @ parts / weights.sum()


@dataclass(frozen=True)
class TrimmedMean(Aggregation):
    """Per coordinate, the mean of the copies left once the ``k = ⌈fraction·n⌉`` lowest and highest values are
    dropped (``k`` at most ``(n − 1)/2``: three members keep their median, two their mean).

    With at most ``k`` hostile members every result lies between honest values. Rounded up so that a group smaller
    than the swarm (a member missing from a round) still trims: 0.25 drops one value per side in groups of 2 to 4,
    two in groups of 5 to 8. Costs one sort of ``n`` values per coordinate.

    :param fraction: the share of members assumed hostile, in [0, 0.5); default 0.25.
    """

    fraction: float = 0.25

    def __post_init__(self) -> None:
        _check_number("TrimmedMean(fraction=...)", self.fraction, "0.25")
        if not 0.0 <= self.fraction < 0.5:
            raise ConfigError(f"TrimmedMean(fraction={self.fraction!r}) must be in [0, 0.5), the share of members "
                              f"assumed hostile (e.g. 0.25): at 0.5 nothing would be left")

    def combine(self, parts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        n = len(parts)
        drop = min(math.ceil(self.fraction * n), (n - 1) // 2)
        weights = _capped(weights)
        if drop == 0:
            return weights @ parts / weights.sum()
        if bool((weights == weights[0]).all()):  # equal weights (after the cap): the values alone
            return _sort_columns(parts)[drop:n - drop].mean(dim=0)
        values, order = parts.sort(dim=0)
        kept_weights = weights[order[drop:n - drop]]
        return (values[drop:n - drop] * kept_weights).sum(dim=0) / kept_weights.sum(dim=0)


@dataclass(frozen=True)
class CenteredClip(Aggregation):
    """CenteredClip (Karimireddy, He and Jaggi 2021; the BTARD all-reduce of Gorbunov et al. 2022): from ``v`` at the
    coordinate-wise median, ``iterations`` times ``v ← v + Σ w_i clip(x_i − v, τ·r) / Σ w_i``, where ``clip(z, c)``
    scales ``z`` down to norm ``c`` and ``r`` is the median distance of the copies to the median.

    ``tau`` is relative to ``r`` so that one value fits parts of any scale (gradients, parameters): honest copies lie
    at about the same distance from the median, so with ``tau`` ≥ 2 they are not clipped and, without outliers, the
    result is their weighted mean (weights capped at the median) after one iteration; a copy far outside moves the
    result by at most ``tau·r·w_i/Σw`` per iteration. Costs O(n·d·(iterations + log n)) per part (a sort for the
    median, then one pass over the copies per iteration).

    :param tau: clipping radius in units of ``r``, > 0; default 2.
    :param iterations: steps from the median, 1 to 100; default 3.
    """

    tau: float = 2.0
    iterations: int = 3

    def __post_init__(self) -> None:
        _check_number("CenteredClip(tau=...)", self.tau, "2.0")
        if not 0.0 < self.tau < math.inf:
            raise ConfigError(f"CenteredClip(tau={self.tau!r}) must be a number > 0 (e.g. 2.0): the clipping radius "
                              f"in units of the median distance of the copies to their median")
        if isinstance(self.iterations, bool) or not isinstance(self.iterations, int):
            raise ConfigTypeError(f"CenteredClip(iterations=...) must be an int, e.g. 3; got {self.iterations!r}")
        if not 1 <= self.iterations <= 100:
            raise ConfigError(f"CenteredClip(iterations={self.iterations}) must be 1 to 100 (e.g. 3)")

    def combine(self, parts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        weights = _capped(weights)
        weights = weights / weights.sum()
        center = _median(parts)
        radius = self.tau * (parts - center).norm(dim=1).median()
        if radius == 0:  # most copies equal the median: it is the answer
            return center
        for _ in range(self.iterations):
            offsets = parts - center
            scale = (radius / offsets.norm(dim=1)).clamp(max=1.0)  # a copy at the centre: radius/0 = inf → 1
            center = center + (weights * scale) @ offsets
        return center


@dataclass(frozen=True)
class Audited(Aggregation):
    """``aggregation`` with every part reduced by two members instead of one, and every member comparing the two
    results it receives: ``swarm_opt.Audited(swarm_opt.CenteredClip())``. Contains a lying reducer.

    In the butterfly all-reduce one member reduces each part for the whole group; a reducer that returns a wrong
    result (an offset, its own values) to everyone is caught by nothing else (a wrong result to some members only is
    caught by the parameter digests, see ``docs/security.md``). Here a second all-reduce of the same values runs
    beside the first, with the same parts and each part's reducer moved to the next member that reduces (auxiliary
    peers included; client-mode members reduce nothing), so that two different members reduce each part. A member
    whose two results of a part differ by more than ``tolerance`` × their norm fails the round (nothing is applied;
    the round is retried), and names the two reducers; a member found in two disagreeing pairs of one round is the
    liar, and is named as such. A group with one reducer cannot be audited: its rounds fail.

    Costs 2× the bytes of a round, sent and received, on every member (each value goes to two reducers, and comes
    back twice), 2× the reducers' compute, and one more copy of the averaged buffers. The two all-reduces run at the
    same time over the same links. A reducer's result is its honest result up to ``tolerance`` (codecs re-encode the
    mean: the two reducers' encodings of the same mean may differ in the last bit), so a liar can still move each
    part by up to ``tolerance`` × its norm per round; and a member that leaves mid-round fails the round as before.

    :param aggregation: how each reducer combines the copies (default ``Mean()``).
    :param tolerance: the relative difference above which two results disagree, in (0, 0.1]; default 1e-3.
    """

    aggregation: Aggregation = field(default_factory=Mean)
    tolerance: float = 1e-3
    reducers_per_part = 2

    def __post_init__(self) -> None:
        if not isinstance(self.aggregation, Aggregation) or isinstance(self.aggregation, Audited):
            raise ConfigTypeError(f"Audited(aggregation=...) must be one of "
                                  f"{', '.join(f'swarm_opt.{a.__name__}()' for a in AGGREGATIONS if a is not Audited)}"
                                  f"; got {self.aggregation!r}")
        _check_number("Audited(tolerance=...)", self.tolerance, "1e-3")
        if not 0.0 < self.tolerance <= 0.1:
            raise ConfigError(f"Audited(tolerance={self.tolerance!r}) must be in (0, 0.1] (e.g. 1e-3): how far two "
                              f"reducers' results of a part may differ, relative to their norm")

    def combine(self, parts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return self.aggregation.combine(parts, weights)

    def disagree(self, first: torch.Tensor, second: torch.Tensor) -> bool:
        """Whether two reducers' results of the same values differ beyond ``tolerance`` (or either is not finite)."""
        first, second = first.reshape(-1).double(), second.reshape(-1).double()
        difference = float((first - second).norm())
        return not difference <= self.tolerance * max(float(first.norm()), float(second.norm()))


@dataclass(frozen=True)
class Reputation(Aggregation):
    """``aggregation`` over the copies of the members that their group still trusts:
    ``swarm_opt.Reputation(swarm_opt.CenteredClip())``. Each reducer remembers, across rounds, how every sender's
    copies sat against the others' results, and a sender that more than half of a group's members distrust takes
    no part in that group's rounds (weight 0: it still receives the results). Contains the attackers that no one
    round shows.

    Why memory: a robust aggregation judges one round's copies, and an attacker that stays inside the honest spread
    is never cut. Two of eight members that send the negation of their momentum lie about as far from the honest
    copies as those from each other, and halve every step; two that shift every value by the honest spread ("a
    little is enough") bias every step the same way. Round after round the first point against the others' result
    (their cosine to it is below 0 on average, an honest copy's above) and the second sit on one side of it (the
    mean over a part's values of ``(copy − others) / spread`` is far from 0; honest copies scatter around 0: see
    ``judge_part``). Per round and sender, a reducer scores each copy it reduces both ways, averages the scores
    over its parts, and keeps an exponential mean per sender (``memory`` per round). After ``rounds`` rounds with a
    sender it distrusts it once the mean cosine is clearly below 0 (until it is back above 0: ``Reputations``) or
    while the mean shift exceeds ``max_shift``.

    Why a majority: reducers' memories differ (each reduces other parts, in other groups), and every reducer of a
    group must leave out the same senders (``Audited`` compares two reducers' results). Members tell whom they
    distrust in the group's gather, which every member receives alike; more than half of the group must name a
    sender, so that attackers among a minority cannot silence an honest member.

    What it does not contain: attackers that come with new identities every few rounds (use an allow-list:
    ``docs/security.md``), or a majority of attackers in a group. An attacker whose shift changes sign from value
    to value evades the shift score, and costs far less (``benchmarks/README.md``). Costs a sort of each value's
    distances and a few passes over the copies per part (about ``CenteredClip``'s compute), and a few numbers per
    sender in memory. Works with the strategies and codecs its aggregation works with (not ``PowerSGD``, whose
    factors need the plain mean, nor ``TopK``, whose sparse copies need ``Mean``).

    :param aggregation: how each reducer combines the trusted copies (default ``CenteredClip()``; not ``Audited``:
        wrap this in it instead, ``Audited(Reputation(...))``).
    :param memory: the weight of the past in each sender's mean scores, in [0, 1); default 0.8.
    :param rounds: rounds with a sender before it can be distrusted, ≥ 1; default 3.
    :param max_shift: the mean standardised shift above which a sender is distrusted, > 0; default 0.4.
    """

    aggregation: Aggregation = field(default_factory=CenteredClip)
    memory: float = 0.8
    rounds: int = 3
    max_shift: float = 0.4

    def __post_init__(self) -> None:
        if not isinstance(self.aggregation, Aggregation) or isinstance(self.aggregation, (Audited, Reputation)):
            raise ConfigTypeError(f"Reputation(aggregation=...) must be swarm_opt.Mean(), TrimmedMean() or "
                                  f"CenteredClip() (to audit it, write Audited(Reputation(...))); got "
                                  f"{self.aggregation!r}")
        _check_number("Reputation(memory=...)", self.memory, "0.8")
        if not 0.0 <= self.memory < 1.0:
            raise ConfigError(f"Reputation(memory={self.memory!r}) must be in [0, 1) (e.g. 0.8): the weight of the "
                              f"past rounds in each sender's scores")
        if isinstance(self.rounds, bool) or not isinstance(self.rounds, int) or self.rounds < 1:
            raise ConfigError(f"Reputation(rounds={self.rounds!r}) must be an int ≥ 1 (e.g. 3): rounds with a "
                              f"sender before it can be distrusted")
        _check_number("Reputation(max_shift=...)", self.max_shift, "0.4")
        if not 0.0 < self.max_shift < math.inf:
            raise ConfigError(f"Reputation(max_shift={self.max_shift!r}) must be a number > 0 (e.g. 0.4)")

    def combine(self, parts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return self.aggregation.combine(parts, weights)


def judge_part(parts: Sequence[torch.Tensor], weights: Sequence[float], result: torch.Tensor) -> torch.Tensor:
    """(n, 2) for ``Reputation``: each copy's cosine to the result of the others, and its mean standardised shift
    from it, the mean over the values of ``(copy − others) / spread`` with ``spread`` a robust standard deviation
    of each value over the finite copies (1.4826 × the median distance to ``result``: attackers of another kind
    must not inflate it; values without spread count 0), each value's term bounded to ±3.

    Why the others' result: a copy is part of ``result``, and in a small group of noisy copies that alone points
    it with ``result`` (a sign flipper among 4 members with batch-sized gradients scores above 0). The
    others' result is ``result`` less the copy's own pull: its offset from ``result``, clipped in norm to twice the
    median offset (as ``CenteredClip`` clips: a copy far outside pulls a robust result little), times its weight
    over the others' (exact for the mean; a left-out copy pulled nothing).

    Why the cosines are NaN (no evidence) where the median cosine is not above 0: a cosine tells a flipper only
    where the group agrees on a direction. Near an optimum the members' gradients of their own data add up to
    about 0, each pointing against the others' sum, honest or not. A copy with non-finite values scores NaN (it
    counted for nothing). A sort of each value's distances (as ``CenteredClip``'s median) and a few passes, in
    float32 (float64 where float32 overflowed)."""
    stacked = torch.stack([p.reshape(-1) for p in parts]).float()
    finite = torch.tensor([_finite(row) for row in stacked], dtype=torch.bool)
    w = torch.tensor([float(x) for x in weights], dtype=torch.float64)
    w = torch.where(finite & torch.isfinite(w) & (w >= 0), w, torch.zeros_like(w))
    scores = torch.full((len(stacked), 2), math.nan, dtype=torch.float64)
    if bool(finite.any()):
        w = w / w.max().clamp(min=torch.finfo(torch.float64).tiny)  # a weight of 1e300 is finite, their sum not
        rest = w.sum() - w  # the weight of the others: a copy with all of it (or none at all) pulls nothing
        pull = torch.where(rest > 0, w / rest.clamp(min=torch.finfo(torch.float64).tiny), torch.zeros_like(w))
        scores[finite] = _scores(stacked[finite], result.reshape(-1).float(), pull[finite].float())
        if not bool(torch.isfinite(scores[finite]).all()):
            scores[finite] = _scores(stacked[finite].double(), result.reshape(-1).double(), pull[finite])
        if not scores[finite, 0].median() > 0:
            scores[:, 0] = math.nan
    return scores


_MOST_SHIFT = 3.0  # the largest standardised shift one value counts with in ``judge_part``


def _scores(copies: torch.Tensor, result: torch.Tensor, pull: torch.Tensor) -> torch.Tensor:
    offsets = copies - result
    spread = 1.4826 * _sort_columns(offsets.abs())[(len(copies) - 1) // 2]
    squares = (offsets * offsets).sum(dim=1)
    norms = squares.sqrt()
    # the others' result is ``result − k·offset`` (``judge_part``); its products from these, without forming it
    k = pull * (2 * norms.median() / norms.clamp(min=torch.finfo(copies.dtype).tiny)).clamp(max=1.0)
    along, length = offsets @ result, result @ result
    dot = along + length - k * (squares + along)  # copy · others
    others = (length - 2 * k * along + k * k * squares).clamp(min=0).sqrt()
    copy = (squares + 2 * along + length).clamp(min=0).sqrt()
    cosine = dot / (copy * others).clamp(min=torch.finfo(copies.dtype).tiny)
    inverse = torch.where(spread > 0, 1 / spread, torch.zeros_like(spread))
    # each value's shift ``(copy − others) / spread = (1 + k)·offset / spread``, bounded: where nearly every copy is
    # 0 (an input feature few batches hold) the spread is tiny, and one honest copy's value there would otherwise
    # outweigh all the others
    shift = (offsets * inverse * (1 + k)[:, None]).clamp_(-_MOST_SHIFT, _MOST_SHIFT).mean(dim=1)
    return torch.stack([cosine, shift], dim=1).double()


class RoundScores:
    """One reducer's scores of one round (``judge_part``), per sender: means over the parts it reduced, each part
    counting by its size (a part of a few values says little); a NaN score is no evidence, and is skipped."""

    def __init__(self) -> None:
        self._sums: Dict[Any, list] = {}  # sender -> [Σ cosine·size, Σ size, Σ shift·size, Σ size]

    def add(self, senders: Sequence[Any], scores: torch.Tensor, size: int) -> None:
        """``scores`` (``judge_part``'s, one row per sender) of a part of ``size`` values."""
        for sender, (cosine, shift) in zip(senders, scores.tolist()):
            sums = [0.0, 0, 0.0, 0]
            if math.isfinite(cosine):
                sums[0], sums[1] = cosine * size, size
            if math.isfinite(shift):
                sums[2], sums[3] = shift * size, size
            self._add(sender, sums)

    def add_all(self, other: RoundScores, names: Sequence[Any]) -> None:
        """Add ``other``'s sums, its senders (indices) named by ``names``."""
        for sender, sums in other._sums.items():
            self._add(names[sender], sums)

    def _add(self, sender: Any, sums: Sequence[float]) -> None:
        total = self._sums.setdefault(sender, [0.0, 0, 0.0, 0])
        for i, x in enumerate(sums):
            total[i] += x

    def means(self) -> Dict[Any, Tuple[float, float]]:
        """Each sender's mean cosine and shift (NaN: no evidence), what ``Reputations.record`` takes."""
        return {sender: (cosine / size if size else math.nan, shift / count if count else math.nan)
                for sender, (cosine, size, shift, count) in self._sums.items()}


@dataclass
class _RunningMean:
    """An exponential mean of one score, with what its standard error needs."""

    mean: float = 0.0
    square: float = 0.0  # the exponential mean of the score's square
    weights: float = 0.0  # the sum of the squared weights of the rounds in the mean
    rounds: int = 0

    def add(self, value: float, keep: float) -> None:
        """One more round's score; ``keep``: the weight of the past."""
        if self.rounds == 0:
            self.mean, self.square, self.weights = value, value * value, 1.0
        else:
            self.mean = keep * self.mean + (1 - keep) * value
            self.square = keep * self.square + (1 - keep) * value * value
            self.weights = keep * keep * self.weights + (1 - keep) ** 2
        self.rounds += 1

    def error(self) -> float:
        """The standard error of the mean: the score's variance times the sum of the squared weights."""
        return math.sqrt(max(self.square - self.mean * self.mean, 0.0) * self.weights)


@dataclass
class _Sender:
    """What one reducer remembers of one sender."""

    cosine: _RunningMean = field(default_factory=_RunningMean)
    shift: _RunningMean = field(default_factory=_RunningMean)
    distrusted: bool = False


class Reputations:
    """One peer's memory of senders (``Reputation``), kept by its reducer across rounds and groups: per sender the
    running means of its scores and whether it is distrusted. Bounded: past ``capacity`` senders the one seen
    longest ago is forgotten.

    Judged against the others' result, an honest copy's mean cosine is only as far above 0 as the copies agree,
    and late in training, where they barely do, noise puts honest senders below 0 now and then. So a sender becomes
    distrusted once its mean cosine lies below 0 by more than ``_CONFIDENCE`` standard errors, and is trusted again
    once it is back above 0 (left out, a flipper is judged against a result without it, and would otherwise be let
    back in whenever the signal fades); or while its mean shift is beyond ``max_shift``."""

    def __init__(self, reputation: Reputation, capacity: int = 4096) -> None:
        self.reputation, self.capacity = reputation, capacity
        self._senders: Dict[Any, _Sender] = {}  # insertion order = age

    def record(self, scores: Dict[Any, Tuple[float, float]]) -> None:
        """One round's mean scores per sender (NaN: no evidence; a sender with none is not judged on this round)."""
        keep = self.reputation.memory
        for name, (cosine, shift) in scores.items():
            if not (math.isfinite(cosine) or math.isfinite(shift)):
                continue
            sender = self._senders.pop(name, None) or _Sender()
            for mean, value in ((sender.cosine, cosine), (sender.shift, shift)):
                if math.isfinite(value):
                    mean.add(value, keep)
            sender.distrusted = self._distrusts(sender)
            self._senders[name] = sender
        while len(self._senders) > self.capacity:
            del self._senders[next(iter(self._senders))]

    def _distrusts(self, sender: _Sender) -> bool:
        rounds, cosine, shift = self.reputation.rounds, sender.cosine, sender.shift
        margin = 0.0 if sender.distrusted else _CONFIDENCE * cosine.error()
        return (cosine.rounds >= rounds and cosine.mean + margin < 0) or (
            shift.rounds >= rounds and abs(shift.mean) > self.reputation.max_shift)

    def distrusted(self) -> list:
        """The senders whose scores, over ``rounds`` rounds or more, point against the others' results or sit on
        one side of them (above)."""
        return [name for name, sender in self._senders.items() if sender.distrusted]


_CONFIDENCE = 3.0  # standard errors below 0 at which a sender's mean cosine distrusts it (``Reputations``)


def left_out(members: Sequence[Any], votes: Sequence[Any]) -> Set[Any]:
    """The ``members`` that more than half of them name in ``votes`` (one entry per member: whom it distrusts,
    network input: anything but a list counts as no one, and each voter names a member once). Never half of the
    group or more: with a majority of honest members that many cannot be attackers, and the memories must be wrong
    (leaving them out would stall every round)."""
    counts: Dict[Any, int] = {}
    known = set(members)
    for vote in votes:
        for name in set(vote) if isinstance(vote, (list, tuple)) else ():
            if name in known:
                counts[name] = counts.get(name, 0) + 1
    out = {name for name, count in counts.items() if 2 * count > len(members)}
    return out if 2 * len(out) < len(members) else set()


def reputation_of(aggregation: Aggregation) -> Optional[Reputation]:
    """The ``Reputation`` that ``aggregation`` is, or wraps (``Audited(Reputation(...))``), if any."""
    inner = aggregation.aggregation if isinstance(aggregation, Audited) else aggregation
    return inner if isinstance(inner, Reputation) else None


#: every aggregation, once; the conformance tests iterate over it
AGGREGATIONS: Tuple[Type[Aggregation], ...] = (Mean, TrimmedMean, CenteredClip, Reputation, Audited)


#: the command line's names of the aggregations (``parse_aggregation``); ``Audited`` is the ``audited:`` prefix
AGGREGATION_NAMES: Dict[str, Type[Aggregation]] = {"mean": Mean, "trimmed-mean": TrimmedMean,
                                                   "centered-clip": CenteredClip}
AGGREGATION_FORMS = ("mean, mean:none (the plain mean), mean:20, trimmed-mean, trimmed-mean:0.25, centered-clip, "
                     "centered-clip:tau=1,iterations=3, any of them after reputation: (reputation:centered-clip), "
                     "and any of those after audited: (audited:reputation:centered-clip)")


def parse_aggregation(text: str) -> Aggregation:
    """An aggregation from its command-line form (``--aggregation``): ``NAME[:VALUE,...]``, with ``NAME`` one of
    ``AGGREGATION_NAMES`` and each value positional (in the order of the class's parameters) or ``key=value``;
    ``none`` means None; ``reputation:`` in front wraps it in ``Reputation`` (its defaults), and ``audited:`` in
    front of that in ``Audited``. Raises ConfigError naming the valid forms."""
    spec = str(text).strip()
    audited = spec.lower().startswith("audited:")
    if audited:
        spec = spec[len("audited:"):].strip()
    remembered = spec.lower().startswith("reputation:")
    if remembered:
        spec = spec[len("reputation:"):].strip()
    name, _, values = spec.partition(":")
    kind = AGGREGATION_NAMES.get(name.strip().lower())
    if kind is None:
        raise ConfigError(f"unknown aggregation {text!r}; valid forms: {AGGREGATION_FORMS}")
    params = [f for f in fields(kind) if f.init]
    kwargs: Dict[str, Any] = {}
    named = False
    for position, item in enumerate(v.strip() for v in values.split(",") if v.strip()):
        key, equals, value = item.partition("=")
        named = named or bool(equals)
        if not equals:
            if position >= len(params) or named:
                raise ConfigError(f"aggregation {text!r}: too many values or a value after key=value; "
                                  f"valid forms: {AGGREGATION_FORMS}")
            key, value = params[position].name, item
        key = key.strip().replace("-", "_")
        param = next((f for f in params if f.name == key), None)
        if param is None or key in kwargs:
            raise ConfigError(f"aggregation {text!r}: {name} takes {', '.join(f.name for f in params)} (each once); "
                              f"valid forms: {AGGREGATION_FORMS}")
        kwargs[key] = _parse_value(value.strip(), param.default, text)
    aggregation = kind(**kwargs)  # its own checks name the range of each value
    aggregation = Reputation(aggregation) if remembered else aggregation
    return Audited(aggregation) if audited else aggregation


def _parse_value(value: str, default: Any, text: str) -> Any:
    """A command-line value, read as the parameter's default is typed (``none``: None)."""
    if value.lower() == "none":
        return None
    try:
        if isinstance(default, int) and not isinstance(default, bool):
            return int(value)
        if isinstance(default, float) or default is None:
            return float(value)
    except ValueError:
        raise ConfigError(f"aggregation {text!r}: expected a number, got {value!r}; valid forms: "
                          f"{AGGREGATION_FORMS}") from None
    return value


def as_aggregation(aggregation: Optional[Aggregation], compression: Any = None) -> Aggregation:
    """``aggregation=``'s object for a run averaging with ``compression`` (None means ``Mean()``); anything else is
    refused, naming the choices. A codec with an averaging protocol of its own (PowerSGD) has the last word
    (``check_aggregation``)."""
    if aggregation is not None and not isinstance(aggregation, Aggregation):
        choices = ", ".join(f"swarm_opt.{a.__name__}()" for a in AGGREGATIONS)
        hint = f" (pass an instance: {aggregation.__name__}())" if isinstance(aggregation, type) else ""
        raise ConfigTypeError(f"aggregation must be one of {choices}; got {aggregation!r}{hint}")
    if compression is not None:  # a ``swarm_opt.compression.Compression``: the codec has the last word
        return compression.check_aggregation(aggregation)
    return Mean() if aggregation is None else aggregation


def reduce_part(aggregation: Aggregation, parts: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """What a reducer sends back for one part: ``aggregation`` over the usable copies (see the module docstring),
    in float32 like hivemind's reducer. Raises ValueError when no copy is usable.

    The arithmetic runs in float32 (one pass over the copies per step, as hivemind's sum), and again in float64 in
    the rare case where float32 overflowed (norms of copies beyond about 1e19) and the result is not finite."""
    stacked = torch.stack([p.reshape(-1) for p in parts]).float()
    shape = parts[0].shape
    w = torch.tensor([float(x) for x in weights], dtype=torch.float64)
    usable = torch.tensor([_finite(row) for row in stacked], dtype=torch.bool)
    w = torch.where(usable & torch.isfinite(w) & (w >= 0), w, torch.zeros_like(w))
    if not bool((w > 0).any()):  # the round fails, as a group whose weights are all zero does nothing
        raise ValueError("no member sent finite values with a weight above 0 for this part")
    keep = w > 0
    if not bool(keep.all()):
        stacked, w = stacked[keep], w[keep]
    w = w / w.max()  # a weight of 1e300 is finite in float64, not in float32
    result = aggregation.combine(stacked, w.float())
    if not bool(torch.isfinite(result.sum())):
        result = aggregation.combine(stacked.double(), w).float()
    return result.reshape(shape)


def _finite(row: torch.Tensor) -> bool:
    """Whether every value of ``row`` is finite: a finite sum proves it; only an overflowing one needs min/max."""
    if bool(torch.isfinite(row.sum())):
        return True
    low, high = torch.aminmax(row)
    return bool(torch.isfinite(low)) and bool(torch.isfinite(high))


def _capped(weights: torch.Tensor) -> torch.Tensor:
    """Weights bounded by their median: a claim of a huge weight buys no more than a typical member's."""
    return weights.clamp(max=float(weights.median()))


def _median(parts: torch.Tensor) -> torch.Tensor:
    """The coordinate-wise median (the mean of the two middle values for an even count)."""
    values = _sort_columns(parts)
    n = len(parts)
    return (values[(n - 1) // 2] + values[n // 2]) / 2


_NETWORK_MAX = 16  # up to this many copies an odd-even transposition sort beats torch.sort along a short dimension


def _sort_columns(values: torch.Tensor) -> torch.Tensor:
    """``values`` sorted along dim 0. For a few copies, n passes of elementwise min/max over adjacent rows (n²·d
    operations in large vectorised passes): torch.sort of millions of 8-element columns is about twice as slow."""
    n = len(values)
    if n > _NETWORK_MAX:
        return values.sort(dim=0).values
    values = values.clone()
    for start in [i % 2 for i in range(n)]:
        pairs = (n - start) // 2
        if pairs:
            low, high = values[start:start + 2 * pairs:2], values[start + 1:start + 2 * pairs:2]
            new_low = torch.minimum(low, high)
            high.copy_(torch.maximum(low, high))
            low.copy_(new_low)
    return values


def _check_number(name: str, value: object, example: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigTypeError(f"{name} must be a number, e.g. {example}; got {value!r}")
