"""Bytes per second per peer spent on tracking progress, today's read-everything design against sharded sampling.

Real hivemind DHT nodes on loopback, one per peer, each with its own p2pd daemon and its own RSA signing key, run in
ONE Python process (one asyncio loop) to keep 64 peers within this machine: each peer is a ``ProgressTracker`` (with
its real background thread and timings) over its own ``DHTNode``, and only tracks (a driver reports samples at a
per-peer rate and moves every peer to the next epoch once half of them see the target reached). Differences from
deployment: all nodes share one process, two CPU cores and loopback (no latency; under CPU load a tracker refreshes
less often than once a second: the achieved refresh rate is printed and bytes are also given per refresh); a
deployed peer's DHT node also serves other keys (averaging, state).

"At cadence" converts the bytes measured per refresh (a read, the writes and the DHT's own traffic in between) to
the product's refresh rate: one per ``refresh_period`` (1 s) in a swarm read whole (today's tracker also refreshes
faster in the last seconds of an epoch, not counted: in its favour), one per ``sampled_period`` (3 s) when sharded.
Bytes are what each DHT node's RPCs move: the serialized protobuf request plus response of every call the node
makes (stores, finds, pings, cache refreshes), counted at the caller, so that the sum over nodes is the swarm's DHT
payload once (libp2p framing and encryption are not counted). Per peer = sum / N.

"baseline" is today's design, selected by ``TrackerConfig(exact_up_to=2**40)`` (every record under one key, read
whole at every refresh); "sharded" is the default ``TrackerConfig()``. The accuracy of the epoch trigger is the
exact number of samples the swarm had accumulated when each peer's tracker first said ``ready``, over the target.

    python benchmarks/tracker_traffic.py                        # 2..64 peers, both designs, ~25 min
    python benchmarks/tracker_traffic.py --peers 2 8 --seconds 20 --out /tmp/tt.json
    python benchmarks/tracker_traffic.py --no-operations --peers 8 --shard-size 2 --seconds 40  # 8 peers, sharded
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import logging
import math
import random
import threading
import time
from typing import Dict, List, Optional

import numpy as np
from _common import code_version, command_line, machine, table  # also puts the repo on sys.path for swarm_opt
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.node import DHTNode
from hivemind.dht.validation import CompositeValidator
from hivemind.utils.crypto import RSAPrivateKey

from swarm_opt import TrackerConfig
from swarm_opt.progress import _SHARD_READ_BEAM, ProgressTracker

DESIGNS = {"baseline": TrackerConfig(exact_up_to=2 ** 40), "sharded": TrackerConfig()}
SAMPLES_PER_SECOND = 10.0  # a peer's mean throughput; each peer draws its own in [0.5, 1.5] x this


class LoopbackDHT:
    """The part of ``hivemind.DHT`` a tracker uses, over a ``DHTNode`` running in the benchmark's event loop, with
    the node's own signing key (a hivemind DHT keeps one signer per process) and a byte counter on its RPCs."""

    def __init__(self, node: DHTNode, loop: asyncio.AbstractEventLoop, signer: RSASignatureValidator) -> None:
        self.node, self.loop, self.signer = node, loop, signer
        self.peer_id, self.client_mode = node.peer_id, False
        self.bytes = 0
        client = node.protocol.p2p._client
        call = client.call_unary_handler

        async def counted(peer_id, handle_name, data):
            response = await call(peer_id, handle_name, data)
            self.bytes += len(data) + len(response)
            return response

        client.call_unary_handler = counted

    def add_validators(self, validators: list) -> None:
        validators[:] = [self.signer if isinstance(v, RSASignatureValidator) else v for v in validators]
        self.node.protocol.record_validator.extend(validators)

    def store(self, key, value, expiration_time, subkey=None, return_future=False, **kwargs):
        future = asyncio.run_coroutine_threadsafe(
            self.node.store(key, value, expiration_time, subkey=subkey, **kwargs), self.loop)
        return future if return_future else future.result()

    def run_coroutine(self, coro, return_future=False):
        future = asyncio.run_coroutine_threadsafe(coro(self, self.node), self.loop)
        return future if return_future else future.result()

    def get(self, key, latest=False, return_future=False, **kwargs):
        future = asyncio.run_coroutine_threadsafe(self.node.get(key, latest=latest, **kwargs), self.loop)
        return future if return_future else future.result()


