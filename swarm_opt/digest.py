"""A cheap digest of a model's parameters, so that peers that must hold the same parameters notice when they do not.

With gradient averaging every member of a round applies the same averaged gradient, so members must start each
round with the same parameters; a round "succeeds" whatever they hold. Founders seeded differently, a bit flip or a
bug would leave peers training different models forever. So every member sends the digest of its parameters along
with its round (the matchmaking gather), and each member reads the same verdict from the same gathered digests: the
largest group of agreeing members is the majority; a member outside it downloads a majority member's state.

The digest is the parameters' norm and a few projections on a fixed pseudo-random ±1 pattern, computed in float64 on
the parameters' device: one read of the parameters, a few scalars on the wire, nothing copied to the host (a hash
of the bytes would move a GPU model to the host every epoch). Digests are compared with a tolerance of a few units
in the last place of the parameters' dtype relative to their norm, not bit for bit: peers on different hardware may
drift apart by round-off (bf16 in particular), which is harmless; the digest catches differences the size of
training steps. A drift that grows past the tolerance is resynchronised by one download, which bounds it.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

DIGEST_SIZE = 5  # the norm, then 4 projections
_PATTERN_LENGTH = 1021  # prime, so that the pattern does not line up with the rows of typical tensors
_CHUNK_ROWS = 4096  # rows of the pattern's length per float64 chunk: bounded scratch memory for large tensors
_ULPS = 4  # the tolerance, in units in the last place of the parameters' dtype, relative to their norm
_patterns: Dict[torch.device, torch.Tensor] = {}


def _pattern(device: torch.device) -> torch.Tensor:
    """The ±1 pattern (length x projections), the same on every peer: a fixed seed, a generator of its own."""
    if device not in _patterns:
        generator = torch.Generator().manual_seed(20240611)
        signs = torch.randint(0, 2, (_PATTERN_LENGTH, DIGEST_SIZE - 1), generator=generator, dtype=torch.float64)
        _patterns[device] = (2 * signs - 1).to(device)
    return _patterns[device]


@torch.no_grad()
def parameter_digest(params: Sequence[torch.Tensor]) -> List[float]:
    """The digest of ``params`` (in their order): ``[norm, projection_1, ..., projection_4]``."""
    squares, projections, offset = 0.0, torch.zeros(DIGEST_SIZE - 1, dtype=torch.float64), 0
    for p in params:
        flat = p.detach().reshape(-1)
        if not flat.is_floating_point() or flat.numel() == 0:
            continue
        pattern = torch.roll(_pattern(flat.device), -(offset % _PATTERN_LENGTH), dims=0)
        offset += flat.numel()
        rows = flat.numel() // _PATTERN_LENGTH
        for start in range(0, rows, _CHUNK_ROWS):
            end = min(rows, start + _CHUNK_ROWS)
            chunk = flat[start * _PATTERN_LENGTH:end * _PATTERN_LENGTH].to(torch.float64).view(-1, _PATTERN_LENGTH)
            squares += float(chunk.square().sum())
            projections += (chunk @ pattern).sum(dim=0).cpu()
        tail = flat[rows * _PATTERN_LENGTH:].to(torch.float64)
        squares += float(tail.square().sum())
        projections += (tail @ pattern[:tail.numel()]).cpu()
    return [math.sqrt(squares), *map(float, projections)]


def digest_tolerance(params: Sequence[torch.Tensor]) -> float:
    """How far apart (relative to the norm) two digests of the same model may be: a few ulps of its least precise
    floating-point dtype."""
    eps = max((torch.finfo(p.dtype).eps for p in params if p.is_floating_point()), default=0.0)
    return _ULPS * eps


def valid_digest(value: Any) -> Optional[Tuple[float, ...]]:
    """A groupmate's digest as sent, if it is one (network input: anything else counts as no digest)."""
    if not isinstance(value, (list, tuple)) or len(value) != DIGEST_SIZE:
        return None
    if not all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in value):
        return None
    return tuple(float(x) for x in value)


def digests_agree(a: Sequence[float], b: Sequence[float], tolerance: float) -> bool:
    scale = max(abs(a[0]), abs(b[0]), 1e-30)
    return all(abs(x - y) <= tolerance * scale for x, y in zip(a, b))


def majority(digests: Mapping[Any, Sequence[float]], tolerance: float) -> List[Any]:
    """The members of the largest group of agreeing digests (keys: peer ids, ordered by their bytes). Between groups
    of equal size, the one holding the smallest peer id wins: every member computes the same verdict from the same
    gathered digests, so a tie (two members, or founders that all differ) never leaves both sides keeping their
    models, nor makes them download each other's."""
    groups: List[List[Any]] = []
    for peer in sorted(digests, key=_peer_key):
        for group in groups:
            if digests_agree(digests[group[0]], digests[peer], tolerance):
                group.append(peer)
                break
        else:
            groups.append([peer])
    return max(groups, key=len) if groups else []


def _peer_key(peer: Any) -> bytes:
    return peer.to_bytes() if hasattr(peer, "to_bytes") else str(peer).encode()
