"""One machine, one peer: the data-parallel ranks of a machine (``torchrun``, DDP, Lightning's ``ddp``) train as a
single voice in the swarm.

Every rank builds the same ``swarm_opt.Optimizer`` and calls ``step()`` as in a single-process loop. Inside a step the
ranks combine their gradients over the machine's process group (the sample-weighted mean, and the sum of their
samples; nothing to do when DDP's backward already averaged them); rank 0 of the group, the *voice*, alone holds the
DHT, publishes the machine's progress, matchmakes and averages with the swarm; the others, *followers*, wait for it.
At the end of each step the voice tells the followers what happened in one small message: either nothing beyond the
local step (they repeat the strategy's local step on the same gradients and stay identical, e.g. ``LocalUpdates``'s
inner step, or nothing at all for ``GradientAveraging``, whose accumulated gradients only the voice needs), or a new
state (a committed round, a catch-up, a downloaded state): then the voice broadcasts its parameters and its full
optimizer state (inner optimizer, scheduler, epoch, strategy state), which the followers load. So every strategy
works unchanged and the ranks leave every step identical.

Every wait on the group is bounded (``LocalGroup.timeout``, plus what the voice's swarm work may take while the
followers wait for it: the voice announces each of its waits on the swarm with the deadline it sets itself, the
adaptive ones included, and the followers wait that long): a rank that dies or hangs takes the machine out of the
swarm (the voice withdraws its record) with ``LocalGroupError`` on every rank, instead of leaving the others waiting.

``Optimizer`` uses one object from here, of the same interface for a single process (``SOLO``: nothing to do), the
voice and a follower: ``combine`` before the local step, ``expect`` before each wait on the swarm inside a step,
``publish`` at the end of ``step()`` and ``around_download`` for a state download the caller asked for. See
``docs/ranks.md``.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import math
import re
import threading
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from swarm_opt.errors import ConfigError, ConfigTypeError, StateDownloadError, SwarmOptError
from swarm_opt.progress import SwarmProgress
from swarm_opt.serialization import flatten, unflatten
from swarm_opt.shards import Shards, unshard

logger = logging.getLogger(__name__)

__all__ = ["LocalGroup", "LocalGroupError", "join_local_group", "unshard_params", "SOLO"]

_SUPPORTED_BACKENDS = ("gloo",)
_AGREEMENT_BYTES = 1024  # what each rank tells the others at start-up (run id, model, recipe), JSON, padded
# what a step's message from the voice says (its first number)
_LOCAL, _STATE, _FAILED, _WAIT, _PARAMS = 0.0, 1.0, 2.0, 3.0, 4.0
#: seconds of the voice's own work in a step outside the waits it announces (``_Voice.expect``): its bookkeeping,
#: record reads of at most ``state_sync.RECORDS_READ_TIMEOUT`` each; the followers allow it beyond
#: ``LocalGroup.timeout``
_BOOKKEEPING = 15.0


class LocalGroupError(SwarmOptError, RuntimeError):
    """A rank of this machine died, hung or disagreed: the machine left the swarm (every rank raises it)."""


@dataclass(frozen=True)
class LocalGroup:
    """The process group of one machine's data-parallel ranks: ``Optimizer(..., local_group=LocalGroup())``.

    :param group: a ``torch.distributed`` process group of the gloo backend (default: the default group, every rank
        of ``torchrun``'s world); its rank 0 speaks for the machine in the swarm.
    :param timeout: seconds a rank waits for the others at a step (their compute time may differ by at most this),
        on top of the swarm's own timeouts while the followers wait for the voice's round or download.
    :param gradients_reduced: True when the model is wrapped in ``DistributedDataParallel`` over this group: its
        backward already averaged the gradients (each rank's equally), so they are not combined again; only the
        samples are summed. Default False: swarm_opt combines them, weighted by each rank's samples.
    """

    group: Any = None
    timeout: float = 60.0
    gradients_reduced: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.timeout, bool) or not isinstance(self.timeout, (int, float)) or \
                not 0 < self.timeout < math.inf:
            raise ConfigError(f"LocalGroup(timeout=...) must be a positive number of seconds, got {self.timeout!r}")
        if not isinstance(self.gradients_reduced, bool):
            raise ConfigTypeError(f"LocalGroup(gradients_reduced=...) must be True or False, got "
                                  f"{self.gradients_reduced!r}")


def _distributed() -> Any:
    import torch.distributed as dist

    return dist


def resolve(local_group: Any) -> Optional[LocalGroup]:
    """``Optimizer(local_group=...)``: a ``LocalGroup``, a process group, ``False`` (this process is a peer of its own
    even under ``torch.distributed``), or None: the default group when ``torch.distributed`` is initialised with more
    than one rank, else none."""
    if local_group is False:
        return None
    if isinstance(local_group, LocalGroup):
        return local_group
    dist = _distributed()
    if local_group is None:
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            return LocalGroup()
        return None
    if dist.is_available() and isinstance(local_group, dist.ProcessGroup):
        return LocalGroup(group=local_group)
    raise ConfigTypeError(f"local_group must be swarm_opt.LocalGroup(...), a torch.distributed process group, False "
                          f"or None, got {local_group!r}")


class Solo:
    """A peer of one process: nothing to combine, nobody to tell."""

    follows = False
    writes_checkpoints = True

    def combine(self, opt: Any, batch_size: int) -> int:
        return batch_size

    def publish(self, opt: Any) -> None:
        return None

    def around_download(self, opt: Any, download: Callable[[], None]) -> None:
        download()

    def joined(self, opt: Any) -> None:
        return None

    def expect(self, opt: Any, seconds: float, what: str) -> None:
        return None

    def model_state(self, model: torch.nn.Module) -> Dict[str, Any]:
        return model.state_dict()

    def load_model_state(self, model: torch.nn.Module, state: Dict[str, Any]) -> None:
        model.load_state_dict(state)


SOLO = Solo()


def unshard_params(local_group: Any, optimizer: Any, params: Any) -> Any:
    """``(params, shards)``: for a model sharded over the local group's ranks (FSDP2, DTensor parameters), the
    stand-ins the swarm optimizer trains instead and their ``swarm_opt.shards.Shards`` (collective: every rank);
    otherwise ``(params, None)``. Called before the optimizer builds its inner optimizer."""
    config = resolve(local_group)
    dist = _distributed()
    rank, size = 0, 1
    if config is not None and dist.is_available() and dist.is_initialized():
        group = config.group if config.group is not None else dist.group.WORLD
        rank, size = dist.get_rank(group), dist.get_world_size(group)
    return unshard(optimizer, params, rank=rank, world_size=size)


def join_local_group(local_group: Any, opt: Any, *, dht: Any, offloaded: bool, report_type: Any,
                     shards: Optional[Shards] = None) -> Any:
    """The ``SOLO``, voice or follower object of ``opt``, a bound ``Optimizer`` that has not joined the swarm yet.
    Collective: every rank of the group calls it, checks that they agree (run, model, recipe) and the followers take
    the voice's initial state. ``report_type``: the class of ``opt.last_round`` (``RoundReport``), which the followers
    mirror. ``shards``: the model's shards (``unshard_params``), when it is sharded over the ranks."""
    config = resolve(local_group)
    if config is None:
        return SOLO
    dist = _distributed()
    if not dist.is_available() or not dist.is_initialized():
        raise ConfigError("local_group=... needs torch.distributed initialised on every rank: call "
                          "torch.distributed.init_process_group('gloo') first (torchrun sets the environment), or "
                          "drop local_group for a single-process peer")
    group = config.group if config.group is not None else dist.group.WORLD
    backend = str(dist.get_backend(group))
    if backend not in _SUPPORTED_BACKENDS:
        raise ConfigError(f"local_group uses torch.distributed's {backend!r} backend; swarm_opt's local group "
                          f"supports {', '.join(_SUPPORTED_BACKENDS)}: pass "
                          f"LocalGroup(torch.distributed.new_group(backend='gloo')) (a gloo group beside your NCCL "
                          f"one)")
    link = _Link(dist, group, config.timeout)
    if link.size == 1:
        return SOLO
    if offloaded:
        raise ConfigError("offload=Offload() is not supported with a local group of several ranks yet: drop "
                          "offload, or run one peer per process with local_group=False")
    ranks = (_Voice if link.rank == 0 else _Follower)(link, config, opt)
    ranks.report_type, ranks.shards = report_type, shards
    ranks.agree(opt, has_dht=dht is not None)
    return ranks


class _Link:
    """Collectives over the machine's group, each wait bounded; a failure becomes ``LocalGroupError``."""

    def __init__(self, dist: Any, group: Any, timeout: float) -> None:
        self.dist, self.group, self.timeout = dist, group, float(timeout)
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self.voice = dist.get_global_rank(group, 0) if group is not dist.group.WORLD else 0

    def _wait(self, work: Any, timeout: float, what: str) -> None:
        try:
            work.wait(timeout=datetime.timedelta(seconds=timeout))
        except RuntimeError as e:
            raise self.failure(e, what, timeout) from None

    def failure(self, error: Exception, what: str, timeout: Optional[float] = None) -> LocalGroupError:
        """The one-line error of a collective (``what``) that failed with ``error``."""
        reason = _short_reason(error)
        if "timed out" in reason.lower() and timeout is not None:
            reason = f"no answer within {timeout:.0f} s"
        return LocalGroupError(f"local rank {self.rank}: {what} failed ({reason[:120]}): a rank of this machine died "
                               f"or hangs, so the machine left the swarm; restart all its ranks together")

    def all_reduce(self, tensor: torch.Tensor, what: str, timeout: Optional[float] = None) -> None:
        work = self.dist.all_reduce(tensor, group=self.group, async_op=True)
        self._wait(work, self.timeout if timeout is None else timeout, what)

    def broadcast(self, tensor: torch.Tensor, what: str, timeout: Optional[float] = None) -> None:
        work = self.dist.broadcast(tensor, src=self.voice, group=self.group, async_op=True)
        self._wait(work, self.timeout if timeout is None else timeout, what)

    def all_gather(self, tensor: torch.Tensor, what: str) -> List[torch.Tensor]:
        out = [torch.empty_like(tensor) for _ in range(self.size)]
        work = self.dist.all_gather(out, tensor, group=self.group, async_op=True)
        self._wait(work, self.timeout, what)
        return out

    # a state: its skeleton (JSON), then one flat buffer per dtype
    def send_state(self, kind: float, state: Any, epoch: int, what: str) -> None:
        skeleton, tensors = flatten(state)
        manifest = json.dumps({"skeleton": skeleton, "tensors": [[str(t.dtype)[6:], list(t.shape)] for t in tensors]})
        encoded = torch.frombuffer(bytearray(manifest.encode()), dtype=torch.uint8)
        self.broadcast(_header(kind, epoch, 0, len(encoded)), what)
        self.broadcast(encoded, what)
        for members in _by_dtype(tensors).values():
            self.broadcast(torch.cat([tensors[i].detach().reshape(-1).to("cpu") for i in members]), what)

    def receive_state(self, length: int, what: str, timeout: Optional[float] = None) -> Any:
        encoded = torch.empty(int(length), dtype=torch.uint8)
        self.broadcast(encoded, what, timeout)
        manifest = json.loads(bytes(encoded.numpy()).decode())
        specs = [(getattr(torch, dtype), shape) for dtype, shape in manifest["tensors"]]
        tensors: List[Optional[torch.Tensor]] = [None] * len(specs)
        for dtype, members in _by_dtype([torch.empty(0, dtype=d) for d, _ in specs]).items():
            sizes = [math.prod(specs[i][1]) for i in members]
            flat = torch.empty(sum(sizes), dtype=dtype)
            self.broadcast(flat, what, timeout)
            for i, part in zip(members, flat.split(sizes)):
                tensors[i] = part.reshape(specs[i][1])
        return unflatten(manifest["skeleton"], tensors)


def _short_reason(error: Exception) -> str:
    """The gist of a gloo error (``[.../pair.cc:537] Read error [127.0.0.1]:123: Connection reset by peer. This is
    typically caused by...`` becomes ``Connection reset by peer``)."""
    text = (str(error).splitlines() or [type(error).__name__])[0]
    text = re.sub(r"^\[[^\]]*\]\s*", "", text)  # gloo's source location
    text = text.split(". ")[0]
    return text.rsplit(": ", 1)[-1] if text.startswith(("Read error", "Write error")) else text


def _header(kind: float, epoch: int, local_steps: int, length: int = 0) -> torch.Tensor:
    return torch.tensor([kind, float(epoch), float(local_steps), float(length)], dtype=torch.float64)


def _by_dtype(tensors: Sequence[torch.Tensor]) -> Dict[torch.dtype, List[int]]:
    groups: Dict[torch.dtype, List[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault(t.dtype, []).append(i)
    return groups


class _Ranks:
    """What the voice and the followers share: the agreement at start-up and the combined gradients."""

    follows = False
    writes_checkpoints = True
    shards: Optional[Shards] = None  # the model's shards, when it is sharded over the ranks (swarm_opt.shards)

    def __init__(self, link: _Link, config: LocalGroup, opt: Any) -> None:
        self.link, self.config = link, config
        self.timeouts = opt.timeouts
        self._buffer: Optional[torch.Tensor] = None

    def model_state(self, model: torch.nn.Module) -> Dict[str, Any]:
        """What a checkpoint holds of ``model``: its state, with full tensors where it is sharded."""
        return model.state_dict() if self.shards is None else self.shards.model_state(model)

    def load_model_state(self, model: torch.nn.Module, state: Dict[str, Any]) -> None:
        """Every rank: ``model_state``'s output into ``model`` (into each rank's shards where it is sharded)."""
        if self.shards is None:
            model.load_state_dict(state)
        else:
            self.shards.load_model_state(model, state)

    @property
    def swarm_bound(self) -> float:
        """The longest the voice's construction may take before it announces a wait (its averager and tracker
        start, a first read; a round, a catch-up, a download at most), from the user's bounds: how long the
        followers wait for it to join the swarm, plus ``LocalGroup.timeout``."""
        t = self.timeouts
        return self.config.timeout + t.matchmaking_time + 4 * t.averaging_timeout + t.state_download_timeout

    @property
    def step_bound(self) -> float:
        """How long a follower waits for the voice's next word in a step once the ranks combined their gradients:
        the voice's local step and bookkeeping; each longer wait of the voice (a round, a download) it announces
        with its own deadline (``_Voice.expect``), which the follower then allows on top."""
        return self.config.timeout + _BOOKKEEPING

    def expect(self, opt: Any, seconds: float, what: str) -> None:
        return None

    def agree(self, opt: Any, *, has_dht: bool) -> None:
        """Every rank checks that all ranks build the same peer (run, global batch, model and strategy, recipe)
        and that rank 0 holds a DHT; a disagreement raises one line naming the ranks and what differs, on every
        rank."""
        mine = {"run_id": opt.config.run_id[:200], "target_batch_size": opt.config.target_batch_size,
                "model": opt.model_schema, "gradients_reduced": self.config.gradients_reduced, "dht": has_dht}
        encoded = json.dumps(mine).encode()[:_AGREEMENT_BYTES]
        padded = torch.zeros(_AGREEMENT_BYTES, dtype=torch.uint8)
        padded[:len(encoded)] = torch.frombuffer(bytearray(encoded), dtype=torch.uint8)
        gathered = self.link.all_gather(padded, "agreeing on the run at start-up")
        views = [json.loads(bytes(t.numpy()).rstrip(b"\0").decode()) for t in gathered]
        if not views[0]["dht"]:
            raise ConfigError("rank 0 of the local group speaks for the machine in the swarm and needs a started "
                              "hivemind.DHT: pass dht=... on rank 0 (the other ranks may pass dht=None)")
        for key, what in (("run_id", "run_id"), ("target_batch_size", "target_batch_size"),
                          ("model", "model, strategy or recipe (model_schema)"),
                          ("gradients_reduced", "LocalGroup(gradients_reduced=...)")):
            differ = [r for r, view in enumerate(views) if view.get(key) != views[0].get(key)]
            if differ:
                shown = f" ({views[0][key]!r} on rank 0, {views[differ[0]][key]!r} on rank {differ[0]})" \
                    if key != "model" else ""
                raise ConfigError(f"the ranks of this machine's local group disagree on the {what}{shown}: local "
                                  f"rank(s) {differ} differ from rank 0; every rank must build the same "
                                  f"swarm_opt.Optimizer")

    def combine(self, opt: Any, batch_size: int) -> int:
        """Every rank: the gradients of ``opt``'s parameters become the machine's sample-weighted mean (unless DDP
        already averaged them); returns the machine's samples of this step."""
        if self.shards is not None:  # FSDP2 averaged them into the shards: rank 0 takes them whole
            try:  # (DTensor's collectives, over the model's mesh)
                self.shards.gather_gradients()
            except RuntimeError as e:
                raise self.link.failure(e, "gathering the step's gradients") from None
        if self.config.gradients_reduced or self.shards is not None:
            total = torch.tensor([float(batch_size)], dtype=torch.float64)
            self.link.all_reduce(total, "summing the step's samples")
            return int(total.item())
        params = opt._params
        dtype = torch.float64 if any(p.dtype == torch.float64 for p in params) else torch.float32
        numel = sum(p.numel() for p in params)
        if self._buffer is None or self._buffer.dtype != dtype:
            self._buffer = torch.empty(numel + len(params) + 1, dtype=dtype)
        buffer, offset = self._buffer, 0
        flags = buffer[numel:numel + len(params)]
        for i, p in enumerate(params):
            part = buffer[offset:offset + p.numel()]
            if p.grad is None:
                part.zero_()
                flags[i] = 0
            else:
                part.copy_(p.grad.detach().reshape(-1)).mul_(batch_size)
                flags[i] = 1
            offset += p.numel()
        buffer[-1] = batch_size
        self.link.all_reduce(buffer, "combining the step's gradients")
        total, offset = buffer[-1].item(), 0
        for i, p in enumerate(params):
            if flags[i] > 0 and total > 0:
                mean = buffer[offset:offset + p.numel()].view(p.shape).div_(total)
                if p.grad is None:
                    p.grad = mean.to(p.dtype).clone()
                else:
                    p.grad.copy_(mean)
            offset += p.numel()
        return int(round(total))

    def _state(self, opt: Any) -> Dict[str, Any]:
        """What a follower loads: the parameters, the optimizer's full state, and the voice's progress and last
        round, which the follower shows as its own."""
        progress = dataclasses.asdict(opt.progress)
        last = None if opt.last_round is None else dataclasses.asdict(opt.last_round)
        if self.shards is not None:  # the other ranks hold no optimizer state: only the parameters, epoch and lrs
            return {"params": list(opt._params), "epoch": opt.local_epoch, "progress": progress, "last_round": last,
                    "lrs": [group["lr"] for group in opt.param_groups]}
        return {"params": list(opt._params), "optimizer": opt.state_dict(), "progress": progress, "last_round": last}


class _Voice(_Ranks):
    """Rank 0: the machine's peer in the swarm. Tells the followers after each step what happened."""

    def __init__(self, link: _Link, config: LocalGroup, opt: Any) -> None:
        super().__init__(link, config, opt)
        self._local_steps = 0  # inner-optimizer steps since the last message
        self._published: Any = None  # the last_round the followers hold
        self._in_step = True  # until ``joined``: what the construction does (a newcomer's download) goes with it
        self._listening = True  # whether the followers wait for this rank's next word (``expect``)
        self._thread = threading.current_thread()  # the training loop's, which alone speaks to the followers
        opt.inner.register_step_post_hook(self._count_step)

    def _count_step(self, *_: Any) -> None:
        self._local_steps += 1

    def joined(self, opt: Any) -> None:
        """The end of the voice's construction (in the swarm, a newcomer's state downloaded): the followers take
        its state, as DDP broadcasts the module at construction."""
        self._in_step = False
        self._share(opt)
        self._listening = False

    def combine(self, opt: Any, batch_size: int) -> int:
        self._in_step, self._local_steps = True, 0
        self._thread = threading.current_thread()
        samples = self._guarded(opt, lambda: super(_Voice, self).combine(opt, batch_size))
        self._listening = True
        return samples

    def expect(self, opt: Any, seconds: float, what: str) -> None:
        """Before a wait on the swarm inside a step (``what``: a round, a download), tell the followers its deadline
        (``seconds``, from the deadlines this rank sets itself: adaptive ones included), so that they wait as long
        as this rank may, and no longer. Only from the training loop's thread while the followers listen (a round in
        the background, or a download outside a step they do not share, says nothing)."""
        if not self._listening or threading.current_thread() is not self._thread:
            return
        self._guarded(opt, lambda: self.link.broadcast(_header(_WAIT, opt.local_epoch, 0, float(seconds)),
                                                       f"telling the other ranks about {what}"))

    def publish(self, opt: Any) -> None:
        """End of a step: the followers repeat the local step, or load the new state."""
        self._in_step = self._listening = False
        if opt.last_round is not self._published:
            self._share(opt)
        elif self.shards is not None and self._local_steps > 0:  # the full copy stepped: every rank takes its slice
            self._guarded(opt, lambda: self.link.send_state(_PARAMS, list(opt._params), opt.local_epoch,
                                                            "sending the new parameters to the other ranks"))
            self.shards.scatter(opt._params, opt._params)
        else:
            self._guarded(opt, lambda: self.link.broadcast(_header(_LOCAL, opt.local_epoch, self._local_steps),
                                                           "telling the other ranks about the step"))

    def _share(self, opt: Any) -> None:
        self._guarded(opt, lambda: self.link.send_state(_STATE, self._state(opt), opt.local_epoch,
                                                        "sending the new state to the other ranks"))
        self._published = opt.last_round
        if self.shards is not None:
            self.shards.scatter(opt._params, opt._params)

    def around_download(self, opt: Any, download: Callable[[], None]) -> None:
        """A download inside ``step()`` reaches the followers with the step; one the caller asked for (every rank
        calls ``load_state_from_peers`` or ``load_state_dict``) reaches them at once, or its error does; one inside
        such a call (a checkpoint's catch-up) goes with it."""
        if self._in_step or self._listening:
            download()
            return
        self._listening = True
        try:
            download()
        except Exception as e:
            self._listening = False
            message = f"{type(e).__name__}: {e}"
            encoded = torch.frombuffer(bytearray(message.encode()[:4000]), dtype=torch.uint8)
            self._guarded(opt, lambda: self.link.broadcast(_header(_FAILED, opt.local_epoch, 0, len(encoded)),
                                                           "telling the other ranks about the download"))
            self._guarded(opt, lambda: self.link.broadcast(encoded, "telling the other ranks about the download"))
            raise
        self._share(opt)
        self._listening = False

    @staticmethod
    def _guarded(opt: Any, collective: Callable[[], Any]) -> Any:
        """A collective that failed leaves the machine out of the swarm (the record withdrawn) before raising."""
        try:
            return collective()
        except LocalGroupError as e:
            logger.error(f"{e}")
            opt.shutdown()
            raise


class _Follower(_Ranks):
    """Ranks 1..n-1: step with the voice, hold no DHT, publish nothing, load what the voice sends."""

    follows = True
    writes_checkpoints = False

    def __init__(self, link: _Link, config: LocalGroup, opt: Any) -> None:
        super().__init__(link, config, opt)
        self.progress = SwarmProgress(epoch=0, samples_accumulated=0, target_batch_size=opt.config.target_batch_size,
                                      num_peers=0, num_clients=0, samples_per_second=0.0, eta=math.inf, time=0.0)

    def joined(self, opt: Any) -> None:
        """Wait for the voice to join the swarm (it may download a running swarm's state) and take its state."""
        self._receive(opt, self.swarm_bound)

    def follow(self, opt: Any, closure: Optional[Callable[[], Any]], batch_size: Optional[int]) -> Any:
        """A follower's ``step()``: compute, combine, then do what the voice says."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        batch_size = self.combine(opt, opt._resolve_batch_size(batch_size))
        header = self._receive(opt, self.step_bound)
        if header[0] == _LOCAL and header[2] > 0 and self.shards is None:
            with torch.no_grad():
                opt.strategy.local_step(batch_size)
        return loss

    def around_download(self, opt: Any, download: Callable[[], None]) -> None:
        """The voice downloads; this rank takes the state it got, or raises its error."""
        self._receive(opt, self.step_bound)

    def _receive(self, opt: Any, timeout: float) -> List[float]:
        """The voice's next word, waited for at most ``timeout`` seconds, and then as long as each wait it announces
        (``_Voice.expect``) allows; loads a state it sends, raises the error of a download it failed."""
        header = torch.zeros(4, dtype=torch.float64)
        self.link.broadcast(header, "waiting for rank 0's step", timeout)
        kind, epoch, steps, length = header.tolist()
        while kind == _WAIT:  # rank 0 now waits on the swarm, at most ``length`` seconds
            self.link.broadcast(header, f"waiting for rank 0's step (its deadline {length:.0f} s)",
                                self.step_bound + length)
            kind, epoch, steps, length = header.tolist()
        if kind == _FAILED:
            encoded = torch.empty(int(length), dtype=torch.uint8)
            self.link.broadcast(encoded, "waiting for rank 0's download")
            raise StateDownloadError(f"rank 0 could not download the swarm's state: "
                                     f"{bytes(encoded.numpy()).decode(errors='replace')}")
        if kind == _STATE:
            self._load(opt, self.link.receive_state(length, "receiving rank 0's state"))
        if kind == _PARAMS and self.shards is not None:
            self.shards.scatter(opt._params, self.link.receive_state(length, "receiving rank 0's parameters"))
        return [kind, epoch, steps, length]

    def _load(self, opt: Any, state: Dict[str, Any]) -> None:
        if self.shards is not None:
            self.shards.scatter(opt._params, state["params"])
            opt._epoch = int(state["epoch"])
            for group, lr in zip(opt.param_groups, state["lrs"]):
                group["lr"] = lr
        else:
            with torch.no_grad():
                for p, new in zip(opt._params, state["params"]):
                    p.copy_(new)
                opt._load_state_locally(state["optimizer"])
        if state["progress"] is not None:
            self.progress = SwarmProgress(**state["progress"])
        if state["last_round"] is not None:
            opt.last_round = self.report_type(**state["last_round"])
