"""The one module that talks to hivemind's averaging: all-reduce a fixed list of tensors and serve state to peers.

``TensorAverager`` owns a hivemind ``DecentralizedAverager`` process with shared-memory buffers shaped like the
tensors it averages. A round is scheduled ahead of time (matchmaking runs while the peer still computes), then
triggered: the caller writes its values straight into the buffers and gets the group's average back as views of
them (``AveragingResult.averaged``), so nothing is copied that the caller does not need. The result says who took
part; a round that failed or produced non-finite numbers returns ``None`` and the caller's own tensors were never
touched.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.allreduce import AllreduceException
from hivemind.averaging.control import StepControl
from hivemind.compression import CompressionBase, NoCompression
from hivemind.dht import DHT
from hivemind.p2p import PeerID
from hivemind.utils import get_dht_time

from swarm_opt._fork import without_tensor_memory
from swarm_opt.config import Timeouts

logger = logging.getLogger(__name__)

StateProvider = Callable[[], Tuple[Any, Sequence[torch.Tensor]]]
BufferWriter = Callable[[Sequence[torch.Tensor]], None]


def buffer_like(tensor: torch.Tensor) -> torch.Tensor:
    """The averaging buffer of one tensor: on the CPU, in at least fp32 whatever the model's precision."""
    dtype = torch.promote_types(tensor.dtype, torch.float32) if tensor.is_floating_point() else tensor.dtype
    return torch.zeros_like(tensor, device="cpu", dtype=dtype)


@dataclass(frozen=True)
class AveragingResult:
    """A finished round: the group it ran in, what each member sent along (``gather``), and the group's weighted
    mean of every buffer (``averaged``: views of the averager's buffers, valid until the next round; ``None`` for a
    round alone, where the mean is this peer's own values)."""

    peers: Tuple[PeerID, ...]
    gathered: dict
    averaged: Optional[Sequence[torch.Tensor]] = None

    @property
    def group_size(self) -> int:
        return len(self.peers)


class _Engine(DecentralizedAverager):
    """hivemind's averager, with two changes: the state it serves to newcomers comes from the host process, and a
    round in which any part was not averaged by everyone fails instead of reporting success (hivemind silently falls
    back to local values for the parts of a peer that timed out, which would leave this peer's result different
    from its groupmates')."""

    state_provider: Optional[StateProvider] = None

    async def _aggregate_with_group(self, group_info, min_vector_size: int, **kwargs):  # runs in the averager process
        gathered = await super()._aggregate_with_group(group_info, min_vector_size, **kwargs)
        runner_future = self._running_groups.get(group_info.group_id)
        if runner_future is not None and runner_future.done() and not runner_future.exception():
            runner = runner_future.result()
            if runner.banned_senders or runner.tensor_part_container.failed_size:
                raise AllreduceException(
                    f"partial all-reduce: {len(runner.banned_senders)} sender(s) timed out, "
                    f"{runner.tensor_part_container.failed_size} values not averaged"
                )
        return gathered

    def get_current_state(self):  # runs in the host process, in hivemind's state-fetching thread
        provider = self.state_provider
        if provider is None:
            return None, [], None
        metadata, tensors = provider()
        return metadata, list(tensors), None


