"""Property-based fuzzing of everything a peer reads from the network: progress records, state downloads, gather
metadata. Whatever arrives, a peer rejects it with a clear error or ignores it, and its own state is untouched."""

from __future__ import annotations

import math

import hivemind
import pytest
import torch
from hivemind.utils import MSGPackSerializer, ValueWithExpiration
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import swarm_opt
from swarm_opt._hivemind.gather import member_info as _member_info
from swarm_opt.errors import IncompatibleStateError
from swarm_opt.progress import ProgressRecord, aggregate_progress, parse_records
from swarm_opt.serialization import flatten, unflatten
from swarm_opt.trust import ClaimChecker

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(300)]

FIELDS = ("peer_id", "instance", "epoch", "samples", "samples_per_second", "time", "client_mode", "model_schema",
          "target_batch_size", "params_digest")
scalars = st.one_of(st.none(), st.booleans(), st.integers(min_value=-2**70, max_value=2**70),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=40), st.binary(max_size=40))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8),
                                                                                          inner, max_size=3),
                      max_leaves=8)
plausible = {
    "peer_id": st.binary(min_size=1, max_size=40), "instance": st.text(max_size=40),
    "epoch": st.integers(min_value=-5, max_value=2**63), "samples": st.integers(min_value=-5, max_value=2**63),
    "samples_per_second": st.floats(allow_nan=True, allow_infinity=True), "time": st.floats(allow_nan=True),
    "client_mode": st.booleans(), "model_schema": st.just("s") | st.text(max_size=70),
    "target_batch_size": st.integers(min_value=-5, max_value=2**40), "params_digest":
    st.lists(st.floats(allow_nan=True), max_size=9) | st.none(),
}
packable = st.recursive(st.none() | st.booleans() | st.integers(-2**63, 2**63 - 1) | st.floats() | st.text(max_size=9)
                        | st.binary(max_size=9), lambda inner: st.lists(inner, max_size=3)
                        | st.dictionaries(st.text(max_size=5), inner, max_size=3), max_leaves=8)
records = st.fixed_dictionaries({}, optional={f: plausible[f] | values for f in FIELDS})
entries = st.one_of(records, values)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(raw=st.lists(entries, max_size=6), subkeys=st.lists(st.binary(max_size=20) | st.text(max_size=5), max_size=6))
def test_malformed_progress_records_are_dropped_and_never_break_the_view(raw, subkeys):
    now = 1_000_000.0
    stored = {key: ValueWithExpiration(value, now + 5) for key, value in zip(subkeys, raw)}
    for wrapped in (ValueWithExpiration(stored, now + 5), stored, raw, None):
        parsed, _ = parse_records(wrapped, model_schema="s", now=now)
        assert all(isinstance(r, ProgressRecord) for r in parsed)
        local = ProgressRecord.construct(peer_id=b"me", instance="me", epoch=3, samples=10, samples_per_second=5.0,
                                         time=now, client_mode=False, model_schema="s", target_batch_size=64,
                                         params_digest=None)
        checked = ClaimChecker().check(parsed, local, now, 64, now - 1)
        progress = aggregate_progress(checked.records, local, 64, now, ahead=checked.ahead)
        assert progress.epoch >= 3 and 0 <= progress.samples_accumulated and math.isfinite(progress.eta)
        assert 1 <= progress.num_peers <= progress.max_peers <= 1 + len(parsed)
        assert math.isfinite(progress.samples_per_second)


def _containers(inner):  # a named function: hypothesis reads a lambda's source, which a multi-line one can defeat
    return st.lists(inner, max_size=3) | st.fixed_dictionaries({"__dict__": st.lists(
        st.lists(inner, min_size=2, max_size=2) | inner, max_size=3)}) | st.fixed_dictionaries(
        {"__tuple__": st.lists(inner, max_size=3) | inner}) | st.dictionaries(st.text(max_size=6), inner, max_size=2)


