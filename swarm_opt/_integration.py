"""What the framework adapters (``swarm_opt.lightning``, ``swarm_opt.transformers``) share.

``PeerOptions``: a peer's swarm options, checked when the adapter is built (no network, no process: the adapter
pickles); ``join`` starts the DHT (unless one was given) and wraps the framework's optimizer in a
``swarm_opt.Optimizer``; ``leave`` stops both, in that order. The adapters own only what their framework needs.
"""

from __future__ import annotations

import copy
from typing import Any, Optional, Sequence, Tuple

import torch

from swarm_opt._hivemind.node import DEFAULT_HOST_MADDRS, parse_maddrs, start_dht
from swarm_opt.aggregation import Aggregation
from swarm_opt.compression import Compression
from swarm_opt.config import Groups, SwarmConfig, Timeouts, TrackerConfig
from swarm_opt.errors import ConfigError, ConfigTypeError
from swarm_opt.gloo_lane import Gloo
from swarm_opt.offload import Offload
from swarm_opt.optimizer import Optimizer
from swarm_opt.options import resolve
from swarm_opt.privacy import OpacusPrivacy
from swarm_opt.strategies.base import Strategy

__all__ = ["PeerOptions"]


class PeerOptions:
    """The keyword options every adapter takes (see ``swarm_opt.lightning.SwarmCallback`` for their meaning),
    checked at construction. ``strategy`` is a template: each ``join`` binds a copy."""

    def __init__(
        self,
        *,
        run_id: str,
        target_batch_size: int,
        initial_peers: Sequence[str] = (),
        host_maddrs: Sequence[str] = DEFAULT_HOST_MADDRS,
        dht: Optional[Any] = None,
        batch_size: Optional[int] = None,
        strategy: Optional[Strategy] = None,
        compression: Optional[Compression] = None,
        aggregation: Optional[Aggregation] = None,
        transport: Optional[Gloo] = None,
        groups: Optional[Groups] = None,
        privacy: Optional[OpacusPrivacy] = None,
        timeouts: Optional[Timeouts] = None,
        matchmaking_time: Optional[float] = None,
        averaging_timeout: Optional[float] = None,
        tracker: Optional[TrackerConfig] = None,
        offload: Optional[Offload] = None,
    ) -> None:
        self.config = SwarmConfig(run_id, target_batch_size, batch_size)
        # every rule that pairs two options, checked now (no network, no process); ``Optimizer`` applies the same
        # rules (swarm_opt.options) to the copy of the strategy each ``join`` binds
        self.averaging = resolve(strategy=strategy, compression=compression, aggregation=aggregation,
                                 transport=transport, groups=groups, privacy=privacy, timeouts=timeouts,
                                 matchmaking_time=matchmaking_time, averaging_timeout=averaging_timeout)
        if offload is not None and not isinstance(offload, Offload):
            raise ConfigTypeError(f"offload must be swarm_opt.Offload(...) or None, got {offload!r}")
        self.offload = offload
        self.timeouts = self.averaging.timeouts
        if isinstance(initial_peers, str):
            raise ConfigTypeError("initial_peers must be a list of multiaddrs, e.g. initial_peers=[ADDRESS]")
        self.initial_peers = parse_maddrs(initial_peers, option="initial_peers", need_peer_id=True)
        self.host_maddrs = parse_maddrs(host_maddrs, option="host_maddrs")
        if dht is not None:
            import hivemind

            if not isinstance(dht, hivemind.DHT):
                raise ConfigTypeError(f"dht must be a started hivemind.DHT, got {type(dht).__name__}")
            if self.initial_peers:
                raise ConfigError("pass either dht (a DHT you started, already joined to the swarm) or "
                                  "initial_peers (the callback starts its own DHT), not both")
        if tracker is not None and not isinstance(tracker, TrackerConfig):
            raise ConfigTypeError(f"tracker must be swarm_opt.TrackerConfig(...), got {tracker!r}")
        self.strategy = self.averaging.strategy
        self.tracker = tracker
        self.dht = dht  # the caller's, or None: join starts one

    def join(self, inner: torch.optim.Optimizer, *, scheduler: Optional[Any] = None,
             clip_grad_norm: Optional[float] = None, batch_size_per_step: Optional[int] = None,
             local_group: Any = None, starts_dht: bool = True) -> Tuple[Any, Optimizer]:
        """Start a DHT (unless the options hold one, or ``starts_dht`` is False: a rank of a machine other than its
        rank 0, ``swarm_opt.ranks``) and a swarm optimizer around ``inner``; returns both. If the optimizer cannot
        be built, the DHT started here is stopped again."""
        dht = self.dht if self.dht is not None or not starts_dht else \
            start_dht(initial_peers=self.initial_peers, host_maddrs=self.host_maddrs)
        try:
            optimizer = Optimizer(
                dht=dht, run_id=self.config.run_id, target_batch_size=self.config.target_batch_size,
                optimizer=inner, offload=self.offload, scheduler=scheduler,
                batch_size_per_step=batch_size_per_step, strategy=copy.deepcopy(self.strategy),
                timeouts=self.timeouts, compression=self.averaging.compression,
                aggregation=self.averaging.aggregation, transport=self.averaging.transport,
                groups=self.averaging.groups, privacy=self.averaging.privacy, tracker=self.tracker,
                clip_grad_norm=clip_grad_norm, local_group=local_group)
        except BaseException:
            self.leave(None, dht)
            raise
        return dht, optimizer

    def leave(self, optimizer: Optional[Optimizer], dht: Optional[Any]) -> None:
        """Leave the swarm: shut ``optimizer`` down, then stop ``dht`` unless it is the caller's."""
        if optimizer is not None:
            optimizer.shutdown()
        if dht is not None and dht is not self.dht:
            dht.shutdown()
