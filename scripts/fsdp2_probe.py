"""What of FSDP2 (``torch.distributed.fsdp.fully_shard``, DTensor) works on CPU with gloo here, and what swarm_opt's
strategies do with sharded parameters: the facts behind ``docs/ranks.md`` (Sharded models).

Run: ``OMP_NUM_THREADS=1 python scripts/fsdp2_probe.py`` (two ranks as processes on loopback, ~20 s). Prints one line
per check with each rank's outcome (``ok`` or the error's first line) and exits 1 if a check that the design relies
on failed (the FSDP2 calls themselves); the strategies' lines say which would need work on DTensors.
"""

from __future__ import annotations

import os
import socket
import sys
import traceback
from typing import Any, Callable, Dict, List

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

WORLD = 2
#: checks the sharded design builds on: the probe fails if one of them fails
FOUNDATIONS = ("fully_shard forward/backward", "2 ranks = 1 process on the union (SGD momentum)",
               "2 ranks = 1 process on the union (AdamW)", "DTensor.full_tensor() (all-gather)",
               "distribute_tensor(src_data_rank=None) (no communication)",
               "get_model_state_dict(full_state_dict=True)", "get_optimizer_state_dict(full_state_dict=True)",
               "set_optimizer_state_dict(full, broadcast_from_rank0=True)")


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def _batch(rank: int, n: int = 4):
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(n, 6, generator=g), torch.randn(n, 3, generator=g)


def _loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (model(x) - y).pow(2).mean()


def _sharded(seed: int = 0) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = _model(seed)
    mesh = init_device_mesh("cpu", (WORLD,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _equals_one_process(rank: int, make_inner: Callable[[Any], torch.optim.Optimizer]) -> str:
    """Three steps of the sharded model on each rank's batch against one process on both ranks' batches."""
    model, reference = _sharded(), _model()
    opt, ref_opt = make_inner(model.parameters()), make_inner(reference.parameters())
    for _ in range(3):
        opt.zero_grad()
        x, y = _batch(rank)
        _loss(model, x, y).backward()
        opt.step()
        ref_opt.zero_grad()
        xs, ys = zip(*[_batch(r) for r in range(WORLD)])
        _loss(reference, torch.cat(xs), torch.cat(ys)).backward()
        ref_opt.step()
    error = max((p.full_tensor() - q).abs().max().item() for p, q in zip(model.parameters(), reference.parameters()))
    if error > 1e-6:
        raise AssertionError(f"max difference {error:.2e}")
    return f"ok (max difference {error:.1e})"


def _checks(rank: int) -> Dict[str, Callable[[], str]]:
    from torch.distributed.tensor import DTensor, distribute_tensor

    def forward_backward() -> str:
        model = _sharded()
        _loss(model, *_batch(rank)).backward()
        grad = next(model.parameters()).grad
        return f"ok (grad {type(grad).__name__} {grad.placements}, local {tuple(grad.to_local().shape)})"

    def full_tensor() -> str:
        p = next(_sharded().parameters())
        full = p.full_tensor()
        assert torch.equal(full, next(_model().parameters()).detach())
        return f"ok ({tuple(p.to_local().shape)} -> {tuple(full.shape)})"

    def reshard() -> str:
        p = next(_sharded().parameters())
        full = torch.arange(p.numel(), dtype=p.dtype).reshape(p.shape)
        again = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None)
        assert torch.equal(again.full_tensor(), full)
        with torch.no_grad():
            p.to_local().copy_(again.to_local())
        assert torch.equal(p.full_tensor(), full)
        return "ok (and copied into the parameter's local shard)"

    def model_state() -> str:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(_sharded(), options=StateDictOptions(full_state_dict=True))
        assert all(not isinstance(v, DTensor) for v in state.values())
        return f"ok ({len(state)} plain full tensors on every rank)"

    def optimizer_state(set_too: bool = False) -> Callable[[], str]:
        def check() -> str:
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                get_optimizer_state_dict,
                set_optimizer_state_dict,
            )

            model = _sharded()
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            _loss(model, *_batch(rank)).backward()
            opt.step()
            full = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
            first = next(iter(full["state"].values()))
            assert not isinstance(first["exp_avg"], DTensor)
            if not set_too:
                return f"ok (exp_avg {tuple(first['exp_avg'].shape)}, plain)"
            other = _sharded(seed=1)
            other_opt = torch.optim.AdamW(other.parameters(), lr=1e-2)
            set_optimizer_state_dict(other, other_opt, full if rank == 0 else {},
                                     options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
            a = next(iter(opt.state.values()))["exp_avg"]
            b = next(iter(other_opt.state.values()))["exp_avg"]
            assert isinstance(b, DTensor) and torch.equal(a.to_local(), b.to_local())
            return "ok (each rank's shard of the state, sent from rank 0)"
        return check

    def plain_copy() -> str:
        p = next(_sharded().parameters())
        with torch.no_grad():
            p.copy_(torch.zeros(p.shape))
        return "ok"

    def digest() -> str:
        from swarm_opt.digest import parameter_digest

        return f"ok ({parameter_digest(list(_sharded().parameters()))[0]:.3f})"

    checks = {
        "fully_shard forward/backward": forward_backward,
        "2 ranks = 1 process on the union (SGD momentum)": lambda: _equals_one_process(
            rank, lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)),
        "2 ranks = 1 process on the union (AdamW)": lambda: _equals_one_process(
            rank, lambda p: torch.optim.AdamW(p, lr=1e-2)),
        "DTensor.full_tensor() (all-gather)": full_tensor,
        "distribute_tensor(src_data_rank=None) (no communication)": reshard,
        "get_model_state_dict(full_state_dict=True)": model_state,
        "get_optimizer_state_dict(full_state_dict=True)": optimizer_state(),
        "set_optimizer_state_dict(full, broadcast_from_rank0=True)": optimizer_state(set_too=True),
        "DTensor parameter.copy_(a plain full tensor)": plain_copy,
        "swarm_opt.digest.parameter_digest(DTensor parameters)": digest,
    }
    for row in _registry():
        checks[f"strategy {row}: bind, 2 local steps, a round's write"] = _strategy_check(rank, row)
    return checks


