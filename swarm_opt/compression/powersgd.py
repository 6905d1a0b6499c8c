"""PowerSGD with error feedback (Vogels et al., 2019): average low-rank factors of the gradients instead of the
gradients. Pass ``compression=swarm_opt.PowerSGD(rank=4)`` with ``strategy=GradientAveraging()``.

What a round computes
---------------------
Every gradient tensor with at least two dimensions is viewed as a matrix ``(shape[0], -1)`` of ``n × m`` values and
compressed if ``rank·(n + m) < n·m``; others (biases, small matrices) are averaged exactly. Peer i of a group with
weights ``w`` (samples) and total ``W`` holds its share of the group's weighted mean, ``Y_i = (w_i/W)·g_i + R_i``
(``g_i`` its mean gradient, ``R_i`` its residual, in the same units), and the group runs two all-reduces:

1. ``P = Σ_i Y_i Q`` (Q: the warm-started ``m × r`` factor, the same on every member; W taken from the last round,
   which only shapes the span), then ``P̂ = orthogonalize(P)``, plus ``W`` itself;
2. ``Q̂ = Σ_i Y_iᵀ P̂`` (plus the exact weighted mean of the uncompressed tensors).

Every member applies ``M̂ = P̂ Q̂ᵀ = P̂ P̂ᵀ M``, the projection of the group's true weighted mean ``M`` onto span(P̂)
(a contraction in directions where P is nearly degenerate, see below),
keeps ``R_i ← Y_i − P̂ (Y_iᵀ P̂)ᵀ`` (what of its share was not sent; Σ_i R_i is exactly ``M − M̂``) and reuses
``Q̂`` as the next round's Q. Residuals are kept in units of the mean (not of the peer's own gradient) so that the
sum of the updates applied plus the residuals equals the sum of the weighted-mean gradients exactly, whatever the
weights of each round: a residual created with weight ``w/W`` re-enters the next mean with the same weight.

Design decisions (see the tests in ``tests/unit/test_powersgd.py``)
-------------------------------------------------------------------
* **Both phases run in the same group** (hivemind's matchmaking once, two all-reduces under two group ids) and every
  value travels pre-scaled with all-reduce weight 1, so the weights never need dividing out (the group's ``W`` comes
  with phase 1 as one extra value). A phase that some member did not fully average fails the round.
* **The residual advances only when the host commits the round.** The optimizer may discard a round the averager
  completed (a group mixing rounds, or not a majority) and then keeps its gradients; advancing the residual too
  would count them twice. The averager process keeps two residual buffers: the residual as of the last committed
  round, and the candidate of the round it just ran, tagged with that round's attempt number (sent along in the
  matchmaking gather). ``commit`` (host process) writes the round and its attempt to shared memory (a round alone
  has no attempt and keeps the last one); at the start of the next round the averager adopts the candidate only if
  its attempt is the last committed (a swap, no copy). A failed round, a discarded one, or a round alone leaves R
  unchanged. A peer that did not commit the previous
  round (it caught up by downloading the swarm's state, or resumed from a checkpoint) starts again from R = 0: its
  gradients of the missed round were dropped as well (each gradient is used at most once).
* **Q consistency without comparing values.** Members of a round end it with identical Q̂ (the all-reduce hands every
  member the same decoded means, ``swarm_opt._hivemind.allreduce``), but a fingerprint of Q's values would still have
  to travel and be compared. Each Q carries a *lineage* instead: ``(generation, hash)``, the seed's at start, then
  ``(g + 1, hash(lineage, group_id))`` after each round, identical on every member that completed the round. Members
  gather their lineages; the lineage held by most members (then the oldest, then the smallest hash) wins, and members
  of any other lineage (a newcomer, a peer that missed rounds) send zeros in phase 1. Phase 2 still takes everybody's
  gradients, and every member adopts Q̂ and the new lineage, so the group ends in step. This keeps the warm start of
  the majority instead of restarting the whole group from a fresh random Q. A Q that differs anyway (a stale
  declaration) only costs quality, never correctness: ``M̂`` is the projection of the true mean onto whatever span P̂
  has.
* **Orthogonalization is a continuous map.** Members receive the same mean P, but should they ever differ by a
  rounding (hivemind's own all-reduce returns ``local + (mean − local)``), Gram-Schmidt would normalise a near-zero
  column into an arbitrary direction, different on each member (and then project later columns onto it): members
  would apply different updates and their parameters drift apart for good. ``orthogonalize`` computes
  ``P (PᵀP)^(-1/2)`` with the eigenvalues of ``PᵀP`` floored at ``(δ‖P‖_F)²``: directions with a singular value
  above ``δ‖P‖_F`` come out exactly orthonormal, weaker ones shrink linearly to zero (no NaN, even for P = 0), and a
  rounding difference ``ε`` between members changes the applied update by at most about ``ε/δ`` in relative terms.
  What a shrunk direction does not send stays in the residual. ``δ = 1e-2``.
* **Q is used with unit columns.** The scale of Q̂ carries nothing (P is orthogonalized) but a column that shrinks
  round after round would never come back; zero columns (a layer without gradient) are redrawn deterministically.

Limits (measured with ``simulate_round``)
-----------------------------------------
* Error feedback delivers what a round did not send in later rounds, so it acts like a delay of about 1/ρ rounds
  (ρ: the share of the gradient a round sends). With full-rank gradients and a low rank it needs a smaller step:
  rank 1 on a 64×32 quadratic with a flat spectrum diverges at η·L = 0.5 and reaches the optimum to 1e-15 at 0.03.
  Gradients of neural networks are far from flat, which is why low ranks work there.
* Σ_i R_i is the group's unsent mean and vanishes at convergence, but with heterogeneous data each peer's own R_i
  also holds parts that cancel between peers (its gradient's components outside the mean's span): we measured up
  to ~80× a peer's gradient at the optimum on quadratics, still bounded, and of the order of the gradient noise
  with IID data. A peer that leaves (or drops its residual on catching up) takes its share of those parts along; the
  swarm then applies the remainder as an extra update. Plain averaging has no such term.

Costs
-----
Values sent per round and peer: ``Σ r·(n + m)`` for the compressed tensors, the uncompressed tensors as they are,
and W (``values_per_round``); factors in the buffers' precision (fp32), or half that with ``factors=Float16()``. A
784×256 weight matrix: 802,816 bytes in fp32, 4,160·r + 8 bytes with PowerSGD (193× fewer at r = 1, 96× at r = 2,
48× at r = 4; measured on a loopback swarm, matching to the byte). Memory: two residual buffers of the compressed
tensors' size, in the averager process only. Compute: a few ``n × m × r`` matrix products per round.
"""