async def start_nodes(n: int) -> List[LoopbackDHT]:
    loop = asyncio.get_running_loop()
    dhts: List[LoopbackDHT] = []
    initial: List = []
    for i in range(n):
        signer = RSASignatureValidator(RSAPrivateKey())
        node = await DHTNode.create(initial_peers=initial[:3], host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                                    record_validator=CompositeValidator([signer]))
        dhts.append(LoopbackDHT(node, loop, signer))
        if i < 3:
            initial.extend(await node.get_visible_maddrs())
    return dhts


def run_swarm(n: int, config: TrackerConfig, seconds: float, warmup: float, epoch_seconds: float,
              seed: int) -> Dict:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    dhts = asyncio.run_coroutine_threadsafe(start_nodes(n), loop).result(600)
    rng = random.Random(seed)
    rates = [SAMPLES_PER_SECOND * rng.uniform(0.5, 1.5) for _ in range(n)]
    target = int(sum(rates) * epoch_seconds)
    trackers = [ProgressTracker(dht, "bench", target, model_schema="m", config=config) for dht in dhts]
    refreshes = [0] * n
    for i, tracker in enumerate(trackers):
        fetch = tracker._fetch

        def counted(*, timeout, _fetch=fetch, _i=i):
            refreshes[_i] += 1
            return _fetch(timeout=timeout)

        tracker._fetch = counted
    for tracker in trackers:
        tracker.report(0, 0)
        tracker.mark_joined()  # founders of the run: they publish from the start (a newcomer waits to have caught up)
        for attempt in range(3):  # a loaded machine may time a first store out; the product would fail the same way
            try:
                tracker.start()
                break
            except TimeoutError:
                if attempt == 2:
                    raise

    epoch, epoch_start = 0, time.monotonic()
    triggered: Dict[int, float] = {}
    ratios, errors, levels = [], [], []
    measuring, measure_start, bytes_start, refreshes_start = False, 0.0, 0, 0
    deadline = time.monotonic() + warmup + seconds
    while time.monotonic() < deadline:
        now = time.monotonic()
        if not measuring and now - (deadline - seconds) >= 0:
            measuring, measure_start = True, now
            bytes_start, refreshes_start = sum(d.bytes for d in dhts), sum(refreshes)
        elapsed = now - epoch_start
        exact = sum(int(rate * elapsed) for rate in rates)
        for i, tracker in enumerate(trackers):
            tracker.report(epoch, int(rates[i] * elapsed))
        for i, tracker in enumerate(trackers):
            progress = tracker.progress
            if measuring and i not in triggered and rng.random() < 0.25:
                errors.append(progress.samples_accumulated / max(1, exact) - 1)
            if i not in triggered and progress.ready:
                triggered[i] = exact
                if measuring:
                    ratios.append(exact / target)
        if 2 * len(triggered) >= n:  # the round: every peer moves on
            epoch, epoch_start, triggered = epoch + 1, time.monotonic(), {}
            levels.append([t._records.sample.level for t in trackers])
        time.sleep(0.1)
    duration = time.monotonic() - measure_start
    total_bytes = sum(d.bytes for d in dhts) - bytes_start
    total_refreshes = sum(refreshes) - refreshes_start
    for tracker in trackers:
        tracker.shutdown(timeout=5)

    async def stop():
        for d in dhts:
            await d.node.shutdown()

    asyncio.run_coroutine_threadsafe(stop(), loop).result(120)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    sampled = any(level > 0 for row in levels for level in row) or trackers[0]._records.sample.level > 0
    cadence = 1 / (config.sampled_period if sampled else config.refresh_period)
    return {
        "peers": n, "seconds": duration, "epochs": epoch,
        "bytes_per_peer_per_second_at_cadence": total_bytes / max(1, total_refreshes) * cadence,
        "cadence_per_second": cadence,
        "bytes_per_peer_per_second": total_bytes / n / duration,
        "refreshes_per_peer_per_second": total_refreshes / n / duration,
        "bytes_per_refresh": total_bytes / max(1, total_refreshes),
        "trigger_ratio": {"mean": float(np.mean(ratios)) if ratios else None,
                          "p10": float(np.percentile(ratios, 10)) if ratios else None,
                          "p90": float(np.percentile(ratios, 90)) if ratios else None, "n": len(ratios)},
        "estimate_error": {"mean": float(np.mean(errors)) if errors else None,
                           "mean_abs": float(np.mean(np.abs(errors))) if errors else None, "n": len(errors)},
        "levels": sorted(set(level for row in levels for level in row)),
    }