def _registry() -> List[str]:
    from swarm_opt.strategies import REGISTRY

    return [row.name for row in REGISTRY]


def _strategy_check(rank: int, name: str) -> Callable[[], str]:
    def check() -> str:
        from swarm_opt.buffers import buffer_like
        from tests.swarm.peer import make_strategy

        model = _sharded()
        params = list(model.parameters())
        inner = torch.optim.SGD(params, lr=0.1, momentum=0.9)
        strategy = make_strategy(name)
        stage = "bind"
        try:
            strategy.bind(params, inner)
            for step in (1, 2):
                stage = f"local step {step}"
                inner.zero_grad()
                _loss(model, *_batch(rank)).backward()
                with torch.no_grad():
                    strategy.local_step(4)
            stage = "begin_round"
            begun = strategy.begin_round()
            stage = "buffers"
            buffers = [buffer_like(t) for t in strategy.buffer_templates()]
            kinds = sorted({type(b).__name__ for b in buffers})
            stage = "write"
            with torch.no_grad():
                begun.write(buffers)
                begun.give_back()
        except Exception as e:
            raise RuntimeError(f"at {stage}: {type(e).__name__}: {_first_line(e)}") from None
        return f"ok (buffers: {', '.join(kinds)})"
    return check


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [""])[0][:110]


def _rank(rank: int, port: int, results: Any) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    outcome: Dict[str, str] = {}
    for name, check in _checks(rank).items():
        try:
            outcome[name] = check()
        except Exception as e:
            outcome[name] = f"FAILED {type(e).__name__}: {_first_line(e)}"
            if os.environ.get("PROBE_TRACEBACKS"):
                traceback.print_exc()
        dist.barrier()  # a check that failed on one rank only must not leave the other in a collective
    results[rank] = outcome
    dist.destroy_process_group()


def main() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_rank, args=(port, results), nprocs=WORLD, join=True)
        results = dict(results)
    print(f"torch {torch.__version__}, gloo, CPU, {WORLD} ranks")
    failed = False
    for name in results[0]:
        outcomes = {results[r][name] for r in range(WORLD)}
        shown = next(iter(outcomes)) if len(outcomes) == 1 else " | ".join(results[r][name] for r in range(WORLD))
        print(f"{name:58s} {shown}")
        failed |= name in FOUNDATIONS and any(o.startswith("FAILED") for o in outcomes)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
