"""A machine whose model is sharded over its ranks (FSDP2's ``fully_shard``, DTensor parameters) as one peer.

The simplest correct form (``docs/ranks.md``, Sharded models): rank 0 holds **one full copy** of the parameters
(plain tensors, in host memory) and the swarm optimizer trains that copy, with its inner optimizer and strategy,
exactly as a single-process peer would; the ranks other than 0 hold only their shards (and shape-only ``meta``
stand-ins for the swarm optimizer's bookkeeping, which take no memory). At each step every rank gathers the full
gradient of each parameter from the shards (FSDP2's backward already averaged the ranks' gradients) and rank 0 keeps
it; whenever rank 0's copy changed (a local step, a round, a download, a restored checkpoint) it sends the full
parameters to the other ranks and every rank copies its own slice into its shard, without further communication
(``distribute_tensor(..., src_data_rank=None)``). So rank 0 needs host memory for one full model, its gradient and
its optimizer state (a lab machine has it), its inner optimizer steps on the CPU, and the machine speaks to the
swarm with full tensors: it averages with any peer of the same model, sharded or not.

``swarm_opt.ranks`` drives this from its voice and followers; ``Optimizer`` calls ``unshard`` once, before it
builds its inner optimizer.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from swarm_opt.errors import ConfigError

__all__ = ["Shards", "unshard"]


def _is_sharded(p: Any) -> bool:
    return type(p).__name__ == "DTensor" or type(getattr(p, "data", None)).__name__ == "DTensor"


class Shards:
    """The machine's sharded parameters (``sharded``, this rank's DTensors) and the swarm optimizer's stand-ins for
    them (``full``: plain full copies in host memory on rank 0, ``meta`` tensors of the same shapes on the other ranks).
    Construction is collective: every rank of the mesh gathers each parameter once."""

    def __init__(self, sharded: Sequence[torch.Tensor], keeps_copy: bool) -> None:
        self.sharded = list(sharded)
        self.keeps_copy = keeps_copy
        self.full: List[torch.nn.Parameter] = []
        for p in self.sharded:
            gathered = p.detach().full_tensor()  # collective over the mesh: every rank, in the same order
            copy = gathered.to("cpu", copy=True) if keeps_copy else torch.empty(gathered.shape, dtype=gathered.dtype,
                                                                                device="meta")
            self.full.append(torch.nn.Parameter(copy, requires_grad=p.requires_grad))
        self._copy_of = {id(p): f for p, f in zip(self.sharded, self.full)}

    def gather_gradients(self) -> None:
        """Every rank: the full gradient of each parameter (from every rank's shard: FSDP2 averaged them) onto rank
        0's copy; the shards' gradients are consumed (set to None), as ``zero_grad`` would."""
        for p, f in zip(self.sharded, self.full):
            if p.grad is None:  # the same on every rank: the same model, the same backward
                f.grad = None
                continue
            full = p.grad.full_tensor()
            if self.keeps_copy:
                f.grad = full.to("cpu", f.dtype)
            p.grad = None

    def scatter(self, stand_ins: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> None:
        """Every rank: copy its slice of the full ``values`` of ``stand_ins`` (some of ``full``, in any order: the
        swarm optimizer's, that of its param groups) into the matching shards (no communication)."""
        index = {id(f): i for i, f in enumerate(self.full)}
        for stand_in, value in zip(stand_ins, values):
            _copy_into_shard(self.sharded[index[id(stand_in)]], value)

    def model_state(self, model: torch.nn.Module) -> Dict[str, Any]:
        """``model.state_dict()`` with rank 0's full copies in place of the shards: what a checkpoint holds (the
        same as a single-process peer's)."""
        by_name = {name: self._copy_of.get(id(p)) for name, p in model.named_parameters()}
        state = model.state_dict()
        for name, value in state.items():
            if _is_sharded(value):
                copy = by_name.get(name)
                if copy is None:
                    raise ConfigError(f"the model's sharded parameter {name!r} is not one the swarm optimizer trains: "
                                      f"pass all the model's parameters to swarm_opt.Optimizer")
                state[name] = copy.detach().clone()
        return state

    def load_model_state(self, model: torch.nn.Module, state: Dict[str, Any]) -> None:
        """Every rank: load a full ``state`` (``model_state``'s) into the shards, and on rank 0 into its copies
        too; the model's other entries (buffers) as ``load_state_dict`` does."""
        by_name = dict(model.named_parameters())
        sharded = {name for name, p in by_name.items() if id(p) in self._copy_of}
        missing = sorted(sharded - set(state))
        if missing:
            raise ConfigError(f"the checkpoint holds no values for the model's parameters {missing[:3]}")
        for name in sharded:
            p = by_name[name]
            _copy_into_shard(p, state[name])
            if self.keeps_copy:
                with torch.no_grad():
                    self._copy_of[id(p)].copy_(state[name])
        model.load_state_dict({k: v for k, v in state.items() if k not in sharded}, strict=False)


def _copy_into_shard(p: torch.Tensor, value: torch.Tensor) -> None:
    """This rank's slice of the full ``value`` into the sharded parameter ``p`` (in place: the storage FSDP2
    trains), computed from ``p``'s mesh and placements without communication."""
    from torch.distributed.tensor import distribute_tensor

    with torch.no_grad():
        local = p.to_local()
        local.copy_(distribute_tensor(value.detach().to(local.device, local.dtype), p.device_mesh, p.placements,
                                      src_data_rank=None).to_local())


def unshard(optimizer: Any, params: Optional[Iterable[Any]], *, rank: int, world_size: int
            ) -> Tuple[Optional[Iterable[Any]], Optional[Shards]]:
    """``Optimizer(params=...)`` with the parameters a sharded model's (DTensors) replaced by their ``Shards``
    stand-ins (param groups keep their options), and the ``Shards``; ``(params, None)`` for a replicated model.
    ``rank``, ``world_size``: this process in the machine's local group (its rank 0 keeps the full copy)."""
    if params is None:
        inner_params = [p for group in getattr(optimizer, "param_groups", []) for p in group["params"]]
        if any(_is_sharded(p) for p in inner_params):
            raise ConfigError("the optimizer's parameters are sharded (FSDP2 fully_shard / DTensor): pass an optimizer "
                              "factory and the model's parameters, Optimizer(params=model.parameters(), "
                              "optimizer=lambda p: torch.optim.AdamW(p, lr=...)), so that rank 0 can build the "
                              "optimizer of its full copy (docs/ranks.md)")
        return params, None
    items = list(params)
    groups = items if items and isinstance(items[0], dict) else [{"params": items}]
    flat = [p for group in groups for p in group["params"]]
    if not any(_is_sharded(p) for p in flat):
        return items, None
    if not all(_is_sharded(p) for p in flat):
        raise ConfigError("some of the model's parameters are sharded (FSDP2 / DTensor) and some are not: shard the "
                          "whole model with fully_shard (its root module too), or none of it")
    if world_size < 2:
        raise ConfigError("the model's parameters are sharded (FSDP2 fully_shard / DTensor) but this process is no "
                          "rank of a local group of several: shard over the machine's ranks (torchrun, "
                          "torch.distributed initialised) with swarm_opt's local group (docs/ranks.md), or do not "
                          "shard a model that one process trains")
    for p in flat:
        mesh = p.device_mesh
        if mesh.ndim != 1 or mesh.size() != world_size:
            raise ConfigError(f"the model is sharded over a device mesh of shape {tuple(mesh.shape)}; swarm_opt "
                              f"supports a 1-D mesh over the machine's {world_size} ranks (fully_shard(model, "
                              f"mesh=init_device_mesh(device, ({world_size},))))")
    shards = Shards(flat, keeps_copy=rank == 0)
    replace = dict(zip(map(id, flat), shards.full))
    if items and isinstance(items[0], dict):
        return [dict(group, params=[replace[id(p)] for p in group["params"]]) for group in groups], shards
    return [replace[id(p)] for p in flat], shards