from __future__ import annotations

import hashlib
import logging
import math
from dataclasses import dataclass, field
from typing import Any, List, Optional, Sequence, Tuple

import torch

from swarm_opt.aggregation import Aggregation, Mean
from swarm_opt.compression.base import Compression
from swarm_opt.compression.codecs import Codec, NoCompression
from swarm_opt.errors import ConfigError, ConfigTypeError

__all__ = ["PowerSGD", "matrix_view", "is_compressed", "orthogonalize", "unit_columns", "initial_factors",
           "ErrorFeedback", "PeerRound", "simulate_round"]

logger = logging.getLogger(__name__)

#: δ: directions of P weaker than δ·‖P‖_F are shrunk, not normalised (see the module docstring)
ORTHOGONALIZATION_FLOOR = 1e-2
_MAX_SEED = 2**63 - 1


@dataclass(frozen=True)
class PowerSGD(Compression):
    """Low-rank gradient compression with error feedback and a warm-started ``Q`` shared by all peers.

    :param rank: the rank ``r`` of each compressed gradient matrix: a 784×256 layer travels in 193x (r = 1) to 48x
        (r = 4) fewer bytes than fp32; higher ranks send more and approximate each round better, and tolerate larger
        learning rates (error feedback delays what a round does not send). Every peer of a run must use the same
        rank and seed (a mismatch fails the rounds and logs an error naming it).
    :param seed: draws the first ``Q`` (identical on every peer).
    :param factors: the elementwise codec the factors (and the tensors sent whole) travel with; ``Float16()`` halves
        the bytes again at an error far below what the low rank leaves out (it is not error-fed back: a relative
        2⁻¹¹ per round). The group's total weight always travels exact.
    :param min_compression: a matrix travels as factors only if they are at least this many times smaller than it,
        ``n·m ≥ min_compression · rank·(n + m)``; other matrices are averaged exactly (as torch's
        ``min_compression_rate``). Narrow layers such as a classifier's output (2800×10 at rank 4: 2.5×) save few
        bytes and lose most: their gradient's rank is the number of classes.
    """

    rank: int = 4
    seed: int = 0
    factors: Codec = field(default_factory=NoCompression)
    min_compression: float = 1.0

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int):
            raise ConfigTypeError(f"PowerSGD(rank=...) must be an int, e.g. PowerSGD(rank=4); got {self.rank!r}")
        if self.rank < 1:
            raise ConfigError(f"PowerSGD(rank={self.rank}) must be at least 1; ranks 1 to 4 are typical")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ConfigTypeError(f"PowerSGD(seed=...) must be an int; got {self.seed!r}")
        if not 0 <= self.seed <= _MAX_SEED:
            raise ConfigError(f"PowerSGD(seed={self.seed}) must be between 0 and 2**63 - 1")
        if isinstance(self.min_compression, bool) or not isinstance(self.min_compression, (int, float)):
            raise ConfigTypeError(f"PowerSGD(min_compression=...) must be a number, e.g. 4; got "
                                  f"{self.min_compression!r}")
        if not 1.0 <= self.min_compression < math.inf:
            raise ConfigError(f"PowerSGD(min_compression={self.min_compression!r}) must be a number >= 1 (1: compress "
                              f"every matrix whose factors are smaller than it)")
        if not isinstance(self.factors, Codec):
            raise ConfigTypeError(f"PowerSGD(factors=...) must be an elementwise codec such as swarm_opt.Float16(); "
                                  f"got {self.factors!r}")

    def __repr__(self) -> str:
        factors = "" if isinstance(self.factors, NoCompression) else f", factors={self.factors!r}"
        floor = "" if self.min_compression == 1.0 else f", min_compression={self.min_compression:g}"
        return f"swarm_opt.PowerSGD(rank={self.rank}, seed={self.seed}{factors}{floor})"

    elementwise = False  # two all-reduces of factors per round (``swarm_opt._hivemind.powersgd_engine``)
    needs_gradients = True

    @property
    def lane_dtype(self) -> Optional[torch.dtype]:
        """The lane carries the factors in the dtype of the ``factors`` codec."""
        return self.factors.lane_dtype

    def refusal(self, strategy: Any) -> str:
        """PowerSGD serves strategies that average one round's gradients only (``GradientAveraging`` in groups sends
        the parameters too)."""
        return (f"{self!r} compresses gradients (low-rank factors plus error feedback) and works only with "
                f"strategy=swarm_opt.GradientAveraging() without groups; {type(strategy).__name__} here averages "
                f"model states, which are not low-rank. Use compression=swarm_opt.Float16() or "
                f"swarm_opt.Int8Blockwise() with it, or groups=None")

    def check_aggregation(self, aggregation: Optional[Aggregation]) -> Aggregation:
        """The plain weighted mean, the only aggregation of this protocol: its members send factors pre-scaled by
        their weights, and the group's total weight as one more part (see ``swarm_opt.aggregation``)."""
        plain = Mean(max_norm_ratio=None)
        if aggregation is not None and aggregation != plain:
            raise ConfigError(
                f"{self!r} averages low-rank factors pre-scaled by each peer's weight, with the plain weighted mean: "
                f"aggregation={aggregation!r} cannot apply to them. Leave aggregation unset with PowerSGD, or use "
                f"compression=swarm_opt.Int8Blockwise() (or another elementwise codec) with {aggregation!r}"
            )
        return plain

    def compresses(self, shape: Sequence[int]) -> bool:
        """Whether a gradient of ``shape`` travels as factors (see ``is_compressed``)."""
        return is_compressed(shape, self.rank, self.min_compression)

    def values_per_round(self, shapes: Sequence[Sequence[int]]) -> int:
        """Values one peer sends per round for tensors of these shapes (plain averaging sends their numel)."""
        compressed = [s for s in shapes if self.compresses(s)]
        factors = sum(self.rank * sum(_matrix_shape(s)) for s in compressed)
        plain = sum(math.prod(s) for s in shapes if not self.compresses(s))
        return factors + plain + (1 if compressed else 0)


