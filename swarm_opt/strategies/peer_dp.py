"""Peer-level differential privacy for parameter averaging: DP-FedAvg with adaptive clipping (McMahan et al. 2018;
Andrew et al. 2021, "Differentially Private Learning with Adaptive Clipping"), without a server.

Each round a peer sends ``x + clip_C(y - x) + ξ`` instead of its parameters ``y``: its update since the round's
start ``x``, scaled down to norm at most ``C``, plus Gaussian noise ``ξ ~ N(0, (z·C)² / split · I)``. Rounds weigh
every peer that stepped the same (the sensitivity of the mean to one peer is ``C / n`` only if no peer weighs more).
With ``AdaptiveClip`` each peer also sends its *clipping bit* ``b = 1 if ‖y - x‖ ≤ C`` (plus noise
``N(0, σ_b² / split)``) and its ``C`` beside the tensors (``SharedScalars``); every member then sets, from the same
averaged values, ``C ← C̄ · exp(−η (b̄ − γ))``: ``C`` moves geometrically toward the ``γ``-quantile of the updates'
norms, identically on every member. What the noise protects against, and from whom, is in docs/privacy.md.

With ``delta``, a peer also accounts for what it released: every write of a round's tensors is one Gaussian mechanism
on its whole data set (sample rate 1) with multiplier ``z/√split`` against the groupmates that see it (composed with
the clipping bit's, ``σ_b/√split``, with ``AdaptiveClip``), composed over the releases with Rényi DP
(``gaussian_epsilon``): ``PeerDP.epsilon()``, ``Optimizer.progress.epsilon`` and each round's log line.
"""

from __future__ import annotations

import math
import secrets
from typing import Any, Dict, List, Optional, Sequence, Union

import torch

from swarm_opt.errors import ConfigError, ConfigTypeError, IncompatibleStateError
from swarm_opt.strategies.anchor import Anchor
from swarm_opt.strategies.shared_scalars import SharedScalars

_MIN_CLIP, _MAX_CLIP = 1e-12, 1e12  # a clip bound outside these (only reachable by tampering) is bounded to them
#: the Rényi orders ε is minimised over: Opacus's RDP accountant's defaults, so that the two report the same ε
RDP_ORDERS = tuple([1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64)))


def gaussian_epsilon(noise_multiplier: float, releases: int, delta: float) -> float:
    """ε at ``delta`` of ``releases`` Gaussian mechanisms of ``noise_multiplier`` (noise std / sensitivity) on the
    whole data set (no subsampling), composed with Rényi DP: each costs ``α / (2 z²)`` at order ``α`` (Mironov 2017),
    converted to (ε, δ) as Opacus's accountant does (Balle et al. 2020), minimised over ``RDP_ORDERS``."""
    if releases == 0:
        return 0.0
    if noise_multiplier <= 0:
        return math.inf
    best = math.inf
    for order in RDP_ORDERS:
        rdp = releases * order / (2 * noise_multiplier ** 2)
        eps = rdp - (math.log(delta) + math.log(order)) / (order - 1) + math.log((order - 1) / order)
        best = min(best, eps)
    return max(best, 0.0)


def _positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < math.inf


class AdaptiveClip:
    """The clip bound ``C`` follows the ``target_quantile`` of the peers' update norms (Andrew et al. 2021).

    :param initial: ``C`` before the first round (> 0).
    :param target_quantile: ``γ``, the fraction of peers whose update should need no clipping (0-1; 0.5: the median).
    :param learning_rate: ``η``: each round multiplies ``C`` by ``exp(−η (b̄ − γ))`` (the paper's 0.2).
    :param bit_noise: ``σ_b``, the noise on the sum of the clipping bits (the paper takes about n/20 for n peers).
    """

    def __init__(self, initial: float = 1.0, *, target_quantile: float = 0.5, learning_rate: float = 0.2,
                 bit_noise: float = 0.0) -> None:
        if not _positive(initial):
            raise ConfigError(f"AdaptiveClip initial must be a positive number, got {initial!r}")
        if isinstance(target_quantile, bool) or not isinstance(target_quantile, (int, float)) \
                or not 0 <= target_quantile <= 1:
            raise ConfigError(f"AdaptiveClip target_quantile must be in [0, 1], got {target_quantile!r}; e.g. 0.5")
        if not _positive(learning_rate):
            raise ConfigError(f"AdaptiveClip learning_rate must be a positive number, got {learning_rate!r}")
        if isinstance(bit_noise, bool) or not isinstance(bit_noise, (int, float)) or not 0 <= bit_noise < math.inf:
            raise ConfigError(f"AdaptiveClip bit_noise must be a number >= 0, got {bit_noise!r}")
        self.initial, self.target_quantile = float(initial), float(target_quantile)
        self.learning_rate, self.bit_noise = float(learning_rate), float(bit_noise)

    def __repr__(self) -> str:
        return (f"AdaptiveClip({self.initial}, target_quantile={self.target_quantile}, "
                f"learning_rate={self.learning_rate}, bit_noise={self.bit_noise})")

    def next_clip(self, clip: float, unclipped: float) -> float:
        """``C ← C · exp(−η (b̄ − γ))``, bounded."""
        return min(max(clip * math.exp(-self.learning_rate * (unclipped - self.target_quantile)), _MIN_CLIP),
                   _MAX_CLIP)


