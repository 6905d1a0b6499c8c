"""A test peer: trains a small MLP on a deterministic shard of synthetic data and records what it did.

Run as ``python peer.py CONFIG.json``; writes CONFIG["out"] (torch.save) with the final parameters, the batches it
committed to each epoch, and its round reports. Every choice comes from the JSON config so tests stay declarative.
"""

from __future__ import annotations

import functools
import gc
import json
import math
import os
import signal
import sys
import time

import torch


def make_data(seed: int = 0, n: int = 4096, dim: int = 16, classes: int = 4):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g)
    w = torch.randn(dim, classes, generator=g)
    y = (x @ w + 0.5 * torch.randn(n, classes, generator=g)).argmax(dim=1)
    return x, y


def make_model(dtype: torch.dtype = torch.float32, seed: int = 0, width: int = 32) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, width), torch.nn.Tanh(), torch.nn.Linear(width, 4)).to(dtype)


def make_inner(name: str):
    if name == "adam":
        # eps well above float32 round-off: Adam divides by |g|, so tiny gradients amplify summation-order noise
        return lambda p: torch.optim.Adam(p, lr=0.01, eps=1e-6)
    if name == "adamw":  # a transformer recipe's: weight decay on the weights only, through parameter groups
        return lambda p: torch.optim.AdamW(decay_groups(p, 0.1), lr=0.01, eps=1e-6)
    if name == "sgd_plain":  # for peers that send their momentum (WorkerMomentum): lr 0.1 on an undampened one
        return lambda p: torch.optim.SGD(p, lr=1.0)
    return lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)


def decay_groups(params, weight_decay: float) -> list:
    """Parameter groups: ``weight_decay`` on the weights (matrices), none on the biases (vectors)."""
    params = list(params)
    return [{"params": [p for p in params if p.dim() > 1], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() <= 1], "weight_decay": 0.0}]


def make_scheduler(name, epochs: int):
    """A scheduler factory stepped once per global epoch: ``True`` halves the lr each epoch (StepLR);
    ``"warmup_cosine"``: linear warmup over the first third of ``epochs``, then cosine decay."""
    if not name:
        return None
    if name == "warmup_cosine":
        warmup = max(1, epochs // 3)

        def factor(epoch: int) -> float:
            if epoch < warmup:
                return (epoch + 1) / warmup
            return 0.5 * (1 + math.cos(math.pi * (epoch - warmup) / (epochs - warmup + 1)))
        return lambda o: torch.optim.lr_scheduler.LambdaLR(o, factor)
    return lambda o: torch.optim.lr_scheduler.StepLR(o, 1, gamma=0.5)


LSQ_DIM = 5


def lsq_problem(rank: int, outputs: int = 1):
    """Peer ``rank``'s least-squares problem ½‖A Wᵀ − B‖² (heterogeneous across ranks), as in the unit tests; B has
    ``outputs`` columns (a vector for one output, W then a row)."""
    g = torch.Generator().manual_seed(500 + rank)
    a = torch.randn(16, LSQ_DIM, generator=g, dtype=torch.float64) / 4 * (1 + 0.5 * (rank % 4))
    b = torch.randn(16, generator=g, dtype=torch.float64) * 3 + rank
    if outputs > 1:
        extra = [torch.randn(16, generator=g, dtype=torch.float64) * 3 + rank for _ in range(outputs - 1)]
        b = torch.stack([b, *extra], dim=1)
    return a, b


def lsq_optimum(ranks) -> torch.Tensor:
    problems = [lsq_problem(r) for r in ranks]
    return torch.linalg.solve(sum(a.T @ a for a, _ in problems), sum(a.T @ b for a, b in problems))


def make_strategy(name: str, model=None):
    import swarm_opt

    if name == "local_keep_head":  # FedPer: the MLP's last layer ("2.") stays on each peer
        return swarm_opt.LocalUpdates(exchange=swarm_opt.KeepLocal(model, lambda n, m: n.startswith("2.")))
    return {
        "grad": swarm_opt.GradientAveraging,
        "grad_overlap": lambda: swarm_opt.GradientAveraging(overlap=swarm_opt.Overlap()),
        "grad_momentum": lambda: swarm_opt.GradientAveraging(momentum=swarm_opt.WorkerMomentum(0.9)),
        "local": swarm_opt.LocalUpdates, "scaffold": swarm_opt.Scaffold, "fednova": swarm_opt.FedNova,
        "fedprox": lambda: swarm_opt.FedProx(mu=0.01),
        "local_peer_dp": lambda: swarm_opt.LocalUpdates(peer_dp=swarm_opt.PeerDP(
            noise_multiplier=0.01, clip=swarm_opt.AdaptiveClip(0.05, target_quantile=0.5), split=3)),
        "fedprox_adaptive": lambda: swarm_opt.FedProx(mu=1.0, adaptive=swarm_opt.AdaptiveMu(delta=0.1, patience=2)),
        "diloco": lambda: swarm_opt.DiLoCo(outer_optimizer=lambda p: torch.optim.SGD(p, lr=0.7, momentum=0.9,
                                                                                        nesterov=True)),
        "diloco_overlap": lambda: swarm_opt.DiLoCo(outer_optimizer=lambda p: torch.optim.SGD(
            p, lr=0.7, momentum=0.9, nesterov=True), overlap=swarm_opt.Overlap()),
    }[name]()


def die() -> None:
    """SIGKILL this whole peer (user process, DHT, averager, p2pd: they share the process group)."""
    os.killpg(0, signal.SIGKILL)


def claim(path: str) -> bool:
    """True for the first process that claims ``path`` (so that exactly one armed peer dies)."""
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL))
        return True
    except FileExistsError:
        return False