# --- the maths: pure functions ------------------------------------------------------------------------------------
def _matrix_shape(shape: Sequence[int]) -> Tuple[int, int]:
    return int(shape[0]), math.prod(shape[1:])


def matrix_view(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor as the ``(shape[0], -1)`` matrix PowerSGD factorises (a copy only if it is not contiguous)."""
    return tensor.reshape(tensor.shape[0], -1)


def is_compressed(shape: Sequence[int], rank: int, min_compression: float = 1.0) -> bool:
    """Whether a tensor of ``shape`` is sent as rank-``rank`` factors: it must be a matrix (or more) whose factors
    are smaller than itself, ``rank·(n + m) < n·m``, by at least ``min_compression``. Otherwise it is averaged exactly
    (so rank ≥ min(n, m) is)."""
    if len(shape) < 2:
        return False
    n, m = _matrix_shape(shape)
    return rank * (n + m) < n * m and n * m >= min_compression * rank * (n + m)


def orthogonalize(p: torch.Tensor, floor: float = ORTHOGONALIZATION_FLOOR) -> torch.Tensor:
    """``P (PᵀP)^(-1/2)`` with the eigenvalues of ``PᵀP`` floored at ``(floor·‖P‖_F)²``, computed in float64.

    Columns come out orthonormal where P is well conditioned; directions with a singular value ``s`` below
    ``floor·‖P‖_F`` come out with length ``s / (floor·‖P‖_F)`` (so ``P̂ P̂ᵀ`` never amplifies). P = 0 gives 0. The
    map is continuous (no division by a vanishing norm), which keeps peers that see P up to rounding in step."""
    if not bool(torch.isfinite(p).all()):
        raise ValueError("orthogonalize() got non-finite values")
    work = p.to(torch.float64)
    eigenvalues, eigenvectors = torch.linalg.eigh(work.T @ work)
    limit = max(float(eigenvalues.sum()) * floor**2, torch.finfo(torch.float64).tiny)
    inverse_root = (eigenvectors * eigenvalues.clamp_min(limit).rsqrt()) @ eigenvectors.T
    return (work @ inverse_root).to(p.dtype)


def unit_columns(q: torch.Tensor, seed: int) -> torch.Tensor:
    """Q for a round: each column scaled to length 1; columns that vanished (or are not finite) redrawn from
    ``seed``. Only the span of Q matters; a column left to shrink from round to round would never recover."""
    norms = torch.linalg.vector_norm(q, dim=0)
    dead = ~torch.isfinite(norms) | (norms <= torch.finfo(q.dtype).tiny)
    out = q / torch.where(dead, torch.ones_like(norms), norms)
    if bool(dead.any()):
        fresh = torch.randn(q.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        fresh = (fresh / torch.linalg.vector_norm(fresh, dim=0)).to(q.dtype)
        out[:, dead] = fresh[:, dead]
    return out


def initial_factors(shapes: Sequence[Sequence[int]], rank: int, seed: int,
                    dtypes: Optional[Sequence[torch.dtype]] = None) -> List[torch.Tensor]:
    """The first Q of each compressed tensor (``m × rank``), drawn in order from ``seed``: the same on every peer."""
    generator = torch.Generator().manual_seed(seed)
    dtypes = dtypes or [torch.float32] * len(shapes)
    return [torch.randn(_matrix_shape(s)[1], rank, generator=generator, dtype=torch.float64).to(dtype)
            for s, dtype in zip(shapes, dtypes)]


class ErrorFeedback:
    """One peer's residuals, rolled forward only by rounds its host committed (see the module docstring).

    ``begin`` returns the residuals as of the last committed round and the buffers into which the round computes
    its candidate; ``stage(attempt)`` marks the candidate as that attempt's; the candidate becomes the residual at
    the next ``begin`` if and only if that attempt is the last one committed. Attempts only grow and each ``begin``
    forgets the previous candidate, so a candidate is never adopted late. ``committed_round`` is the last round the
    host applied, averaged or alone: a round that does not follow it means the peer skipped rounds."""

    def __init__(self, shapes: Sequence[Tuple[int, int]], dtypes: Sequence[torch.dtype]) -> None:
        self._sets = tuple([torch.zeros(s, dtype=d) for s, d in zip(shapes, dtypes)] for _ in range(2))
        self._current = 0
        self._staged: Optional[int] = None

    @property
    def residuals(self) -> List[torch.Tensor]:
        return self._sets[self._current]

    def begin(self, round_id: int, committed_attempt: int, committed_round: int
              ) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
        if self._staged is not None and self._staged == committed_attempt:
            self._current = 1 - self._current
        self._staged = None
        if round_id != committed_round + 1:  # this peer did not take part in the swarm's last round
            for residual in self.residuals:
                residual.zero_()
        return self.residuals, self._sets[1 - self._current]

    def stage(self, attempt: int) -> None:
        self._staged = attempt


class PeerRound:
    """One peer's side of a PowerSGD round between the group's two all-reduces, on matrix views. The averager runs it
    around hivemind's all-reduces; ``simulate_round`` (and the unit tests) around plain sums.

    :param grads: this peer's mean gradients (read only); ``residuals``: its residuals R (read only);
        ``shares``: buffers for Y = (w/W)·g + R, which end the round holding the candidate residuals;
        ``qs``: the group's warm-started Q; ``weight``: this peer's weight; ``weight_estimate``: the group's total
        weight as far as known before phase 1 (the last round's), which only shapes the span of P (None before a
        first round: the residuals are still zero, and any estimate common to the group weights the gradients
        exactly); ``contributes``: False if this peer's Q is not the group's (it sends zeros in phase 1);
        ``redraw_seed``: where vanished columns of Q are drawn from.
    """

    def __init__(self, grads: Sequence[torch.Tensor], residuals: Sequence[torch.Tensor],
                 shares: Sequence[torch.Tensor], qs: Sequence[torch.Tensor], *, weight: float,
                 weight_estimate: Optional[float] = None, contributes: bool = True, redraw_seed: int = 0) -> None:
        self.grads, self.residuals, self.shares, self.qs = grads, residuals, shares, qs
        self.weight, self.contributes, self.redraw_seed = weight, contributes, redraw_seed
        self.weight_estimate = weight_estimate or 1.0
        self.p_hats: List[torch.Tensor] = []
        self.own_qs: List[torch.Tensor] = []
        self.fraction = 0.0

    def phase1(self) -> List[torch.Tensor]:
        """This peer's P = Y Q with the group's total weight estimated (only P's span matters; with no residuals, or
        an exact estimate, and rank ≥ n it spans the whole mean)."""
        ps = []
        for k, (g, residual, share, q) in enumerate(zip(self.grads, self.residuals, self.shares, self.qs)):
            if not self.contributes:
                ps.append(torch.zeros(g.shape[0], q.shape[1], dtype=g.dtype))
                continue
            torch.add(residual, g, alpha=self.weight / self.weight_estimate, out=share)
            ps.append(share @ unit_columns(q, seed=_lineage_hash(str(self.redraw_seed).encode(), str(k).encode())))
        return ps

    def phase2(self, p_means: Sequence[torch.Tensor], total_weight: float) -> List[torch.Tensor]:
        """Given the group's mean P and total weight: this peer's Q_i = Yᵀ P̂ with its exact share Y."""
        if not (math.isfinite(total_weight) and total_weight > 0):
            raise ValueError(f"the group's total weight is {total_weight}")
        self.fraction = self.weight / total_weight
        self.p_hats = [orthogonalize(p) for p in p_means]  # raises on non-finite values
        self.own_qs = []
        for g, residual, share, p_hat in zip(self.grads, self.residuals, self.shares, self.p_hats):
            torch.add(residual, g, alpha=self.fraction, out=share)
            self.own_qs.append((p_hat.T @ share).T.contiguous())  # = Yᵀ P̂, Y read row by row (6x faster)
        return self.own_qs

    def finish(self, q_hats: Sequence[torch.Tensor], out: Optional[Sequence[torch.Tensor]] = None
               ) -> List[torch.Tensor]:
        """Given Q̂ = Σ_i Q_i: the update M̂ = P̂ Q̂ᵀ of each tensor, written into ``out`` (matrix views of the
        averaged buffers) when given; ``shares`` now hold the candidate residuals."""
        updates = []
        for k, (p_hat, q_hat, share, own_q) in enumerate(zip(self.p_hats, q_hats, self.shares, self.own_qs)):
            updates.append(torch.mm(p_hat, q_hat.T, out=None if out is None else out[k]))
            share.addmm_(p_hat, own_q.T, alpha=-1.0)  # what of Y was not sent
        return updates


def simulate_round(rounds: Sequence[PeerRound]) -> Tuple[List[List[torch.Tensor]], List[torch.Tensor], float]:
    """One group's round in-process, the all-reduces replaced by exact sums: (each member's updates, Q̂, the total
    weight). For tests and benchmarks of the maths; the averager runs the same ``PeerRound`` steps around hivemind's
    all-reduces."""
    p_means = [sum(ps) / len(rounds) for ps in zip(*(r.phase1() for r in rounds))]
    total_weight = sum(r.weight for r in rounds)
    q_hats = [sum(qs) for qs in zip(*(r.phase2(p_means, total_weight) for r in rounds))]
    return [r.finish(q_hats) for r in rounds], q_hats, total_weight


def _lineage_hash(*parts: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(b"|".join(parts), digest_size=8).digest(), "little") & _MAX_SEED
