"""``swarm_opt.ranks`` in one process: what a local group accepts and the one-line errors it gives."""

from __future__ import annotations

import socket
import types

import pytest
import torch
import torch.distributed as dist

import swarm_opt
from swarm_opt.errors import ConfigError, ConfigTypeError
from swarm_opt.ranks import SOLO, LocalGroup, _short_reason, resolve


def _optimizer(**kwargs):
    model = torch.nn.Linear(3, 2)
    return swarm_opt.Optimizer(dht=None, run_id="r", target_batch_size=8, params=model.parameters(),
                               optimizer=lambda p: torch.optim.SGD(p, lr=0.1), **kwargs)


@pytest.fixture
def world_of_one():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_local_group_options_are_checked():
    with pytest.raises(ConfigError, match="timeout"):
        LocalGroup(timeout=0)
    with pytest.raises(ConfigTypeError, match="gradients_reduced"):
        LocalGroup(gradients_reduced=1)
    with pytest.raises(ConfigTypeError, match="local_group must be"):
        resolve("world")


def test_without_torch_distributed_a_process_is_a_peer_of_its_own():
    assert resolve(None) is None and resolve(False) is None
    assert isinstance(resolve(LocalGroup()), LocalGroup)


def test_a_local_group_without_torch_distributed_is_named_in_the_error():
    with pytest.raises(ConfigError, match=r"needs torch.distributed initialised .*init_process_group\('gloo'\)"):
        _optimizer(local_group=LocalGroup())


def test_a_group_of_another_backend_is_named_in_the_error(world_of_one, monkeypatch):
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    with pytest.raises(ConfigError, match=r"torch.distributed's 'nccl' backend; .* supports gloo: .*new_group"):
        _optimizer(local_group=LocalGroup())


def test_a_group_of_one_rank_is_a_plain_peer(world_of_one):
    assert resolve(None) is None  # a world of one is not several ranks
    from swarm_opt.ranks import join_local_group

    bound = types.SimpleNamespace(_params=[torch.zeros(2)])  # what joining reads of a bound optimizer
    assert join_local_group(LocalGroup(), bound, dht=None, offloaded=False, report_type=None) is SOLO


def test_gloo_errors_are_cut_to_their_gist():
    gloo = RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:1: "
                        "Connection reset by peer. This is typically caused by a remote worker hanging")
    assert _short_reason(gloo) == "Connection reset by peer"


def _sharded_model():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = torch.nn.Linear(4, 2)
    fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
    return model


def test_a_sharded_model_needs_a_local_group_of_several_ranks(world_of_one):
    """FSDP2 over one process: nothing to gather from, and no machine to speak for; the error names the set-up."""
    model = _sharded_model()
    for local_group in (LocalGroup(), False):
        with pytest.raises(ConfigError, match=r"sharded \(FSDP2 .*no rank of a local group of several"):
            swarm_opt.Optimizer(dht=None, run_id="r", target_batch_size=8, params=model.parameters(),
                                optimizer=lambda p: torch.optim.SGD(p, lr=0.1), local_group=local_group)


def test_a_ready_optimizer_of_a_sharded_model_is_refused_naming_the_factory(world_of_one):
    model = _sharded_model()
    with pytest.raises(ConfigError, match=r"sharded .*pass an optimizer factory and the model's parameters"):
        swarm_opt.Optimizer(dht=None, run_id="r", target_batch_size=8,
                            optimizer=torch.optim.SGD(model.parameters(), lr=0.1), local_group=LocalGroup())


class _ScriptedLink:
    """A stand-in for the local group's link: records each broadcast's timeout, and fills the tensors a follower
    receives from ``script`` (the voice's headers, in order)."""

    def __init__(self, script=()):
        self.script, self.waits, self.sent = list(script), [], []

    def broadcast(self, tensor, what, timeout=None):
        self.waits.append(timeout)
        if self.script:
            tensor.copy_(torch.tensor(self.script.pop(0), dtype=tensor.dtype))
        else:
            self.sent.append(tensor.tolist())


def _ranks(role, link):
    from swarm_opt import ranks

    opt = types.SimpleNamespace(timeouts=swarm_opt.Timeouts(matchmaking_time=2.0, averaging_timeout=60.0),
                                local_epoch=7, config=types.SimpleNamespace(target_batch_size=8),
                                inner=torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1))
    return getattr(ranks, role)(link, LocalGroup(timeout=5.0), opt), opt


def test_a_follower_waits_as_long_as_each_wait_rank_0_announces_and_no_longer():
    """Rank 0 announces a round of 21 s, then a download of 130 s: the follower waits its step's bound, then that
    plus each announced deadline, then takes the step's end; the static bound of the user's timeouts is not used."""
    from swarm_opt.ranks import _LOCAL, _WAIT

    link = _ScriptedLink([[_WAIT, 7, 0, 21.0], [_WAIT, 7, 0, 130.0], [_LOCAL, 7, 0, 0]])
    follower, opt = _ranks("_Follower", link)
    assert follower._receive(opt, follower.step_bound)[0] == _LOCAL
    step = follower.step_bound
    assert step == 5.0 + 15.0 and step < follower.swarm_bound
    assert link.waits == [step, step + 21.0, step + 130.0]


def test_rank_0_announces_its_waits_only_while_the_followers_listen_and_from_the_loops_thread():
    import threading

    from swarm_opt.ranks import _WAIT

    link = _ScriptedLink()
    voice, opt = _ranks("_Voice", link)
    voice.expect(opt, 21.0, "a round")  # during construction: the followers wait in joined()
    voice._listening = False  # between steps (after publish): nobody listens
    voice.expect(opt, 30.0, "a round")
    voice._listening = True
    worker = threading.Thread(target=voice.expect, args=(opt, 40.0, "a round in the background"))
    worker.start()
    worker.join()
    assert link.sent == [[_WAIT, 7.0, 0.0, 21.0]]
