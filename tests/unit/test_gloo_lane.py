"""The gloo lane without a swarm: its configuration, what it accepts from the network, and its maths (two lane ends
in one process, each in its own thread, as two averager processes would run them)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from typing import Iterator, List

import pytest
import torch

import swarm_opt
from swarm_opt.errors import ConfigError, ConfigTypeError
from swarm_opt.gloo_lane import (
    LANE_KEY,
    Gloo,
    GlooLane,
    LaneFailure,
    _Share,
    lane_addresses,
    lane_codec_dtype,
    lane_key,
)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(host="localhost"), ConfigError, "IP address"),
    (dict(host="0.0.0.0"), ConfigError, "not 0.0.0.0"),
    (dict(host=None), ConfigTypeError, "IP address string"),
    (dict(port=-1), ConfigError, "port"),
    (dict(port=70000), ConfigError, "port"),
    (dict(port=(5000, 4000)), ConfigError, "first <= last"),
    (dict(port=(0, 10)), ConfigError, "first <= last"),
    (dict(port=True), ConfigError, "port"),
    (dict(timeout=0), ConfigError, "positive number of seconds"),
    (dict(timeout=float("inf")), ConfigError, "positive number of seconds"),
])
def test_gloo_rejects_bad_input_with_a_fix(kwargs, error, match):
    with pytest.raises(error, match=match):
        Gloo(**kwargs)


def test_gloo_listens_on_the_first_free_port_of_a_range_and_names_the_fix_when_none_is():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match="pick a free port"):
            Gloo(port=port).listen()
        with Gloo(port=(port, min(port + 50, 65535))).listen() as sock:
            assert sock.getsockname()[0] == "127.0.0.1" and sock.getsockname()[1] > port


def test_the_lane_carries_fp32_fp16_and_powersgd_factors_and_refuses_other_codecs_at_construction():
    assert lane_codec_dtype(swarm_opt.NoCompression()) == torch.float32
    assert lane_codec_dtype(swarm_opt.Float16()) == torch.float16
    assert lane_codec_dtype(swarm_opt.PowerSGD(rank=4)) == torch.float32
    assert lane_codec_dtype(swarm_opt.PowerSGD(rank=4, factors=swarm_opt.Float16())) == torch.float16
    for codec in (swarm_opt.Int8Blockwise(), swarm_opt.Uniform8Bit()):
        with pytest.raises(ConfigError, match="drop transport=Gloo"):
            lane_codec_dtype(codec)


def test_a_private_run_needs_a_secret_for_the_lane_and_its_keys_derive_from_it():
    class Access:
        def __init__(self, run):
            self.run = run

    assert lane_key(None) == b""
    a = lane_key(Access(swarm_opt.PrivateRun(secret=b"s" * 32)))
    b = lane_key(Access(swarm_opt.PrivateRun(secret=b"t" * 32)))
    assert a and b and a != b

    class NoSecret:
        averaging_tag = b""

    with pytest.raises(ConfigError, match="needs a run secret"):
        lane_key(Access(NoSecret()))


def test_lane_addresses_need_every_member_to_announce_a_valid_one():
    good = [{LANE_KEY: "127.0.0.1:4000"}, {LANE_KEY: "[::1]:4001"}]
    assert lane_addresses(good) == [("127.0.0.1", 4000), ("::1", 4001)]
    hostile = ["", "127.0.0.1", "127.0.0.1:0", "127.0.0.1:65536", "0.0.0.0:4000", "example.com:4000",
               "127.0.0.1:-1", "1" * 100 + ":4000", 4000, None, ["127.0.0.1", 4000]]
    for value in hostile:
        assert lane_addresses([good[0], {LANE_KEY: value}]) is None, value
    assert lane_addresses([good[0], {}]) is None  # a member without the lane: hivemind's path
    assert lane_addresses([good[0], "not a dict"]) is None


@contextlib.contextmanager
def _lanes(n: int, dtype: torch.dtype = torch.float32) -> Iterator[List[GlooLane]]:
    """``n`` started lane ends on loopback, closed afterwards."""
    lanes = [GlooLane(Gloo(), wire_dtype=dtype, timeout=5.0, key=b"", namespace="unit") for _ in range(n)]
    try:
        for lane in lanes:
            lane.start()
        yield lanes
    finally:
        for lane in lanes:
            lane.close()


def _round(lanes, tensors, weights, group_id: bytes, order=None, finite=None) -> list:
    """One round of every lane end at once; returns what each raised (None if nothing); ``finite`` (a list) gets
    what each said of the mean's finiteness."""
    peer_ids = [f"peer{i}".encode() for i in range(len(lanes))]
    order = list(range(len(lanes))) if order is None else order
    ordered = [peer_ids[i] for i in order]
    addresses = [(lanes[i].config.host, lanes[i].port) for i in order]
    errors: list = [None] * len(lanes)

    def run(i: int) -> None:
        try:
            _, ok = lanes[i].all_reduce(tensors[i], ordered, peer_ids[i], group_id, addresses, weights[i], 5.0)
            if finite is not None:
                finite.append(ok)
        except LaneFailure as e:
            errors[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(lanes))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return errors


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.float16, 3e-3)])
def test_lane_ends_get_the_same_weighted_mean_and_reuse_their_process_group(dtype, tol):
    with _lanes(3, dtype) as lanes:
        shapes = [(700, 1000), (3,), (50, 2)]  # one large tensor (in place), two small ones (coalesced)
        for round_id, order in enumerate([[0, 1, 2], [2, 0, 1], [1, 2, 0]]):
            inputs = [[torch.randn(s, generator=torch.Generator().manual_seed(10 * round_id + i)) * (100 + i)
                       for s in shapes] for i in range(3)]
            weights = [1.0, 2.0, 5.0]
            tensors = [[t.clone() for t in peer] for peer in inputs]
            assert _round(lanes, tensors, weights, group_id=bytes([round_id]) * 8, order=order) == [None] * 3
            if round_id == 0:
                first = [id(group) for lane in lanes for _, group in lane._groups.values()]
            for k in range(len(shapes)):
                expected = sum(w * peer[k] for w, peer in zip(weights, inputs)) / sum(weights)
                scale = expected.abs().max()
                for peer in tensors:
                    assert torch.equal(peer[k], tensors[0][k])  # identical on every member
                    assert (peer[k] - expected).abs().max() <= tol * scale
        # the first round's process groups served every round, whoever hosted the rendezvous
        assert [id(group) for lane in lanes for _, group in lane._groups.values()] == first and len(first) == 3


