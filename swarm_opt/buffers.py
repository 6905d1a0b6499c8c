"""What a round averages and what it returns, apart from how the bytes travel: the averaging buffers' layout, the
finiteness check every sender runs, and ``AveragingResult``. Strategies, the round protocol and the in-process
simulation use these without importing the transport (``swarm_opt._hivemind``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import torch
from hivemind.p2p import PeerID

from swarm_opt.deadlines import RoundTiming


def buffer_like(tensor: torch.Tensor) -> torch.Tensor:
    """The averaging buffer of one tensor: on the CPU, in at least fp32 whatever the model's precision."""
    dtype = torch.promote_types(tensor.dtype, torch.float32) if tensor.is_floating_point() else tensor.dtype
    return torch.zeros_like(tensor, device="cpu", dtype=dtype)


def all_finite(buffers: Sequence[torch.Tensor]) -> bool:
    """Whether every floating-point value in ``buffers`` is finite, in about one read of their memory: NaN and inf
    survive a sum, so a finite sum proves it; only a sum that is not finite (NaN/inf, or finite values that overflow
    it) pays for the exact min/max pass. ``torch.isfinite(b).all()`` allocates |b| and three masks and costs an order
    of magnitude more, twice per round on the all-reduce's critical path."""
    for b in buffers:
        if not b.is_floating_point() or b.numel() == 0 or bool(torch.isfinite(b.sum())):
            continue
        low, high = torch.aminmax(b)
        if not (bool(torch.isfinite(low)) and bool(torch.isfinite(high))):
            return False
    return True


def scale_and_check(tensors: Sequence[torch.Tensor], factor: float) -> bool:
    """Multiply ``tensors`` by ``factor`` in place and say whether every value was finite, in one pass over their
    memory (the fused kernel of torch's ``GradScaler``: as fast as the multiplication alone), falling back to the
    multiplication and ``all_finite``. Values that were not finite leave ``tensors`` unusable."""
    if not tensors:
        return True
    found = torch.zeros(1, device=tensors[0].device)
    try:
        torch._amp_foreach_non_finite_check_and_unscale_(list(tensors), found,
                                                         torch.full((1,), float(factor), device=tensors[0].device))
    except (RuntimeError, TypeError, NotImplementedError):  # e.g. dtypes or devices the fused kernel does not take
        for t in tensors:
            t.mul_(factor)
        return all_finite(tensors)
    return not bool(found.item())


@dataclass(frozen=True)
class AveragingResult:
    """A finished round: the members that contributed, what each member sent along (``gather``), and the group's
    weighted mean of every buffer (``averaged``: views of the averager's buffers, valid until the next round;
    ``None`` for a round alone, where the mean is this peer's own values)."""

    peers: Tuple[PeerID, ...]
    gathered: dict
    averaged: Optional[Sequence[torch.Tensor]] = None
    helpers: Tuple[PeerID, ...] = ()  # auxiliary members: they reduced parts and contributed nothing
    timing: Optional[RoundTiming] = None  # what the round took (``swarm_opt.deadlines``); None for a round alone

    @property
    def group_size(self) -> int:
        return len(self.peers)