SENT: dict = {}  # round id -> (weight, the buffers this peer wrote), with config record_sent


def install_fault(cfg: dict) -> None:
    """Fault injection at a precise phase (as torchft's EventInjector), patched into the classes before the
    averager process forks, so that it acts inside hivemind's averager process.

    * ``die_in_allreduce``: once ``OUT.arm`` exists, die as soon as the first averaged part of a round comes back
      (this peer sent its tensors and its groupmates are still exchanging parts with it). With ``hold_replies``,
      once armed its reducer also holds back the means it owes them, so that they surely still wait for its share
      when it dies, whatever the machine's load (without, its share may all have gone out first).
    * ``die_while_serving``: die right after sending the first message of its state to a newcomer, if this peer is
      the first to claim the file ``die_while_serving``.
    * ``slow_replies``: this peer's reducers wait that many seconds before each averaged part they send back to a
      groupmate (its own share is not delayed), so that it ends its rounds before its groupmates; writes
      ``OUT.slowed`` the first time. With ``slow_from_epoch``, only once the peer reached that epoch (a swarm that
      becomes slow: its links, or its machines' load). With ``slow_once``, only the first reply so delayed (a member
      stuck once mid-round: a laptop's lid closed, a link down for a while).
    * ``bug_in_write``: a bug in the strategy's code: every round's ``write`` raises (in the averager's caller,
      the training loop's thread or the background round's).
    * ``serve_perturbed``: a lying donor: the parameters it serves to newcomers are perturbed (its own stay as they
      are, so its progress record still shows the swarm's digest), and it announces itself as the best donor.
    * ``lie_in_reduce``: a lying reducer: every mean it reduces for its groupmates is sent with this offset added
      (the same wrong values to every member; its own share is not changed).
    * ``never_averages``: a peer always too late for its group: each of its rounds fails once the swarm completed it
      without this peer (or after ``averaging_timeout``), as a peer starved of CPU does.
    * ``slow_reads``: every read of the swarm's progress records returns that many seconds after the DHT answered
      (a loaded machine, or a DHT over slow links): this peer sees the others late, and what it sees is that old.
    * ``hang_in_round``: from that round on, the peer's all-reduce never returns (a process stuck inside its round:
      a deadlock, a stalled device); writes ``OUT.hung`` as it hangs. With adaptive deadlines it hangs in the first
      such round whose deadline followed the measured rounds below the user's bound (under load, a start-up round
      that missed its deadline puts the deadline back to the bound for the next rounds)."""
    if cfg.get("slow_reads"):
        from swarm_opt.progress import SampledRecords

        original_request, delay = SampledRecords._request, float(cfg["slow_reads"])

        class LateAnswer:
            def __init__(self, future) -> None:
                self.future = future

            def result(self, timeout=None):
                value = self.future.result(timeout=timeout)
                time.sleep(delay)
                return value

        SampledRecords._request = lambda self, shard: LateAnswer(original_request(self, shard))
    if cfg.get("hang_in_round"):
        from swarm_opt._hivemind.tensor_averager import TensorAverager

        original_all_reduce = TensorAverager.all_reduce

        @functools.wraps(original_all_reduce)
        def all_reduce(self, write, weight, round_id, *args, **kwargs):
            adapted = self.deadlines.averaging_timeout < self.timeouts.averaging_timeout
            if round_id >= cfg["hang_in_round"] and (adapted or not self.timeouts.adaptive):
                open(cfg["out"] + ".hung", "w").close()
                time.sleep(3600)
            return original_all_reduce(self, write, weight, round_id, *args, **kwargs)

        TensorAverager.all_reduce = all_reduce
    if cfg.get("record_sent"):  # what this peer writes into its averager's buffers (all the averager sends)
        from swarm_opt._hivemind.tensor_averager import TensorAverager

        original_all_reduce = TensorAverager.all_reduce

        @functools.wraps(original_all_reduce)
        def all_reduce(self, write, weight, round_id, *args, **kwargs):
            def recording_write(buffers):
                write(buffers)
                SENT[round_id] = (float(weight), [b.detach().clone() for b in buffers])  # the last try's values
            return original_all_reduce(self, recording_write, weight, round_id, *args, **kwargs)

        TensorAverager.all_reduce = all_reduce
    if cfg.get("bug_in_write"):
        from swarm_opt._hivemind.tensor_averager import TensorAverager

        original_all_reduce = TensorAverager.all_reduce

        def write_with_a_bug(buffers):
            raise RuntimeError("injected bug in write")

        @functools.wraps(original_all_reduce)
        def all_reduce(self, write, *args, **kwargs):
            return original_all_reduce(self, write_with_a_bug, *args, **kwargs)

        TensorAverager.all_reduce = all_reduce
    if cfg.get("never_averages"):
        from swarm_opt._hivemind.tensor_averager import TensorAverager

        def all_reduce(self, write, weight, round_id, round_is_over=lambda: False):
            deadline = time.monotonic() + self.timeouts.averaging_timeout
            while not round_is_over() and time.monotonic() < deadline and self._engine.is_alive():
                time.sleep(0.05)  # returns at once after shutdown, as the real one does: a daemon thread left
                # running into the interpreter's finalization can abort the process
            return self._failed("injected: this peer never finds its group in time")

        def schedule(self, when, round_id):  # nor does it look for one ahead: nobody waits for it
            pass

        TensorAverager.all_reduce, TensorAverager.schedule = all_reduce, schedule
    if cfg.get("serve_perturbed"):
        from swarm_opt._hivemind.tensor_averager import TensorAverager
        from swarm_opt.optimizer import Optimizer

        original_state, original_offer = Optimizer._shareable_state, TensorAverager.offer_state

        def _shareable_state(self):
            metadata, tensors = original_state(self)
            return metadata, [t + 0.01 if i < len(self._params) else t for i, t in enumerate(tensors)]

        def offer_state(self, priority):
            original_offer(self, priority + 0.5)

        Optimizer._shareable_state, TensorAverager.offer_state = _shareable_state, offer_state
    if cfg.get("lie_in_reduce"):
        from swarm_opt._hivemind.allreduce import AllOrNothingRunner

        original_mean = AllOrNothingRunner._encoded_mean

        @functools.wraps(original_mean)
        async def _lying_mean(self, part_index, averaged_part, compression):
            return await original_mean(self, part_index, averaged_part + cfg["lie_in_reduce"], compression)

        AllOrNothingRunner._encoded_mean = _lying_mean
    if cfg.get("slow_replies"):
        import asyncio

        from swarm_opt._hivemind.allreduce import AllOrNothingRunner

        original_reply = AllOrNothingRunner._encoded_mean

        @functools.wraps(original_reply)
        async def _encoded_mean(self, *args, **kwargs):
            if (cfg.get("slow_from_epoch") is None or os.path.exists(cfg["out"] + ".slow")) and not (
                    cfg.get("slow_once") and os.path.exists(cfg["out"] + ".slowed")):
                open(cfg["out"] + ".slowed", "w").close()
                await asyncio.sleep(cfg["slow_replies"])
            return await original_reply(self, *args, **kwargs)

        AllOrNothingRunner._encoded_mean = _encoded_mean
    if cfg.get("die_in_allreduce"):
        from hivemind.averaging.partition import TensorPartContainer

        original_register = TensorPartContainer.register_processed_part
        arm = cfg["out"] + ".arm"

        @functools.wraps(original_register)
        def register_processed_part(self, *args, **kwargs):
            original_register(self, *args, **kwargs)
            if os.path.exists(arm):
                die()

        TensorPartContainer.register_processed_part = register_processed_part
    if cfg.get("die_in_allreduce") and cfg.get("hold_replies"):
        import asyncio

        from swarm_opt._hivemind.allreduce import AllOrNothingRunner

        original_mean = AllOrNothingRunner._encoded_mean
        held_when = cfg["out"] + ".arm"

        @functools.wraps(original_mean)
        async def _held_mean(self, *args, **kwargs):
            if os.path.exists(held_when):  # dies before these replies are due (see the docstring)
                await asyncio.sleep(60)
            return await original_mean(self, *args, **kwargs)

        AllOrNothingRunner._encoded_mean = _held_mean
    if cfg.get("die_in_lane"):
        from swarm_opt.gloo_lane import GlooLane

        original_reduce = GlooLane._reduce
        arm = cfg["out"] + ".arm"

        class DyingGroup:  # dies as the round's tensors go in, its weight already shared with the group
            def __init__(self, group):
                self.group = group

            def allreduce(self, *args):
                if os.path.exists(arm):
                    die()
                return self.group.allreduce(*args)

        @functools.wraps(original_reduce)
        def _reduce(self, group, *args):
            return original_reduce(self, DyingGroup(group), *args)

        GlooLane._reduce = _reduce
    if cfg.get("die_while_serving"):
        from swarm_opt._hivemind.engine import _Engine

        original_download = _Engine.rpc_download_state

        @functools.wraps(original_download)
        async def rpc_download_state(self, _request, _context):
            async for message in original_download(self, _request, _context):
                yield message
                if claim(cfg["die_while_serving"]):
                    die()

        _Engine.rpc_download_state = rpc_download_state