skeletons = st.recursive(scalars | st.fixed_dictionaries({"__tensor__": st.integers(-3, 5) | values}), _containers,
                         max_leaves=12)


@settings(max_examples=400, deadline=None)
@given(skeleton=skeletons, depth=st.integers(0, 3000))
def test_state_skeletons_from_donors_either_parse_or_raise_value_error(skeleton, depth):
    nested = skeleton
    for _ in range(depth if depth > 2000 else 0):  # a stack-exhausting nest
        nested = [nested]
    try:
        unflatten(nested, [torch.zeros(2)])
    except ValueError:
        pass
    with pytest.raises(ValueError, match="dict keys"):  # a tuple key holding a list is unhashable
        unflatten({"__dict__": [[{"__tuple__": [[1, "a"]]}, 1]]}, [])


@settings(max_examples=200, deadline=None)
@given(payload=st.binary(max_size=64) | packable.map(MSGPackSerializer.dumps))
def test_gather_metadata_from_groupmates_is_a_dict_or_nothing(payload):
    assert isinstance(_member_info(MSGPackSerializer, payload), dict)


@pytest.fixture(scope="module")
def peer():
    dht = hivemind.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    model = torch.nn.Linear(4, 3)
    opt = swarm_opt.Optimizer(dht=dht, run_id="fuzz", target_batch_size=64, params=model.parameters(),
                              optimizer=lambda p: torch.optim.Adam(p, lr=0.1), matchmaking_time=1.0,
                              averaging_timeout=5.0, batch_size_per_step=8)
    yield opt
    opt.shutdown()
    dht.shutdown()


tensors = st.builds(lambda shape, dtype, fill: torch.full(shape, fill, dtype=torch.float32).to(dtype),
                    st.lists(st.integers(0, 4), max_size=3).map(tuple),
                    st.sampled_from([torch.float32, torch.float64, torch.float16, torch.int64, torch.bool]),
                    st.sampled_from([0.0, 1.0, -1e30, float("nan"), float("inf")]))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_corrupted_or_truncated_state_download_is_refused_and_changes_nothing(peer, data):
    before = [t.clone() for t in flatten({"p": peer.param_groups[0]["params"], "o": peer.state_dict()})[1]]
    epoch_before = peer.local_epoch
    good_meta, good_tensors = peer._shareable_state()
    meta = dict(good_meta, epoch=good_meta["epoch"] + 1)
    kind = data.draw(st.sampled_from(["truncate", "reshape", "retype", "poison", "metadata", "skeleton"]))
    received = list(good_tensors)
    if kind == "truncate":
        received = received[:data.draw(st.integers(0, max(0, len(received) - 1)))]
    elif kind in ("reshape", "retype", "poison"):
        i = data.draw(st.integers(0, len(received) - 1))
        received[i] = data.draw(tensors) if kind != "poison" else torch.full_like(received[i], float("nan"))
    elif kind == "metadata":
        meta = data.draw(values | st.fixed_dictionaries({"format": values, "schema": values, "epoch": values,
                                                         "skeleton": values}))
    else:
        meta = dict(meta, skeleton=data.draw(skeletons))
    try:
        peer._apply_downloaded_state(meta, received, b"donor", min_epoch=epoch_before + 1)
    except IncompatibleStateError:
        pass
    else:  # a replaced tensor that happens to fit in every detail makes a valid state: it is applied as sent
        assert kind in ("reshape", "retype") and peer.local_epoch == meta["epoch"]
        params = peer.param_groups[0]["params"]
        assert all(torch.equal(p, t) for p, t in zip(params, received))
        peer._apply_downloaded_state(good_meta, good_tensors, b"donor", min_epoch=0)  # back to before
        return
    after = flatten({"p": peer.param_groups[0]["params"], "o": peer.state_dict()})[1]
    assert peer.local_epoch == epoch_before
    assert len(after) == len(before) and all(torch.equal(a, b) for a, b in zip(after, before))
