"""The swarm's state as peers hand it to each other: what a donor serves, and the checks a downloaded state passes
before anything of it is applied.

A donor serves one consistent snapshot (``snapshot``): metadata (format, model schema, epoch, the skeleton of the
nested state) and a flat list of CPU tensors, with the parameters that never leave it (``Strategy.
personal_parameters``) as zeros and without their optimizer state. A downloading peer trusts nothing of it until
``parse_state`` accepted it: the format and the model schema must be this peer's, the epoch a non-negative int no
older than the one needed (``DonorBehind`` otherwise: donors are asked most advanced first, so none further on is
ahead), the skeleton must rebuild, and every parameter must match the local one in shape and dtype and be finite.
``Optimizer.load_state_from_peers`` runs the download and applies what passed (under its state lock, all or
nothing); the digest check against the swarm's records (``ProgressTracker.expected_params_digest``) is its own.
"""

from __future__ import annotations

from typing import Any, Dict, List, Sequence, Set, Tuple

import torch

from swarm_opt.errors import IncompatibleStateError
from swarm_opt.serialization import flatten, unflatten

STATE_FORMAT = 1
#: seconds a state download waits for fresh progress records to check the state against
RECORDS_READ_TIMEOUT = 5.0
#: seconds a newcomer tries to download from the peers ahead before its own epoch counts
NEWCOMER_PATIENCE = 15.0


class DonorBehind(IncompatibleStateError):
    """The donor's state is older than the epoch this peer needs."""


def snapshot(params: Sequence[torch.Tensor], optimizer: Dict[str, Any], *, personal: Set[int], schema: str,
             epoch: int) -> Tuple[Dict[str, Any], List[torch.Tensor]]:
    """What a donor serves: the parameters (zeros for the ``personal`` positions, whose optimizer state is left out)
    and ``optimizer`` (``Optimizer.state_dict()``'s output), copied to the CPU."""
    optimizer = dict(optimizer)
    optimizer["state"] = {k: v for k, v in optimizer["state"].items() if k not in personal}
    params = [torch.zeros_like(p) if i in personal else p for i, p in enumerate(params)]
    skeleton, tensors = flatten({"params": params, "optimizer": optimizer})
    tensors = [t.detach().to("cpu", copy=True) for t in tensors]
    return {"format": STATE_FORMAT, "schema": schema, "epoch": epoch, "skeleton": skeleton}, tensors


def parse_state(metadata: Any, tensors: List[torch.Tensor], *, schema: str, params: Sequence[torch.Tensor],
                min_epoch: int) -> Tuple[int, Dict[str, Any]]:
    """A downloaded state's epoch and nested state (``{"params": [...], "optimizer": {...}}``), checked against this
    peer's model (``schema``, ``params``); ``IncompatibleStateError`` (``DonorBehind``: older than ``min_epoch``)
    for anything else."""
    if not isinstance(metadata, dict) or metadata.get("format") != STATE_FORMAT:
        raise IncompatibleStateError("unknown state format")
    if metadata.get("schema") != schema:
        raise IncompatibleStateError("the donor trains a different model")
    epoch = metadata.get("epoch")
    if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0:
        raise IncompatibleStateError(f"bad epoch {epoch!r}")
    if epoch < min_epoch:
        raise DonorBehind(f"the donor is at epoch {epoch}, behind epoch {min_epoch}")
    try:
        state = unflatten(metadata.get("skeleton"), list(tensors))
    except ValueError as e:
        raise IncompatibleStateError(str(e)) from e
    if not isinstance(state, dict) or not isinstance(state.get("params"), list):
        raise IncompatibleStateError("state without parameters")
    check_tensors_fit(state["params"], params)
    return epoch, state


def check_tensors_fit(received: List[Any], local: Sequence[torch.Tensor]) -> None:
    """Every received parameter matches the local one in shape and dtype, and is finite."""
    if len(received) != len(local):
        raise IncompatibleStateError(f"{len(received)} parameters received, {len(local)} expected")
    for i, (new, old) in enumerate(zip(received, local)):
        if not isinstance(new, torch.Tensor) or new.shape != old.shape or new.dtype != old.dtype:
            raise IncompatibleStateError(f"parameter {i} does not match the local model")
        if new.is_floating_point() and not bool(torch.isfinite(new).all()):
            raise IncompatibleStateError(f"parameter {i} holds non-finite values")


def with_own_entries(optimizer: Any, own: Dict[str, Any], keys: Sequence[str]) -> Any:
    """A downloaded optimizer state with the strategy's own entries (``keys``: ``Strategy.own_state``) replaced by
    this peer's (``own``: its strategy's ``state_dict()``)."""
    extra = optimizer.get("swarm_opt") if isinstance(optimizer, dict) else None
    if not keys or not isinstance(extra, dict) or not isinstance(extra.get("strategy"), dict):
        return optimizer
    strategy = {k: v for k, v in extra["strategy"].items() if k not in keys}
    strategy.update({k: own[k] for k in keys if k in own})
    return {**optimizer, "swarm_opt": {**extra, "strategy": strategy}}


def with_own_personal_state(optimizer: Any, own: Dict[Any, Any], personal: Set[int]) -> Any:
    """A downloaded optimizer state whose entries for the ``personal`` positions (the donor sent none) are this
    peer's (``own``: its inner optimizer's ``state_dict()["state"]``)."""
    if not personal or not isinstance(optimizer, dict) or not isinstance(optimizer.get("state"), dict):
        return optimizer
    state = {**{k: v for k, v in optimizer["state"].items() if k not in personal},
             **{k: v for k, v in own.items() if k in personal}}
    return {**optimizer, "state": state}