class TensorAverager:
    """All-reduce tensors shaped like ``templates`` with the peers of ``prefix``; serve and download state."""

    def __init__(
        self,
        dht: DHT,
        *,
        prefix: str,
        templates: Sequence[torch.Tensor],
        timeouts: Timeouts,
        compression: CompressionBase = NoCompression(),
        state_provider: Optional[StateProvider] = None,
    ) -> None:
        self.timeouts = timeouts
        buffers = [buffer_like(t) for t in templates]
        self._engine = _Engine(
            buffers, dht, start=False, prefix=prefix, min_matchmaking_time=timeouts.matchmaking_time,
            request_timeout=timeouts.request_timeout, allreduce_timeout=timeouts.averaging_timeout,
            next_chunk_timeout=timeouts.averaging_timeout / 3, compression=compression,
            declare_state_period=max(2.0, timeouts.matchmaking_time), shutdown_timeout=5.0,
        )
        self._engine.state_provider = state_provider
        with without_tensor_memory():  # the averager process never reads the model: it must not copy it
            self._engine.run_in_background(await_ready=True, timeout=60)
        self._scheduled: Optional[StepControl] = None
        self._scheduled_round = -1
        self._lock = threading.Lock()

    @property
    def client_mode(self) -> bool:
        return self._engine.client_mode

    @property
    def peer_id(self) -> PeerID:
        return self._engine.peer_id

    def set_priority(self, priority: float) -> None:
        """Newcomers download state from the donors of highest priority first (we use the epoch)."""
        if not self.client_mode and self._engine.state_sharing_priority != priority:
            self._engine.state_sharing_priority = float(priority)

    def schedule(self, when: float, round_id: int) -> None:
        """Start matchmaking now for round ``round_id`` (the epoch it completes), due at DHT time ``when``."""
        with self._lock:
            if self._scheduled is not None and not self._scheduled.done():
                if self._scheduled_round == round_id:
                    return
                self._scheduled.cancel()
            when = max(when, get_dht_time() + self.timeouts.matchmaking_time)
            self._scheduled_round = round_id
            self._scheduled = self._engine.step(
                scheduled_time=when, weight=0.0, timeout=self.timeouts.averaging_timeout,
                require_trigger=True, wait=False, gather={"round": round_id}, allow_retries=False,
            )

    def all_reduce(self, write: BufferWriter, weight: float, round_id: int) -> Optional[AveragingResult]:
        """Average with a group of peers in the same round: ``write(buffers)`` puts this peer's values into the
        buffers, the result holds the group's weighted mean; ``None`` if the round failed or mixed peers of
        different rounds."""
        with self._engine.get_tensors() as buffers:
            write(buffers)
            finite = all(bool(torch.isfinite(b).all()) for b in buffers if b.is_floating_point())
        if not finite:
            # sit the round out instead of sending poison: a sender whose part fails mid-round gets banned by the
            # reducers, and a groupmate whose parts were reduced elsewhere could not tell it got a partial average
            logger.warning("This peer's tensors hold NaN/inf values; it sits out the averaging round")
            self.cancel_scheduled()
            return None
        self.schedule(get_dht_time(), round_id)
        with self._lock:
            control, self._scheduled = self._scheduled, None
        assert control is not None
        try:
            control.weight = float(weight)
            control.allow_allreduce()
            gathered = control.result(timeout=self.timeouts.averaging_timeout + self.timeouts.matchmaking_time)
        except Exception as e:  # matchmaking or all-reduce failed: the caller keeps its local state
            logger.debug("Averaging round failed: %r", e)
            control.cancel()
            return None
        if not gathered:
            return None
        rounds = {info.get("round") if isinstance(info, dict) else None for info in gathered.values()}
        if rounds != {round_id}:
            # a peer that fell behind joined the swarm's next round: nobody may apply this mixture
            logger.debug("Discarding a round that mixed peers of rounds %s", rounds)
            return None
        with self._engine.get_tensors() as buffers:
            if not all(bool(torch.isfinite(b).all()) for b in buffers if b.is_floating_point()):
                logger.warning("A peer sent non-finite values; the round is discarded and retried")
                return None
        # the buffers stay untouched until this peer triggers its next round: the caller reads them as they are
        return AveragingResult(peers=tuple(gathered.keys()), gathered=dict(gathered), averaged=tuple(buffers))

    def cancel_scheduled(self) -> None:
        with self._lock:
            control, self._scheduled = self._scheduled, None
        if control is not None and not control.done():
            control.cancel()

    def load_state(self, timeout: float) -> Optional[Tuple[Any, List[torch.Tensor]]]:
        """Download (metadata, tensors) from the best donor; ``None`` if nobody answered."""
        try:
            return self._engine.load_state_from_peers(timeout=timeout)
        except Exception as e:
            logger.debug("State download failed: %r", e)
            return None

    def shutdown(self) -> None:
        self.cancel_scheduled()
        self._engine.state_provider = None
        if self._engine.is_alive():
            self._engine.shutdown()
