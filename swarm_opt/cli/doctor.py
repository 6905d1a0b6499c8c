"""``swarm-opt doctor``: why a machine cannot join a run, in words that say what to change.

hivemind's own answer to most network problems is "none of the initial_peers responded". The doctor checks, one line
each, with the fix where something is wrong:

* each initial peer: can this machine open a TCP connection to it (refused: nothing listens there; no answer: a
  firewall or an address of another network; no route; a name that does not resolve), then the libp2p handshake
  (a wrong ``/p2p/`` id, a private run without its secret);
* this machine's clock against the swarm's (the DHT's timestamps, and the progress records, depend on it);
* its swarm_opt and hivemind versions against the run's (``--run-id``: from the peers' statistics records);
* whether the swarm can reach this machine back on the address it would announce: a fresh node listens there and a
  peer of the run is asked to dial it (``swarm_opt._hivemind.dial_back``); if it cannot, ``--client-mode`` or the
  port to open and the address to announce.

Exit status 0 when everything checked is fine, 1 otherwise.
"""

from __future__ import annotations

import argparse
import ipaddress
import socket
import time
from collections import Counter
from typing import Any, List, Optional, Tuple

PROG = "swarm-opt doctor"
_SKEW_WARN, _SKEW_FAIL = 1.0, 10.0  # seconds; a record more than 60 s in the future is dropped (swarm_opt.progress)


def _say(status: str, text: str) -> None:
    print(f"{status:<5} {text}", flush=True)


def _host_port(maddr: str) -> Tuple[Optional[str], Optional[int]]:
    from hivemind.utils.multiaddr import Multiaddr

    parsed = Multiaddr(maddr)
    host = None
    for protocol in ("ip4", "ip6", "dns", "dns4", "dns6"):
        try:
            host = parsed.value_for_protocol(protocol)
            break
        except Exception:
            continue
    try:
        port = int(parsed.value_for_protocol("tcp"))
    except Exception:
        port = None
    return host, port


def probe_tcp(host: str, port: int, timeout: float) -> Tuple[bool, str]:
    """Whether a TCP connection to host:port opens, and in words why not."""
    began = time.monotonic()
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True, f"TCP connection in {1000 * (time.monotonic() - began):.0f} ms"
    except socket.gaierror as e:
        return False, f"the name {host} does not resolve ({e.strerror or e})"
    except ConnectionRefusedError:
        return False, (f"connection refused: nothing listens on {host}:{port} (is the peer running, and is this its "
                       f"port?)")
    except TimeoutError:
        return False, (f"no answer from {host}:{port} within {timeout:g} s: a firewall drops the connection, or the "
                       f"address belongs to another network (a private address seen from outside it?)")
    except OSError as e:
        return False, f"{e.strerror or e} ({host}:{port})"


def _is_private(host: str) -> bool:
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    return address.is_private or address.is_loopback or address.is_link_local


def run_doctor(args: argparse.Namespace) -> int:
    from swarm_opt._hivemind.node import parse_maddrs, start_dht
    from swarm_opt.cli.options import private_run
    from swarm_opt.errors import ConfigError

    initial = parse_maddrs(args.initial_peers, option="--initial-peers", need_peer_id=True)
    healthy = True
    reachable: List[str] = []
    for maddr in initial:
        host, port = _host_port(maddr)
        if host is None or port is None:
            _say("FAIL", f"initial peer {maddr}: not a TCP address (expected /ip4/HOST/tcp/PORT/p2p/ID)")
            healthy = False
            continue
        ok, why = probe_tcp(host, port, args.timeout)
        _say("ok" if ok else "FAIL", f"initial peer {maddr}: {'reachable, ' if ok else 'unreachable: '}{why}")
        healthy &= ok
        if ok:
            reachable.append(maddr)
    if not reachable:
        _say("FAIL", "no initial peer is reachable from this machine: fix the addresses above (ask the run's "
                     "organiser for a current address: 'swarm-opt dht' prints them)")
        return 1

    credentials = private_run(args)
    try:
        client = start_dht(initial_peers=reachable, client_mode=True, private_run=credentials)
    except ConfigError as e:
        _say("FAIL", f"TCP reaches the initial peers, but joining the DHT through them failed ({e}); a wrong /p2p/ "
                     f"id in the address, or a private run (pass its --run-secret-file)")
        return 1
    listener = None
    try:
        _say("ok", f"joined the swarm's DHT through {len(reachable)} initial peer(s)")
        healthy &= _check_clock(client, reachable, args.timeout)
        healthy &= _check_versions(client, args.run_id, args.timeout)
        if args.client_mode:
            _say("ok", "client mode: this peer only dials out, so nobody needs to reach it")
        else:
            try:
                listener = start_dht(host_maddrs=args.host_maddrs, announce_maddrs=args.announce_maddrs,
                                     identity_path=None)
            except ConfigError as e:
                _say("FAIL", f"cannot listen on {' '.join(args.host_maddrs)}: {e}")
                return 1
            healthy &= _check_dial_back(client, listener, reachable, args)
    finally:
        for dht in (listener, client):
            if dht is not None:
                dht.shutdown()
    _say("ok" if healthy else "FAIL", "all checks passed" if healthy else "see the lines marked FAIL or warn above")
    return 0 if healthy else 1