async def measure_operations(nodes: int, sizes: List[int]) -> Dict[str, List[float]]:
    """Bytes one DHT operation moves on a quiet DHT of ``nodes`` real nodes, against the records under the key:
    a read (latest, hivemind's default beam / the sharded beam) and a write (default beam / beam 5). One
    operation at a time, so that CPU load cannot time anything out."""
    from hivemind.dht.routing import DHTID
    from hivemind.utils import get_dht_time

    from swarm_opt._hivemind.near_store import REFRESH, WRITE_BEAM, forget, nearest_nodes, store_near
    from swarm_opt.progress import _SHARD_READ_BEAM, progress_validators
    from swarm_opt.sharding import progress_key

    dhts = await start_nodes(nodes)
    for d in dhts:
        d.add_validators(progress_validators("model"))
    out: Dict[str, List[float]] = {"records": [], "read": [], "read_sharded": [], "write": [], "write_sharded": [],
                                   "write_direct": [], "find_nearest": []}
    value = {"peer_id": b"x" * 38, "instance": "0123456789abcdef", "epoch": 1, "samples": 1000,
             "samples_per_second": 10.0, "time": 0.0, "client_mode": False, "model_schema": "m" * 64,
             "target_batch_size": 10000, "params_digest": [0.5] * 8}
    for size in sizes:
        key = f"{progress_key('model')}_{size}"  # an unvalidated key of the same shape: each record is signed
        writers = dhts[:size] if size <= len(dhts) else dhts
        for i in range(size):
            d = writers[i % len(writers)]
            subkey = d.signer.local_public_key + f"/{i:016d}".encode()
            await d.node.store(key, dict(value, time=get_dht_time()), get_dht_time() + 120, subkey=subkey)
        reader, writer = dhts[-1], writers[0]
        own = writer.signer.local_public_key + b"/0000000000000000"
        read_beams = {"read": {}, "read_sharded": {"beam_size": _SHARD_READ_BEAM}}
        write_beams = {"write": {}, "write_sharded": {"beam_size": WRITE_BEAM}}
        for name in (*read_beams, *write_beams):
            costs = []
            for _ in range(3):
                before = sum(d.bytes for d in dhts)
                if name in read_beams:
                    await reader.node.get(key, latest=True, **read_beams[name])
                else:
                    await writer.node.store(key, dict(value, time=get_dht_time()), get_dht_time() + 120, subkey=own,
                                            **write_beams[name])
                await asyncio.sleep(0.3)  # the caching store a read triggers
                costs.append(sum(d.bytes for d in dhts) - before)
            out[name].append(float(np.median(costs)))
        # the product's sharded write: a search for the key's nearest nodes that downloads no value (repeated every
        # REFRESH seconds), then one store RPC per node
        store = functools.partial(store_near, key=key, subkey=own)
        for name in ("find_nearest", "write_direct"):
            costs = []
            for _ in range(3):
                if name == "find_nearest":
                    forget(writer.node, key)
                before = sum(d.bytes for d in dhts)
                if name == "find_nearest":
                    await nearest_nodes(writer.node, DHTID.generate(source=key), beam_size=WRITE_BEAM,
                                        refresh=REFRESH, now=get_dht_time())
                else:
                    assert await store(writer, writer.node, value=dict(value, time=get_dht_time()),
                                       expiration_time=get_dht_time() + 120)
                await asyncio.sleep(0.3)
                costs.append(sum(d.bytes for d in dhts) - before)
            out[name].append(float(np.median(costs)))
        out["records"].append(size)
    for d in dhts:
        await d.node.shutdown()
    return out


