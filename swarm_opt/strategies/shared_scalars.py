"""A few named scalars that a round averages beside the tensors, in one small float64 tensor.

Each scalar travels as a pair ``(p, p·v)``: ``p = 1`` if this peer has a value ``v`` (``0`` and nothing if it has
none). Every member decodes the group's weighted means of the pairs as ``mean(p·v) / mean(p)``: the weighted mean
over the members that had a value, identical on every member of the round, and ``None`` where no member had one.
A member's pair scaled by a norm bound (``Mean()``) keeps its ratio, so a scalar's value is never shrunk toward 0.
What comes back was computed from the groupmates' values, which may be hostile: callers bound what they decode.
"""

from __future__ import annotations

from typing import Dict, Optional, Sequence

import torch

_PRESENT = 1e-6  # a weighted mean of presences below this (only reachable by tampering) counts as no value


class SharedScalars:
    """The encoding of the scalars ``names`` (in that order) in a round's tensor."""

    def __init__(self, names: Sequence[str]) -> None:
        if len(set(names)) != len(names) or not names:
            raise ValueError(f"SharedScalars needs distinct names, got {list(names)}")
        self.names = tuple(names)

    def template(self) -> torch.Tensor:
        """The round's tensor for these scalars (its shape and dtype: ``Strategy.buffer_templates``)."""
        return torch.zeros(2 * len(self.names), dtype=torch.float64)

    def encode(self, values: Dict[str, Optional[float]], into: torch.Tensor) -> None:
        """Write this peer's ``values`` (``None``: no value) into ``into``, a buffer shaped like ``template()``."""
        pairs = []
        for name in self.names:
            value = values.get(name)
            pairs += [0.0, 0.0] if value is None else [1.0, float(value)]
        into.copy_(torch.tensor(pairs, dtype=into.dtype))

    def decode(self, averaged: torch.Tensor) -> Dict[str, Optional[float]]:
        """The group's value of each scalar (``None``: no member had one), from the round's averaged tensor."""
        pairs = averaged.detach().to(torch.float64).reshape(-1, 2).tolist()
        return {name: (weighted / presence if presence > _PRESENT else None)
                for name, (presence, weighted) in zip(self.names, pairs)}