class PeerDP:
    """Clip each peer's round update to norm ``C`` and add Gaussian noise before it leaves the peer.

    :param noise_multiplier: ``z``: the noise's standard deviation is ``z·C`` in all, split among ``split`` peers.
    :param clip: ``C``, a fixed number, or ``AdaptiveClip(...)``.
    :param split: among how many peers the noise is split: each adds ``N(0, (z·C)²/split)``, so that the mean of
        ``split`` honest peers carries the noise of central DP-FedAvg (``z·C/n`` on the mean of ``n = split``). Each
        single update then carries only ``z/√split`` of noise against the groupmates that see it: 1 (the default)
        gives every update the full ``z`` (local DP), at ``√n`` times the noise on the mean. See docs/privacy.md.
    :param delta: report ε at this δ (``epsilon()``, ``Optimizer.progress.epsilon``, the rounds' log lines): the
        privacy this peer's releases spent against its groupmates. Default ``None``: not accounted.
    """

    names = ("unclipped", "clip")  # the scalars a round carries with AdaptiveClip (SharedScalars)

    anchor: Optional[Anchor] = None  # the round's start, from ``bind``

    def __init__(self, *, noise_multiplier: float, clip: Union[float, AdaptiveClip], split: int = 1,
                 delta: Optional[float] = None) -> None:
        if isinstance(noise_multiplier, bool) or not isinstance(noise_multiplier, (int, float)) \
                or not 0 <= noise_multiplier < math.inf:
            raise ConfigError(f"PeerDP noise_multiplier must be a number >= 0, got {noise_multiplier!r}; e.g. 1.0")
        if not isinstance(clip, AdaptiveClip) and not _positive(clip):
            raise ConfigTypeError(f"PeerDP clip must be a positive number or AdaptiveClip(...), got {clip!r}")
        if isinstance(split, bool) or not isinstance(split, int) or split < 1:
            raise ConfigError(f"PeerDP split must be an int >= 1 (the peers that share the noise), got {split!r}")
        if delta is not None and (isinstance(delta, bool) or not isinstance(delta, (int, float)) or not 0 < delta < 1):
            raise ConfigError(f"PeerDP delta must be None or in (0, 1), got {delta!r}; e.g. delta=1e-5")
        self.delta = None if delta is None else float(delta)
        #: rounds' tensors this peer wrote (every attempt is a release: a retried round draws fresh noise)
        self.releases = 0
        self.noise_multiplier, self.split = float(noise_multiplier), split
        self.adaptive = clip if isinstance(clip, AdaptiveClip) else None
        self.clip = clip.initial if isinstance(clip, AdaptiveClip) else float(clip)
        self.scalars = SharedScalars(self.names)
        self._generator = torch.Generator().manual_seed(secrets.randbits(63))
        self._bit: Optional[float] = None  # this peer's noisy clipping bit of the round last written

    def __repr__(self) -> str:
        clip = self.adaptive if self.adaptive is not None else self.clip
        delta = "" if self.delta is None else f", delta={self.delta:g}"
        return f"PeerDP(noise_multiplier={self.noise_multiplier}, clip={clip}, split={self.split}{delta})"

    def effective_noise_multiplier(self) -> float:
        """The multiplier of one release against the groupmates that see it: the update's ``z/√split`` (its
        sensitivity is ``C``), composed with the clipping bit's ``σ_b/√split`` (sensitivity 1) with ``AdaptiveClip``:
        ``(Σ z_k⁻²)^(-1/2)``, 0 when either is released without noise."""
        multipliers = [self.noise_multiplier / math.sqrt(self.split)]
        if self.adaptive is not None:
            multipliers.append(self.adaptive.bit_noise / math.sqrt(self.split))
        if min(multipliers) <= 0:
            return 0.0
        return sum(m ** -2 for m in multipliers) ** -0.5

    def epsilon(self) -> Optional[float]:
        """The privacy this peer spent so far, ε at ``delta`` against its groupmates (None without ``delta``): the
        releases composed as Gaussian mechanisms of ``effective_noise_multiplier()`` (``gaussian_epsilon``); an upper
        bound for whoever sees only rounds' means, which carry at least this much noise relative to one peer."""
        if self.delta is None:
            return None
        return gaussian_epsilon(self.effective_noise_multiplier(), self.releases, self.delta)

    def bind(self, shared: Sequence[torch.Tensor]) -> None:
        """Attach to the tensors a round averages; their values now are the first round's start ``x``."""
        if self.anchor is not None:
            raise ValueError("This PeerDP instance is already used by another strategy; pass a new PeerDP(...)")
        self.anchor = Anchor([list(shared)])

    def templates(self) -> List[torch.Tensor]:
        """The round's extra tensor (the clipping bit and ``C``), with ``AdaptiveClip`` only."""
        return [self.scalars.template()] if self.adaptive is not None else []

    def privatize(self, buffers: Sequence[torch.Tensor], extra: Sequence[torch.Tensor]) -> float:
        """Turn the round's buffers (holding ``y``, in the anchor's order) into ``x + clip_C(y − x) + ξ``, and write
        the clipping bit into ``extra``. Returns the norm of ``y − x`` (before clipping). Counts one release."""
        self.releases += 1
        for buffer, x in zip(buffers, self.anchor.tensors):
            buffer.sub_(x)
        norm = math.sqrt(sum(float(b.to(torch.float64).pow(2).sum()) for b in buffers))
        scale = min(1.0, self.clip / norm) if norm > 0 else 1.0
        std = self.noise_multiplier * self.clip / math.sqrt(self.split)
        for buffer, x in zip(buffers, self.anchor.tensors):
            buffer.mul_(scale)
            if std > 0:
                buffer.add_(torch.randn(buffer.shape, generator=self._generator, dtype=buffer.dtype) * std)
            buffer.add_(x)
        if self.adaptive is not None:
            bit = float(norm <= self.clip)
            if self.adaptive.bit_noise > 0:
                bit += float(torch.randn((), generator=self._generator, dtype=torch.float64)) \
                    * self.adaptive.bit_noise / math.sqrt(self.split)
            self._bit = bit
            self.scalars.encode({"unclipped": bit, "clip": self.clip}, extra[0])
        return norm

    def finish_round(self, extra: Optional[Sequence[torch.Tensor]]) -> None:
        """The round committed (``extra``: its averaged extra tensor; ``None`` for a round alone): move ``C`` and start
        the next round from the parameters."""
        if self.adaptive is not None:
            group = {"unclipped": self._bit, "clip": self.clip} if extra is None else self.scalars.decode(extra[0])
            clip, unclipped = group.get("clip"), group.get("unclipped")
            if clip is not None and math.isfinite(clip):
                self.clip = min(max(clip, _MIN_CLIP), _MAX_CLIP)
            if unclipped is not None and math.isfinite(unclipped):  # a fraction: noise or tampering may leave [0, 1]
                self.clip = self.adaptive.next_clip(self.clip, min(max(unclipped, 0.0), 1.0))
        self._bit = None
        self.anchor.restart()

    def restart(self) -> None:
        """The parameters were replaced (a download): the next round starts from them."""
        self.anchor.restart()

    def state(self) -> Dict[str, Any]:
        return {"clip": self.clip, "anchor": self.anchor.state()}

    def check(self, saved: Any, what: str) -> Dict[str, Any]:
        if not isinstance(saved, dict) or set(saved) != {"clip", "anchor"} or not _positive(saved["clip"]):
            raise IncompatibleStateError(f"{what}: expected a dict with a positive clip and an anchor")
        return {"clip": float(saved["clip"]), "anchor": self.anchor.check(saved["anchor"], f"{what} anchor")}

    def load(self, checked: Dict[str, Any]) -> None:
        self.clip = checked["clip"]
        self.anchor.load(checked["anchor"])