def cost_model(ops: Dict[str, List[float]], config: TrackerConfig) -> Dict[str, Dict[int, float]]:
    """Bytes per second per peer from the per-operation costs (linear in the records under the key, fitted) and
    each design's rules: the baseline reads and writes the one key of N records once per ``refresh_period``; the
    sharded design reads one shard and writes at each of its publishing levels once per ``sampled_period`` (once
    per ``refresh_period`` while the swarm fits in one key). "sharded" writes a shard straight to its nearest nodes
    (plus one value-less search for them every ``REFRESH`` seconds); "sharded_search" is the previous
    write, a hivemind store whose search downloads the shard from every node it visits."""
    from swarm_opt._hivemind.near_store import REFRESH
    from swarm_opt.sharding import ShardSample

    lines = {name: np.polyfit(ops["records"], ops[name], 1) for name in ("read", "read_sharded", "write",
                                                                         "write_sharded", "write_direct",
                                                                         "find_nearest")}
    cost = lambda name, records: float(np.polyval(lines[name], records))  # noqa: E731
    writes = {"sharded_search": lambda records: cost("write_sharded", records),
              "sharded": lambda records: cost("write_direct", records)
              + cost("find_nearest", records) * config.sampled_period / REFRESH}
    out: Dict[str, Dict[int, float]] = {"baseline": {}, **{design: {} for design in writes}}
    for n in (2, 4, 8, 16, 32, 64, 128, 256, 512, 1000, 2000):
        out["baseline"][n] = (cost("read", n) + cost("write", n)) / config.refresh_period
        sample = ShardSample(exact_up_to=config.exact_up_to, shard_size=config.shard_size,
                             horizon=config.sample_horizon)
        sample.observe(n)
        for design, write in writes.items():
            if sample.level == 0:
                out[design][n] = (cost("read", n) + cost("write", n) * len(sample.publish_levels())) \
                    / config.refresh_period
            else:
                records = n / 2 ** sample.level
                levels = sample.publish_levels()
                out[design][n] = (cost("read_sharded", records)
                                  + sum(cost("write", n) if level == 0 else write(n / 2 ** level)
                                        for level in levels)) / config.sampled_period
    return out


def sharded_config(shard_size: Optional[int]) -> TrackerConfig:
    """The default design, or one with ``shard_size`` records per shard that also shards swarms from that size on
    (``exact_up_to``, when below the default's), so that a few real peers take the sampled path."""
    if shard_size is None:
        return TrackerConfig()
    return TrackerConfig(shard_size=shard_size, exact_up_to=min(shard_size, TrackerConfig().exact_up_to))