def test_equal_weights_are_divided_after_the_sum_and_anyones_nan_shows_in_every_members_check():
    """With equal weights the lane sums first and divides in the pass that checks the mean: the same mean as
    scaling first; a member that sends NaN (unchecked, as a round matched ahead sends) is seen by everyone."""
    with _lanes(3) as lanes:
        shapes = [(700, 1000), (3,)]
        inputs = [[torch.randn(s, generator=torch.Generator().manual_seed(i)) * 100 for s in shapes] for i in range(3)]
        tensors, finite = [[t.clone() for t in peer] for peer in inputs], []
        assert _round(lanes, tensors, [2.0] * 3, b"e" * 8, finite=finite) == [None] * 3 and finite == [True] * 3
        for k in range(len(shapes)):
            expected = sum(peer[k] for peer in inputs) / 3
            for peer in tensors:
                assert torch.equal(peer[k], tensors[0][k])
                assert (peer[k] - expected).abs().max() <= 1e-6 * expected.abs().max()
        for poisoned in (0, 1):  # the large tensor (divided after the sum), then a small one (scaled first)
            tensors, finite = [[t.clone() for t in peer] for peer in inputs], []
            tensors[2][poisoned].view(-1)[1] = float("nan")
            weights = [2.0] * 3 if poisoned == 0 else [1.0, 2.0, 3.0]
            assert _round(lanes, tensors, weights, bytes([poisoned]) * 8, finite=finite) == [None] * 3
            assert finite == [False] * 3


def test_a_member_that_never_comes_fails_the_round_for_the_others_and_drops_their_group():
    with _lanes(3) as lanes:
        tensors = [[torch.ones(10)] for _ in range(3)]
        assert _round(lanes, tensors, [1.0] * 3, b"a" * 8) == [None] * 3
        peer_ids = [f"peer{i}".encode() for i in range(3)]
        addresses = [(lane.config.host, lane.port) for lane in lanes]
        errors = []

        def run(i: int) -> None:
            try:
                lanes[i].all_reduce(tensors[i], peer_ids, peer_ids[i], b"b" * 8, addresses, 1.0, 1.0)
            except LaneFailure as e:
                errors.append(e)

        threads = [threading.Thread(target=run, args=(i,)) for i in (0, 1)]  # peer 2 stays away
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert len(errors) == 2 and all(not lane._groups for lane in lanes[:2])
        host = addresses[0]
        kept = lanes[1]._stores[host]  # the connection to the host's store stays (only a wait timed out)
        assert _round(lanes, tensors, [1.0] * 3, b"c" * 8) == [None] * 3  # the next round builds a new group
        assert lanes[1]._stores[host] is kept


