"""Host master copies built from every form of ``params`` torch accepts."""

from __future__ import annotations

import torch

from swarm_opt.offload import Offload, OffloadedParameters


def test_param_groups_given_as_generators_keep_their_parameters():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    groups = [{"params": model[0].parameters(), "lr": 0.5}, {"params": model[1].parameters()}]  # the common idiom
    offloaded = OffloadedParameters(groups, Offload(pin_memory=False))
    assert [len(g["params"]) for g in offloaded.groups] == [2, 2]
    assert offloaded.groups[0]["lr"] == 0.5 and "lr" not in offloaded.groups[1]
    for group, module in zip(offloaded.groups, model):
        for master, p in zip(group["params"], module.parameters()):
            assert master.device.type == "cpu" and master is not p and torch.equal(master, p.detach())
    inner = torch.optim.SGD(offloaded.groups, lr=0.1)  # builds: no group is empty
    assert sum(len(g["params"]) for g in inner.param_groups) == 4


def test_a_generator_of_parameters_and_a_single_tensor_group():
    model = torch.nn.Linear(3, 2)
    assert len(OffloadedParameters(list(model.parameters()), Offload(pin_memory=False)).groups) == 2
    single = OffloadedParameters([{"params": model.weight}], Offload(pin_memory=False))
    assert len(single.groups[0]["params"]) == 1 and single.groups[0]["params"][0].shape == model.weight.shape
