"""Every aggregation through the same checks: one registry (``swarm_opt.AGGREGATIONS``), one file.

What a reducer relies on whatever the aggregation: the result is bounded by the copies it combines (within their
largest norm), deterministic (every member receives the same bytes, and a rerun gives the same), agreeing copies kept
(to float32 rounding), and never carries NaN/inf: an unusable copy is left out, not averaged in.
"""

from __future__ import annotations

from typing import List

import pytest
import torch

import swarm_opt
from swarm_opt.aggregation import reduce_part

#: every registered aggregation with its defaults, plus non-default settings worth their own run
INSTANCES: List[swarm_opt.Aggregation] = [a() for a in swarm_opt.AGGREGATIONS] + [
    swarm_opt.Mean(max_norm_ratio=None), swarm_opt.TrimmedMean(fraction=0.0), swarm_opt.CenteredClip(tau=0.5,
                                                                                                      iterations=20)]
IDS = [repr(a) for a in INSTANCES]
GROUPS = [1, 2, 3, 4, 8]


def copies(n: int, d: int = 257, scale: float = 1.0, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + 31 * n)
    return (torch.randn(d, generator=g) + torch.randn(n, d, generator=g)) * scale


@pytest.mark.parametrize("aggregation", INSTANCES, ids=IDS)
class TestEveryAggregation:
    @pytest.mark.parametrize("n", GROUPS)
    @pytest.mark.parametrize("scale", [1e-20, 1.0, 1e30])
    def test_bounded_by_the_copies(self, aggregation, n, scale):
        parts = copies(n, scale=scale)
        result = reduce_part(aggregation, list(parts), [1.0 + i for i in range(n)])
        assert result.dtype == torch.float32 and result.shape == parts[0].shape
        assert bool(torch.isfinite(result).all())
        assert float(result.double().norm()) <= float(parts.double().norm(dim=1).max()) * (1 + 1e-6)

    @pytest.mark.parametrize("n", GROUPS)
    def test_deterministic(self, aggregation, n):
        parts, weights = copies(n), [float(i % 3 + 1) for i in range(n)]
        assert torch.equal(reduce_part(aggregation, list(parts), weights),
                           reduce_part(aggregation, list(parts.clone()), weights))

    @pytest.mark.parametrize("n", GROUPS)
    def test_agreeing_copies_kept(self, aggregation, n):
        one = copies(1)[0]  # to float32 rounding: the reducer computes in float32, as hivemind's sum
        assert torch.allclose(reduce_part(aggregation, [one.clone() for _ in range(n)], [2.0] * n), one,
                              rtol=4 * torch.finfo(torch.float32).eps, atol=0)

    @pytest.mark.parametrize("poison", [float("nan"), float("inf"), -float("inf")])
    def test_non_finite_copy_refused(self, aggregation, poison):
        parts = copies(5)
        clean = reduce_part(aggregation, list(parts[:4]), [1.0] * 4)
        parts[4, 7] = poison
        assert torch.equal(reduce_part(aggregation, list(parts), [1.0] * 5), clean)

    def test_shape_kept(self, aggregation):
        parts = copies(3, d=24).reshape(3, 2, 3, 4)
        assert reduce_part(aggregation, list(parts), [1.0] * 3).shape == (2, 3, 4)

    def test_frozen(self, aggregation):
        with pytest.raises(AttributeError):
            aggregation.tau = 1.0  # type: ignore[misc]