def configure_logging(out: str) -> None:
    """A test peer's logging, before swarm_opt is imported. SWARM_TEST_LOG_LEVEL=DEBUG shows hivemind's own messages
    too (swarm_opt re-emits them at DEBUG); SWARM_TEST_DEBUG_LOG=1 writes them to OUT.debug.log instead, the peer's
    log staying as a user sees it."""
    import logging

    fmt = "%(asctime)s %(levelname)s %(name)s: %(message)s"
    logging.basicConfig(level=os.environ.get("SWARM_TEST_LOG_LEVEL", "INFO"), format=fmt)
    if os.environ.get("SWARM_TEST_DEBUG_LOG"):
        root = logging.getLogger()
        for handler in root.handlers:
            handler.setLevel(root.level)
        debug = logging.FileHandler(out + ".debug.log")
        debug.setFormatter(logging.Formatter(fmt))
        root.addHandler(debug)
        root.setLevel(logging.DEBUG)


def main(config_path: str) -> None:
    import hivemind

    cfg = json.load(open(config_path))
    configure_logging(cfg["out"])

    import swarm_opt
    from swarm_opt import testing
    from swarm_opt.aggregation import parse_aggregation

    install_fault(cfg)
    local = join_local_ranks(cfg)  # a rank of a machine of several (config "local"): only its rank 0 joins the DHT
    private = {"authorizer": swarm_opt.PrivateRun(secret=cfg["secret"].encode()).authorizer()} \
        if cfg.get("secret") else {}
    dht = None
    if local is None or local["rank"] == 0:
        dht = hivemind.DHT(
            initial_peers=testing.initial_peers(cfg), host_maddrs=["/ip4/127.0.0.1/tcp/0"],
            client_mode=cfg.get("client_mode", False), start=True, **private,
        )
        testing.write_addresses(dht.get_visible_maddrs(), cfg["out"] + ".maddrs")
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[cfg.get("dtype", "float32")]
    task = cfg.get("task", "mlp")
    if task == "lsq":
        model = torch.nn.Linear(LSQ_DIM, cfg.get("lsq_outputs", 1), bias=False).to(torch.float64)
        torch.nn.init.zeros_(model.weight)
        if cfg.get("init_by_rank"):  # peers that start apart (a mixing test)
            torch.nn.init.constant_(model.weight, float(cfg["rank"]))
        inner = lambda p: torch.optim.SGD(p, lr=cfg.get("lsq_lr", 0.05))  # noqa: E731
    else:
        model = make_model(dtype, cfg.get("model_seed", 0), cfg.get("width", 32))  # width: a benchmark's model size
        inner = make_inner(cfg["inner"])
    if cfg.get("fsdp"):  # the machine's ranks shard the model (FSDP2 over the local group, one shard each)
        shard_model(model, local["size"])
    if cfg.get("auxiliary"):  # a helper: reduces parts of every round, trains nothing
        helper = swarm_opt.AuxiliaryPeer(dht=dht, run_id=cfg.get("run_id", "test_run"),
                                         params=make_model().parameters(),
                                         strategy=make_strategy(cfg.get("strategy", "grad")),
                                         matchmaking_time=cfg.get("matchmaking_time", 1.0),
                                         averaging_timeout=cfg.get("averaging_timeout", 15.0))
        helper.run(epochs=cfg["epochs"])
        save(cfg, dict(rank=cfg["rank"], rounds_helped=helper.rounds_helped, values_reduced=helper.values_reduced))
        helper.shutdown()
        dht.shutdown()
        return
    opt = swarm_opt.Optimizer(
        dht=dht, run_id=cfg.get("run_id", "test_run"), target_batch_size=cfg["target_batch_size"],
        batch_size_per_step=cfg["batch_size"], params=model.parameters(), optimizer=inner,
        strategy=make_strategy(cfg.get("strategy", "grad"), model),
        tracker=swarm_opt.TrackerConfig(max_extrapolation=cfg.get("max_extrapolation", 2.0),
                                        **cfg.get("tracker", {})),  # e.g. {"shard_size": 2, "exact_up_to": 2}: sharded
        scheduler=make_scheduler(cfg.get("scheduler"), cfg["epochs"]),  # True (StepLR) or "warmup_cosine"
        clip_grad_norm=cfg.get("clip_grad_norm"),
        timeouts=swarm_opt.Timeouts(matchmaking_time=cfg.get("matchmaking_time", 1.0),
                                    averaging_timeout=cfg.get("averaging_timeout", 15.0),
                                    adaptive=cfg.get("adaptive_deadlines", True)),
        compression=(getattr(swarm_opt, cfg["compression"])(**_codec_args(cfg.get("compression_args", {})))
                     if cfg.get("compression") else None),  # e.g. "Float16"
        aggregation=(parse_aggregation(cfg["aggregation"]) if ":" in cfg.get("aggregation", "")  # the CLI's form
                     else getattr(swarm_opt, cfg["aggregation"])(**_named_args(cfg.get("aggregation_args", {})))
                     if cfg.get("aggregation") else None),  # e.g. "CenteredClip"
        transport=swarm_opt.Gloo(host="127.0.0.1") if cfg.get("lane") else None,  # the gloo fast lane
        groups=swarm_opt.Groups(size=cfg["groups"]) if cfg.get("groups") else None,  # Moshpit group averaging
        local_group=swarm_opt.LocalGroup(timeout=cfg.get("local_timeout", 60.0)) if local else None,
    )
    for _ in range(cfg.get("downloads", 0)):  # a newcomer fetching the swarm's state (the donor-spreading test)
        opt.load_state_from_peers(timeout=30)
    wait_until = time.monotonic() + (30 if local is None or local["rank"] == 0 else 0)  # (a follower: its rank 0)
    while opt.progress.num_peers < cfg.get("expect_peers", 1) and time.monotonic() < wait_until:
        time.sleep(0.05)
    if task == "lsq":
        run_lsq(cfg, opt, model)
    else:
        run_mlp(cfg, opt, model, dtype)
    if cfg.get("forgets_shutdown"):  # a user's script that ends without opt.shutdown() (no ``with opt:``)
        return
    # stay a donor for a moment so that slower peers can still catch up from us
    linger_until = time.monotonic() + cfg.get("linger", 60.0)
    while time.monotonic() < linger_until and not os.path.exists(cfg["out"] + ".stop"):
        time.sleep(0.1)
    opt.shutdown()
    if dht is not None:
        dht.shutdown()