def test_a_connection_to_a_store_whose_host_left_is_dropped():
    with _lanes(2) as lanes:
        tensors = [[torch.ones(10)] for _ in range(2)]
        assert _round(lanes, tensors, [1.0] * 2, b"a" * 8) == [None] * 2
        host = (lanes[0].config.host, lanes[0].port)
        assert host in lanes[1]._stores
        lanes[0].close()  # its store stops serving
        peer_ids = [b"peer0", b"peer1"]
        for round_id in (b"b", b"c"):  # (the first write after the host left may still be buffered)
            with pytest.raises(LaneFailure):
                lanes[1].all_reduce(tensors[1], peer_ids, b"peer1", round_id * 8, [host, host], 1.0, 1.0)
            if host not in lanes[1]._stores:
                break
        assert host not in lanes[1]._stores


def test_a_rounds_handshake_keys_are_deleted_after_it_in_the_lanes_thread_and_chores_after_close_run_at_once():
    """What no member waits for after a round (deleting its handshake keys from the host's store) runs in the lane's
    thread once the round returned; a chore handed to a closed lane runs at once."""
    with _lanes(2) as lanes:
        group_id = b"k" * 8
        assert _round(lanes, [[torch.ones(10)] for _ in lanes], [1.0, 1.0], group_id) == [None, None]
        keys = [f"{lanes[0].namespace}/{group_id.hex()}/hello/{rank}" for rank in range(2)]
        deadline = time.monotonic() + 5
        while lanes[0]._store.check(keys[:1]) or lanes[0]._store.check(keys[1:]):
            assert time.monotonic() < deadline, "the round's handshake keys were never deleted"
            time.sleep(0.01)
        assert lanes[0]._executor is not None  # (they were deleted there: no round ran in it)
    done: list = []
    lanes[0].later(done.append, "now")
    assert done == ["now"]


def test_a_groupmates_share_of_a_round_is_checked():
    assert _Share.parse(b'{"token": "ab", "weight": 2.5, "absmax": [1.0, 0]}', 2) == _Share("ab", 2.5, [1.0, 0])
    hostile = [b"", b"[]", b"not json", b'{"token": "", "weight": -1, "absmax": []}',
               b'{"token": "", "weight": NaN, "absmax": []}', b'{"token": "", "weight": true, "absmax": []}',
               b'{"token": 5, "weight": 1, "absmax": []}', b'{"token": "", "weight": 1, "absmax": [1.0]}',
               b'{"token": "", "weight": 1}', b'{"token": "", "weight": 1, "absmax": {}}',
               b'{"token": "' + b"a" * 65 + b'", "weight": 1, "absmax": []}', b"1" * 10_000]
    for raw in hostile:
        with pytest.raises(LaneFailure, match="malformed"):
            _Share.parse(raw, 0)


@pytest.mark.parametrize("order", [
    ["watch", "lane", "done"], ["lane", "watch", "done"], ["lane", "done", "watch"], ["watch", "done"],
    ["done", "watch"],
])
def test_the_host_hears_first_what_the_averager_process_said_first_of_a_step_and_nothing_is_kept(order):
    """The averager process tells the host how a step goes on (``_Engine._tell_host``) through a future that the host
    sends it (``_Engine.watch``): whichever arrives first, the host hears the first news, and once the step is done
    and watched, the averager process keeps nothing of it."""
    from collections import OrderedDict
    from types import SimpleNamespace

    from hivemind.utils import MPFuture

    from swarm_opt._hivemind.engine import _Engine

    engine = SimpleNamespace(_watches={}, _unheard=OrderedDict())
    step, call, watch = SimpleNamespace(_uid=7), object(), MPFuture()
    for event in order:
        if event == "watch":
            asyncio.run(_Engine._watch(engine, 7, watch))
        else:
            _Engine._tell_host(engine, step, event, call if event == "lane" else None)
    assert watch.result(timeout=0) == (order[1 if order[0] == "watch" else 0], call if "lane" in order else None)
    assert not engine._watches and not engine._unheard


def test_news_of_steps_whose_watch_never_comes_is_bounded():
    from collections import OrderedDict
    from types import SimpleNamespace

    from swarm_opt._hivemind.engine import _MOST_UNHEARD, _Engine

    engine = SimpleNamespace(_watches={}, _unheard=OrderedDict())
    for uid in range(3 * _MOST_UNHEARD):
        _Engine._tell_host(engine, SimpleNamespace(_uid=uid), "done", None)
    assert len(engine._unheard) == _MOST_UNHEARD and 3 * _MOST_UNHEARD - 1 in engine._unheard
