"""PowerSGD's averaging protocol in hivemind's averager process: two all-reduces per round in one group, error
feedback that advances only with a committed round, and the Q lineage members agree on. The maths and the design
are in ``swarm_opt.compression.powersgd``."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import itertools
import logging
import multiprocessing as mp
from collections import Counter
from typing import Any, Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple

import torch
from hivemind.averaging.allreduce import AllreduceException
from hivemind.averaging.group_info import GroupInfo
from hivemind.compression import SizeAdaptiveCompression

from swarm_opt._hivemind.engine import _Engine
from swarm_opt._hivemind.gather import POWERSGD_KEY as _GATHER_KEY
from swarm_opt.buffers import AveragingResult
from swarm_opt.compression.codecs import NoCompression
from swarm_opt.compression.powersgd import (
    ErrorFeedback,
    PeerRound,
    PowerSGD,
    _lineage_hash,
    initial_factors,
    matrix_view,
)
from swarm_opt.errors import ConfigError

logger = logging.getLogger(__name__)

_PHASE_P = b".powersgd_p"  # group id suffix of phase 1 (phase 2 runs under the group's own id)


class _Tag(NamedTuple):
    """What each member sends along in the matchmaking gather."""

    attempt: int
    rank: int
    seed: int
    generation: int
    lineage: int
    min_compression: float

    @property
    def q_lineage(self) -> Tuple[int, int]:
        return self.generation, self.lineage


def _winning_lineage(lineages: Sequence[Tuple[int, int]]) -> Tuple[int, int]:
    """The Q lineage the group uses: held by most members, then the oldest, then the smallest hash."""
    counts = Counter(lineages)
    return max(counts, key=lambda lineage: (counts[lineage], lineage[0], -lineage[1]))


class PowerSGDEngine(_Engine):
    """The averager process of PowerSGD: two all-reduces per round in one group (see the module docstring).

    Host process: ``step`` tags each round with an attempt number and this peer's Q lineage; ``commit`` records the
    round the host applied. Averager process: ``_run_allreduce_inplace_`` runs the round on the shared buffers."""

    lane_in_host = False  # its lane rounds carry factors that this process computes between its two all-reduces

    def __init__(self, averaged_tensors: Sequence[torch.Tensor], dht: Any, *, compression: PowerSGD,
                 **kwargs: Any) -> None:
        tensors = tuple(averaged_tensors)
        for t in tensors:
            if not t.is_floating_point():
                raise ConfigError(f"{compression!r} averages floating-point gradients; got a {t.dtype} tensor")
        self.config = compression
        self._compressed = tuple(i for i, t in enumerate(tensors) if compression.compresses(t.shape))
        self._uncompressed = tuple(i for i in range(len(tensors)) if i not in self._compressed)
        seed_lineage = _lineage_hash(b"seed", str(compression.seed).encode(), str(compression.rank).encode())
        self._lineage = mp.Array(ctypes.c_int64, [0, seed_lineage])  # (generation, hash) of this peer's Q
        self._committed = mp.Array(ctypes.c_int64, [-1, -1])  # (attempt, round) the host applied last
        self._attempts = itertools.count()  # host process
        self._q: Optional[List[torch.Tensor]] = None  # averager process, built at its first round
        self._feedback: Optional[ErrorFeedback] = None
        self._last_total_weight: Optional[float] = None
        shapes = [t.shape for t in tensors]
        logger.info(f"{compression!r}: {len(self._compressed)} of {len(tensors)} gradient tensors compressed, "
                    f"{compression.values_per_round(shapes) / max(1, sum(t.numel() for t in tensors)):.3g}x the "
                    f"values of plain averaging per round")
        # the factors and the tensors sent whole travel with the chosen codec; the group's total weight (one value:
        # the only tensor below two values) exactly, since every share is divided by it
        codec = SizeAdaptiveCompression(2, less=NoCompression(), greater_equal=compression.factors)
        super().__init__(tensors, dht, compression=codec, **kwargs)

    # --- host process -----------------------------------------------------------------------------------------------
    def step(self, gather: Optional[Dict[str, Any]] = None, **kwargs: Any) -> Any:  # type: ignore[override]
        assert gather is None or isinstance(gather, dict), "TensorAverager gathers dicts"
        with self._lineage.get_lock():
            generation, lineage = self._lineage[:]
        tag = _Tag(next(self._attempts), self.config.rank, self.config.seed, generation, lineage,
                   float(self.config.min_compression))
        return super().step(gather={**(gather or {}), _GATHER_KEY: list(tag)}, **kwargs)

    def commit(self, result: AveragingResult, round_id: int) -> None:
        own = result.gathered.get(self.peer_id)
        tag = own.get(_GATHER_KEY) if isinstance(own, dict) else None
        with self._committed.get_lock():
            if tag:  # a round alone ran no attempt: the last committed attempt stays (its candidate is still owed)
                self._committed[0] = tag[0]
            self._committed[1] = round_id

    # --- averager process -------------------------------------------------------------------------------------------
    def _first_allreduce_id(self, group_info: GroupInfo) -> bytes:
        return group_info.group_id + _PHASE_P

    @contextlib.contextmanager
    def _register_allreduce_group(self, group_info: GroupInfo) -> Iterator[None]:
        phase_p = self._first_allreduce_id(group_info)
        self._running_groups[phase_p] = asyncio.Future()  # registered before the base class signals the group
        try:
            with super()._register_allreduce_group(group_info):
                yield
        finally:
            self._running_groups.pop(phase_p, None)

    def _check_tags(self, group_info: GroupInfo, gathered: Sequence[Any]) -> List[_Tag]:
        """Every member's tag; a member without PowerSGD or with another rank or seed fails the round, loudly."""
        tags = []
        for peer_id, user in zip(group_info.peer_ids, gathered):
            raw = user.get(_GATHER_KEY) if isinstance(user, dict) else None
            tag = _Tag(*raw) if isinstance(raw, list) and len(raw) == len(_Tag._fields) else None
            ours = (self.config.rank, self.config.seed, float(self.config.min_compression))
            if tag is None or (tag.rank, tag.seed, tag.min_compression) != ours:
                theirs = "no PowerSGD" if tag is None else \
                    f"PowerSGD(rank={tag.rank}, seed={tag.seed}, min_compression={tag.min_compression:g})"
                message = (f"peer {peer_id} averages with {theirs}, this peer with {self.config!r}: every peer of a "
                           f"run must pass the same compression=")
                logger.error(message)
                raise AllreduceException(message)
            tags.append(tag)
        return tags

    async def _run_allreduce_inplace_(self, tensors: Sequence[torch.Tensor], group_info: GroupInfo,
                                      group_id: Optional[bytes] = None, **kwargs: Any) -> None:
        assert group_id is None, "the base class runs one all-reduce per group; the phases call super() directly"
        weight = float(kwargs.pop("weight"))
        gathered = [self.serializer.loads(self.serializer.loads(g)[2]) for g in group_info.gathered]
        tags = self._check_tags(group_info, gathered)
        me = group_info.peer_ids.index(self.peer_id)
        mine, round_id = tags[me], int(gathered[me]["round"])
        if not self._compressed:  # nothing worth compressing: a plain weighted all-reduce
            await super()._run_allreduce_inplace_(tensors, group_info, weight=weight, **kwargs)
            return
        kwargs.update(weight=1.0, tensor_infos=None)  # every value below travels pre-scaled
        group_size = len(group_info.peer_ids)
        grads = [matrix_view(tensors[i]) for i in self._compressed]  # views of contiguous buffers
        if self._q is None or self._feedback is None:
            dtypes = [g.dtype for g in grads]
            self._q = initial_factors([g.shape for g in grads], self.config.rank, self.config.seed, dtypes)
            self._feedback = ErrorFeedback([g.shape for g in grads], dtypes)
        with self._committed.get_lock():
            committed_attempt, committed_round = self._committed[:]
        residuals, shares = self._feedback.begin(round_id, committed_attempt, committed_round)
        with self._lineage.get_lock():
            own_lineage = tuple(self._lineage[:])
        winner = _winning_lineage([t.q_lineage for t in tags])
        peer = PeerRound(grads, residuals, shares, self._q, weight=weight,
                         weight_estimate=self._last_total_weight, contributes=mine.q_lineage == winner == own_lineage,
                         redraw_seed=winner[1])

        # phase 1: the mean P over the members of the winning lineage, and the group's total weight
        ps = peer.phase1()
        total = torch.tensor([weight], dtype=torch.float64)
        phase_p = self._first_allreduce_id(group_info)
        await super()._run_allreduce_inplace_([*ps, total], group_info, phase_p, **kwargs)
        self._check_complete(phase_p)
        try:
            own_qs = peer.phase2(ps, float(total) * group_size)
        except ValueError as e:  # non-finite values or no weight: fail the round
            raise AllreduceException(str(e)) from e
        self._last_total_weight = float(total) * group_size

        # phase 2: Q̂ = Σ_i Q_i (sent as group_size·Q_i, averaged), and the weighted mean of the uncompressed tensors
        q_hats = [q * group_size for q in own_qs]
        uncompressed = [tensors[i] for i in self._uncompressed]
        for tensor in uncompressed:
            tensor.mul_(group_size * peer.fraction)
        await super()._run_allreduce_inplace_([*q_hats, *uncompressed], group_info, **kwargs)
        self._check_complete(group_info.group_id)
        if not all(bool(torch.isfinite(q).all()) for q in q_hats):
            raise AllreduceException("phase 2 of PowerSGD produced non-finite values")
        peer.finish(q_hats, out=grads)  # the updates overwrite the gradients' matrix views
        for i, update in zip(self._compressed, grads):
            if update.data_ptr() != tensors[i].data_ptr():  # a buffer that is not contiguous was copied: write back
                tensors[i].copy_(update.reshape(tensors[i].shape))
        self._q = q_hats
        with self._lineage.get_lock():
            self._lineage[:] = [winner[0] + 1, _lineage_hash(str(winner).encode(), bytes(group_info.group_id))]
        self._feedback.stage(mine.attempt)