def join_local_ranks(cfg: dict):
    """Config ``"local": {"rank": r, "size": n, "port": p}``: this process is rank r of a machine of n ranks (one
    swarm peer), joined over gloo on loopback port p; returns that dict, or None for a peer of one process."""
    local = cfg.get("local")
    if not local:
        return None
    import datetime

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{local['port']}", rank=local["rank"],
                            world_size=local["size"], timeout=datetime.timedelta(seconds=60))
    return local


def shard_model(model: torch.nn.Module, ranks: int) -> None:
    """FSDP2 over the machine's ranks: each linear layer and the root sharded along its first dimension."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (ranks,))
    for layer in model.modules():
        if isinstance(layer, torch.nn.Linear) and layer is not model:
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def full(p: torch.Tensor) -> torch.Tensor:
    """A parameter's values, whole: a sharded one's gathered from every rank (collective: every rank calls it)."""
    return p.full_tensor().detach().clone() if hasattr(p, "full_tensor") else p.detach().clone()


def save(cfg: dict, result: dict) -> None:
    torch.save(result, cfg["out"] + ".tmp")
    os.replace(cfg["out"] + ".tmp", cfg["out"])


def run_lsq(cfg: dict, opt, model) -> None:
    """Full-gradient steps on this rank's least-squares problem; records the controls and weights of every round.

    With ``steps_per_round`` (one number, or one per rank) the peer runs in lockstep: after that many steps it only
    waits for the round, calling ``step()`` with non-finite gradients, which swarm_opt skips (no inner step, no
    samples), so that every peer completes exactly that many steps per round and the run is deterministic."""
    steps_per_round = cfg.get("steps_per_round", float("inf"))
    if isinstance(steps_per_round, list):
        steps_per_round = steps_per_round[cfg["rank"]]
    outputs = cfg.get("lsq_outputs", 1)
    a, b = lsq_problem(cfg.get("problem", cfg["rank"]), outputs)
    weights = (lambda: full(model.weight)[0]) if outputs == 1 else (lambda: full(model.weight))
    rounds, last, steps_in_round, losses = [], None, 0, []
    checkpointer, restored = None, None
    if cfg.get("checkpoint"):  # every process builds one; a machine's rank 0 writes, and every rank restores
        import swarm_opt

        checkpointer = swarm_opt.Checkpointer(cfg["checkpoint"], keep_last=10)
        if checkpointer.restore(opt, model) is not None:
            restored = dict(epoch=opt.local_epoch, w=weights())
    deadline = time.monotonic() + cfg.get("max_seconds", 120)
    while opt.local_epoch < cfg["epochs"] and time.monotonic() < deadline:
        opt.zero_grad()
        loss = 0.5 * (model(a) - b.reshape(len(b), -1)).pow(2).sum()
        loss.backward()
        if steps_in_round >= steps_per_round:
            model.weight.grad.fill_(float("nan"))
        else:
            steps_in_round += 1
            opt.report_loss(loss)
            losses.append(float(loss.detach()))
        opt.step()
        if checkpointer is not None:
            checkpointer.maybe_save(opt, model)
        if opt.last_round is not last:
            last = opt.last_round
            controls = getattr(opt.strategy, "controls", None)
            adaptive = getattr(opt.strategy, "adaptive", None)  # FedProx(adaptive=...): mu and the group's loss
            peer_dp = getattr(opt.strategy, "peer_dp", None)
            rounds.append(dict(last.__dict__, w=weights(), d=None if controls is None else controls[0].clone()[0],
                               clip=None if peer_dp is None else peer_dp.clip,
                               mu=getattr(opt.strategy, "mu", None), own_loss=sum(losses) / max(len(losses), 1),
                               schedule=None if adaptive is None else adaptive.state()))
            steps_in_round = 0
            if not last.caught_up:  # a peer that skipped epochs averages its steps (and losses) at its next round
                losses = []
        time.sleep(cfg.get("step_sleep", 0.01))
    save(cfg, dict(rank=cfg["rank"], epoch=opt.local_epoch, rounds=rounds, w=weights(),
                   lane_rounds=_lane_rounds(opt), restored=restored))


def run_mlp(cfg: dict, opt, model, dtype) -> None:
    x, y = make_data()
    rank, bs = cfg["rank"], cfg["batch_size"]
    g = torch.Generator().manual_seed(1000 + rank)
    # pending: the batches since the last committed round, each with the epoch of the parameters it was computed at
    committed, discarded, versions, discarded_versions, pending, reports, lrs = {}, {}, {}, {}, [], [], {}
    last_report, resources, after, first_step, computed = None, {}, {}, None, 0
    anchors, steps_in_flight = {}, 0  # the strategy's x after each committed round; steps while a round averaged
    published_ahead = 0  # steps after which this peer published more samples than its round in flight holds
    journal = open(cfg["out"] + ".journal", "a", buffering=1) if cfg.get("journal") else None  # what a killed peer did
    deadline = time.monotonic() + cfg.get("max_seconds", 120)
    if opt.last_round is not None:  # a newcomer that downloaded the swarm's state as it was built
        last_report = opt.last_round
        reports.append(dict(last_report.__dict__, time=time.time(), grad_norm=None, deadlines=opt.deadlines,
                            tracker_level=opt._tracker._records.sample.level))
        lrs[opt.local_epoch] = opt.param_groups[0]["lr"]
    while opt.local_epoch < cfg["epochs"] and time.monotonic() < deadline:
        while opt.local_epoch >= cfg.get("hold_at_epoch", float("inf")) and os.path.exists(cfg["out"] + ".hold"):
            time.sleep(0.05)  # the test holds the swarm at an epoch until it released this peer
        idx = torch.randint(0, len(x), (bs,), generator=g)
        if journal is not None:  # before the step: a peer killed inside it may have sent this batch's gradients
            journal.write(json.dumps({"batch": idx.tolist(), "version": opt.local_epoch}) + "\n")
        opt.zero_grad()
        version = opt.local_epoch
        loss = torch.nn.functional.cross_entropy(model(x[idx].to(dtype)).float(), y[idx])
        loss.backward()
        attack(cfg, model)
        first_step = time.time() if first_step is None else first_step
        steps_in_flight += bool(getattr(opt, "_rounds", None) and opt._rounds.in_flight)  # (before this step)
        opt.step()
        computed += bs
        if getattr(opt, "_rounds", None) and opt._rounds.in_flight:  # what its record says of the epoch in flight
            published_ahead += opt._tracker._samples > opt._rounds.samples_in_flight
        if opt.local_epoch == cfg.get("perturb_at_epoch") and not os.path.exists(cfg["out"] + ".perturbed"):
            with torch.no_grad():  # stands for a bit flip or a bug: this peer alone now holds other parameters
                for p in model.parameters():
                    p.add_(0.05 * torch.randn(p.shape, generator=g, dtype=p.dtype))
            with open(cfg["out"] + ".perturbed", "w") as f:
                f.write(str(opt.local_epoch))
        pending.append((idx.tolist(), version))
        if opt.last_round is not last_report:
            last_report = opt.last_round
            if opt.local_epoch >= cfg.get("slow_from_epoch", float("inf")):
                open(cfg["out"] + ".slow", "w").close()  # (install_fault: slow_replies)
            reports.append(dict(last_report.__dict__, time=time.time(), grad_norm=opt.grad_norm,  # before clipping
                                # the next round's (matchmaking_time, averaging_timeout): rank 0 holds the averager
                                deadlines=opt.deadlines if hasattr(opt, "_averager") else None,
                                tracker_level=_tracker_level(opt)))  # > 0: records sharded
            if not last_report.caught_up:
                # the round's batches come first: later ones were computed while it averaged in the background
                used = last_report.samples // cfg.get("machine_batch_size", bs)  # the machine's ranks' samples
                committed[last_report.epoch] = [b for b, _ in pending[:used]]
                versions[last_report.epoch] = [v for _, v in pending[:used]]
                pending = pending[used:]
            else:  # our round failed here, but our groupmates may have completed it with our gradients in it
                discarded[last_report.epoch] = [b for b, _ in pending]
                discarded_versions[last_report.epoch] = [v for _, v in pending]
                pending = []
            lrs[opt.local_epoch] = opt.param_groups[0]["lr"]
            if hasattr(opt.strategy, "anchor") and not last_report.caught_up:
                anchors[last_report.epoch] = opt.strategy.anchor.state()
            if cfg.get("record_sent"):
                after[last_report.epoch] = [p.detach().clone() for p in model.parameters()]
            if cfg.get("count_resources"):  # ours (the lane runs its rounds here) and the averager process's, per epoch
                resources[opt.local_epoch] = dict(averager=_resources(opt._averager._engine.pid),
                                                  host=_resources(os.getpid()))
            if journal is not None:
                journal.write(json.dumps({"epoch": last_report.epoch, "caught_up": last_report.caught_up}) + "\n")
            if opt.local_epoch >= cfg.get("arm_at_epoch", float("inf")):
                open(cfg["out"] + ".arm", "w").close()
        time.sleep(cfg.get("step_sleep", 0.01))
    served = None
    if cfg.get("record_sent"):  # what this peer would serve a peer downloading its state
        from swarm_opt.serialization import unflatten

        metadata, tensors = opt._shareable_state()
        state = unflatten(metadata["skeleton"], list(tensors))
        served = dict(params=state["params"], optimizer_keys=sorted(state["optimizer"]["state"]),
                      own_optimizer_keys=sorted(opt.state_dict()["state"]))
    save(cfg, dict(rank=rank, epoch=opt.local_epoch, committed=committed, sent=SENT, served=served, after=after,
                   discarded=discarded, versions=versions,
                   discarded_versions=discarded_versions, lane_rounds=_lane_rounds(opt), resources=resources,
                   reports=reports, lrs=lrs, params=[full(p) for p in model.parameters()],
                   first_step=first_step, samples_computed=computed, anchors=anchors,
                   steps_in_flight=steps_in_flight, published_ahead=published_ahead,
                   peer_id=str(opt._averager.peer_id) if hasattr(opt, "_averager") else None))


def _tracker_level(opt) -> int:
    return opt._tracker._records.sample.level if hasattr(opt, "_tracker") else 0  # (a follower rank has none)


def _lane_rounds(opt) -> int:
    return opt._averager.lane_rounds if hasattr(opt, "_averager") else 0


def attack(cfg: dict, model: torch.nn.Module) -> None:
    """A Byzantine peer: ``"attack": {"scale": -100}`` multiplies its gradients (a negative factor flips their sign),
    ``{"nan": true}`` makes them NaN (a broken peer: swarm_opt skips its steps), ``{"noise": 10}`` replaces them
    with Gaussian noise of that standard deviation. Before ``step()``: what the attacker sends is what it steps on."""
    spec = cfg.get("attack")
    if not spec:
        return
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is None:
                continue
            if spec.get("nan"):
                p.grad.fill_(float("nan"))
            elif "noise" in spec:
                p.grad.normal_(0.0, float(spec["noise"]))
            else:
                p.grad.mul_(float(spec["scale"]))


def _resources(pid: int) -> dict:
    """A process's open file descriptors (sockets included) and threads (Python's and native ones)."""
    return dict(fds=len(os.listdir(f"/proc/{pid}/fd")), threads=len(os.listdir(f"/proc/{pid}/task")))


def _codec_args(args: dict) -> dict:
    """A codec's arguments from JSON: a codec given by name (PowerSGD's ``factors="Float16"``) is built."""
    import swarm_opt

    return {k: getattr(swarm_opt, v)() if k == "factors" else v for k, v in args.items()}


def _named_args(args: dict) -> dict:
    """An aggregation's arguments from JSON: one given by name (``Audited``'s ``aggregation="CenteredClip"``) is
    built."""
    import swarm_opt

    return {k: getattr(swarm_opt, v)() if k == "aggregation" else v for k, v in args.items()}


if __name__ == "__main__":
    from swarm_opt.errors import ConfigError
    from swarm_opt.ranks import LocalGroupError

    try:
        main(sys.argv[1])
    except (LocalGroupError, ConfigError) as e:  # a rank of this peer's machine died or disagreed: one line, status 3
        if not json.load(open(sys.argv[1])).get("local"):
            raise
        print(f"{type(e).__name__}: {e}", flush=True)
        os._exit(3)  # at once: rank 0's DHT process would hold the exit (the test kills what is left)
    gc.freeze()  # skips the interpreter's final collection of torch's modules (~1 s at exit); nothing left needs it