def _peer_ids(maddrs: List[str]) -> List[Any]:
    from hivemind.p2p import PeerID

    return [PeerID.from_base58(m.rsplit("/p2p/", 1)[1]) for m in maddrs]


def _check_clock(dht: Any, reachable: List[str], timeout: float) -> bool:
    import functools

    skews = []
    for peer, maddr in zip(_peer_ids(reachable), reachable):
        try:
            skew = dht.run_coroutine(functools.partial(_clock_skew, peer=peer, timeout=timeout),
                                     return_future=True).result(timeout=timeout + 5)
        except Exception:
            skew = None
        if skew is not None:
            skews.append((abs(skew), skew, maddr))
    if not skews:
        _say("warn", "clock: no initial peer answered a DHT ping; skew unknown")
        return False
    _, skew, maddr = max(skews)
    direction = "ahead of" if skew < 0 else "behind"
    text = f"clock: {abs(skew):.2f} s {direction} {maddr.rsplit('/p2p/', 1)[1][:16]}..."
    if abs(skew) < _SKEW_WARN:
        _say("ok", text)
        return True
    fix = "; synchronise it (e.g. 'sudo timedatectl set-ntp true', or chrony/ntpd)"
    _say("FAIL" if abs(skew) >= _SKEW_FAIL else "warn", text + fix)
    return False


async def _clock_skew(dht: Any, node: Any, *, peer: Any, timeout: float) -> Optional[float]:
    """The peer's DHT time minus ours, at the middle of a ping."""
    from hivemind.proto import dht_pb2
    from hivemind.utils import get_dht_time

    began = get_dht_time()
    response = await node.protocol.get_stub(peer).rpc_ping(
        dht_pb2.PingRequest(peer=node.protocol.node_info, validate=False), timeout=timeout)
    ended = get_dht_time()
    if not response.dht_time:
        return None
    return float(response.dht_time) - (began + ended) / 2


def _check_versions(dht: Any, run_id: Optional[str], timeout: float) -> bool:
    import hivemind

    import swarm_opt
    from swarm_opt.monitor.stats import read_stats, use_stats_records

    ours = (str(swarm_opt.__version__), str(hivemind.__version__))
    if run_id is None:
        _say("ok", f"versions: swarm_opt {ours[0]}, hivemind {ours[1]} (pass --run-id to compare with the run's)")
        return True
    use_stats_records(dht, run_id)
    stats = read_stats(dht, run_id, timeout)
    if not stats:
        _say("warn", f"versions: no peer of run '{run_id}' publishes its versions (no peer yet, or they run a "
                     f"swarm_opt older than this one's statistics records); this peer runs swarm_opt {ours[0]}, "
                     f"hivemind {ours[1]}")
        return True
    counts = Counter((s.swarm_opt_version, s.hivemind_version) for s in stats.values())
    (theirs, how_many), = counts.most_common(1)
    if theirs == ours:
        _say("ok", f"versions: swarm_opt {ours[0]} and hivemind {ours[1]}, as {how_many} of {len(stats)} peer(s) of "
                   f"the run")
        return True
    fixes = [f"swarm_opt=={theirs[0]}"] if theirs[0] != ours[0] else []
    fixes += [f"hivemind=={theirs[1]}"] if theirs[1] != ours[1] else []
    _say("FAIL", f"versions: this peer runs swarm_opt {ours[0]}, hivemind {ours[1]}; {how_many} of {len(stats)} "
                 f"peer(s) of run '{run_id}' run swarm_opt {theirs[0]}, hivemind {theirs[1]}: "
                 f"pip install {' '.join(fixes)}")
    return False


def _check_dial_back(client: Any, listener: Any, reachable: List[str], args: argparse.Namespace) -> bool:
    from swarm_opt._hivemind.dial_back import ask_dial_back

    maddrs = [str(m) for m in (args.announce_maddrs or listener.get_visible_maddrs())]
    maddrs = [m.split("/p2p/")[0] for m in maddrs]
    shown = " ".join(maddrs)
    reply: dict = {}
    for helper in _peer_ids(reachable):
        reply = ask_dial_back(client, helper, listener.peer_id, maddrs)
        if not reply.get("unanswered") and not reply.get("busy"):
            break
    if reply.get("ok"):
        _say("ok", f"reachability: a peer of the swarm dialed this machine at {shown}: others can connect to it")
        return True
    if reply.get("unanswered") or reply.get("busy"):
        _say("warn", f"reachability: not tested ({reply.get('error')}); no initial peer answers dial-back requests "
                     f"(they run an older swarm_opt)")
        return True
    port = next((p for p in (_host_port(m)[1] for m in maddrs) if p), None) or "PORT"
    seen = [h for h in (_host_port(m)[0] for m in reply.get("seen_from", [])) if h]
    public = next((h for h in seen if not _is_private(h)), "PUBLIC_IP")
    _say("FAIL", f"reachability: the swarm cannot connect to this machine at {shown} ({reply.get('error')}). "
                 f"Either train with --client-mode (this peer then only dials out; it still averages), or make TCP "
                 f"port {port} reachable: open it in the firewall (or forward it on the router) and run with "
                 f"--host-maddrs /ip4/0.0.0.0/tcp/{port} --announce-maddrs /ip4/{public}/tcp/{port}")
    return False