def fit(points: List[Dict], design: str) -> Dict:
    """Least squares on the measured bytes per peer per second: linear in N for the baseline (every record read),
    a + b log2 N for the sharded design (a shard's size is bounded; DHT routes grow like log N)."""
    n = np.array([p["peers"] for p in points], dtype=float)
    y = np.array([p["bytes_per_peer_per_second_at_cadence"] for p in points])
    x = n if design == "baseline" else np.log2(n)
    b, a = np.polyfit(x, y, 1)
    at = lambda peers: float(a + b * (peers if design == "baseline" else math.log2(peers)))  # noqa: E731
    return {"model": "a + b*N" if design == "baseline" else "a + b*log2(N)", "a": float(a), "b": float(b),
            "at_1000": at(1000)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", type=int, nargs="*", default=[2, 4, 8, 16, 32, 64],
                        help="swarm sizes (none: only the per-operation costs)")
    parser.add_argument("--designs", nargs="+", default=list(DESIGNS), choices=list(DESIGNS))
    parser.add_argument("--seconds", type=float, default=60.0, help="measured seconds per swarm")
    parser.add_argument("--warmup", type=float, default=15.0)
    parser.add_argument("--epoch-seconds", type=float, default=12.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="/tmp/tracker_traffic.json")
    parser.add_argument("--plot", default=None, help="PNG of bytes/s per peer against N (needs matplotlib)")
    parser.add_argument("--model-nodes", type=int, default=32, help="DHT nodes for the per-operation costs")
    parser.add_argument("--operations", action=argparse.BooleanOptionalAction, default=True,
                        help="measure the per-operation costs and the model (~4 min)")
    parser.add_argument("--shard-size", type=int, default=None,
                        help="the sharded design's shard_size; below the default exact_up_to, also the swarm size "
                        "from which it shards (small values shard a small real swarm)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)

    ops: Dict[str, List[float]] = {}
    model: Dict[str, Dict[int, float]] = {}
    if args.operations:
        ops = asyncio.run(measure_operations(args.model_nodes, [1, 4, 16, 64]))
        model = cost_model(ops, DESIGNS["sharded"])
        columns = ("read", "read_sharded", "write", "write_sharded", "find_nearest", "write_direct")
        print(table(["records under the key", "read (default beam)", f"read (beam {_SHARD_READ_BEAM})",
                     "write (default beam)", "write (beam 5)", "find nearest (no value)", "write direct"],
                    [[r, *(f"{ops[k][i] / 1e3:.1f} KB" for k in columns)] for i, r in enumerate(ops["records"])]))
        print(table(["peers", "baseline KB/s per peer (model)", "sharded, search per write (model)",
                     "sharded, direct writes (model)"],
                    [[n, *(f"{model[design][n] / 1e3:.1f}" for design in ("baseline", "sharded_search", "sharded"))]
                     for n in model["baseline"]]), flush=True)
    results: Dict[str, List[Dict]] = {design: [] for design in args.designs}
    for n in args.peers:
        for design in args.designs:
            config = DESIGNS[design] if design == "baseline" else sharded_config(args.shard_size)
            result = run_swarm(n, config, args.seconds, args.warmup, args.epoch_seconds, args.seed)
            results[design].append(result)
            print(f"{design:8s} N={n:3d}: {result['bytes_per_peer_per_second'] / 1e3:8.2f} KB/s per peer "
                  f"({result['bytes_per_peer_per_second_at_cadence'] / 1e3:.2f} at the product's cadence), "
                  f"{result['refreshes_per_peer_per_second']:.2f} refreshes/s, trigger "
                  f"{result['trigger_ratio']['mean']}", flush=True)
    fits = {design: fit(points, design) for design, points in results.items() if len(points) >= 2}

    rows = []
    for design, points in results.items():
        for p in points:
            t, e = p["trigger_ratio"], p["estimate_error"]
            rows.append([design, p["peers"], f"{p['bytes_per_peer_per_second'] / 1e3:.2f}",
                         f"{p['bytes_per_peer_per_second_at_cadence'] / 1e3:.2f}",
                         f"{p['refreshes_per_peer_per_second']:.2f}", f"{p['bytes_per_refresh'] / 1e3:.2f}",
                         "-" if t["mean"] is None else f"{t['mean']:.3f} [{t['p10']:.2f}, {t['p90']:.2f}]",
                         "-" if e["mean_abs"] is None else f"{e['mean']:+.3f} / {e['mean_abs']:.3f}",
                         ",".join(map(str, p["levels"]))])
    print(table(["design", "peers", "KB/s per peer (measured)", "KB/s per peer at cadence", "refreshes/s",
                 "KB per refresh",
                 "samples at trigger / target (mean [p10, p90])", "estimate error (mean / mean abs)", "levels"],
                rows))
    for design, f in fits.items():
        print(f"{design}: {f['model']} with a={f['a']:.0f} B/s, b={f['b']:.1f} -> {f['at_1000'] / 1e3:.1f} KB/s per "
              f"peer at 1,000 peers")
    payload = {"command": command_line(), "machine": machine(), "code": code_version(),
               "finished": time.strftime("%Y-%m-%d %H:%M:%S"), "args": vars(args), "results": results, "fits": fits,
               "operations": ops, "model": model}
    with open(args.out, "w") as f:
        json.dump(payload, f, indent=2, default=str)
    print(f"wrote {args.out}; reproduce with: {command_line()}")
    if args.plot:
        plot(results, fits, args.plot)


def plot(results: Dict[str, List[Dict]], fits: Dict[str, Dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    grid = np.geomspace(2, 1000, 50)
    for design, points in results.items():
        line, = ax.plot([p["peers"] for p in points],
                        [p["bytes_per_peer_per_second_at_cadence"] / 1e3 for p in points], "o",
                        label=f"{design} (measured, at the product's cadence)")
        if design in fits:
            f = fits[design]
            x = grid if design == "baseline" else np.log2(grid)
            ax.plot(grid, (f["a"] + f["b"] * x) / 1e3, "--", color=line.get_color(), label=f"{design} (fit)")
    ax.axhline(10, color="gray", lw=0.8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("peers")
    ax.set_ylabel("KB/s per peer on tracking")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
