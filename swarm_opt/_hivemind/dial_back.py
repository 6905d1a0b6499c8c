"""Dial-back: a peer of the run tells a newcomer whether the swarm can reach it on the address it announces.

A peer that announces an address nobody can dial is the most common reason a swarm "does not work" for a volunteer:
it joins (it dials out), then every round that needs to reach it fails. Whether that address is reachable can only be
tested from outside, on a connection that the newcomer did not open (libp2p reuses an open connection, so a peer that
connected to us would "reach" us whatever our firewall says). So ``swarm-opt doctor`` starts a fresh listening node
that has no connection to anyone, and asks a peer of the run, through a second node, to dial that fresh node on its
announced addresses (``ask_dial_back``). Every swarm_opt DHT node answers such requests (``serve_dial_back``, added by
``swarm_opt._hivemind.node.start_dht``): one dial at a time, a few a minute, to TCP addresses only, and only to the
host the request came from (the asking node's connection arrived from that IP address: nobody can make a peer of the
run dial a third party), nothing sent but libp2p's handshake. The answer also says from which address the asking
node's connection arrived, a hint of this machine's public address.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any, Dict, List, Optional, Sequence

from google.protobuf.wrappers_pb2 import BytesValue
from hivemind.dht import DHT, DHTNode
from hivemind.p2p import PeerID
from hivemind.utils.multiaddr import Multiaddr

HANDLER = "swarm_opt.dial_back"
DIAL_TIMEOUT = 5.0  # seconds a dial-back may take
_MAX_MADDRS = 4
_MAX_PER_MINUTE = 12
_recent: List[float] = []  # when this node's last dial-backs began (its DHT process)
_busy: Optional[asyncio.Lock] = None  # created in the DHT process's event loop (serve_dial_back)


def _tcp_maddrs(texts: Sequence[Any]) -> List[Multiaddr]:
    found = []
    for text in list(texts)[:_MAX_MADDRS]:
        try:
            maddr = Multiaddr(str(text))
        except Exception:
            continue
        protocols = [p.name for p in maddr.protocols()]
        if protocols[:1] and protocols[0] in ("ip4", "ip6", "dns", "dns4", "dns6") and "tcp" in protocols:
            found.append(maddr)
    return found


async def serve_dial_back(dht: DHT, node: DHTNode) -> None:
    """Answer dial-back requests on this DHT node (runs in the DHT process; added once, at start)."""
    global _busy
    _busy = asyncio.Lock()

    async def handle(request: BytesValue, context: Any) -> BytesValue:
        return BytesValue(value=json.dumps(await _dial(node, request.value, context.remote_id)).encode())

    await node.p2p.add_protobuf_handler(HANDLER, handle, BytesValue)


async def _dial(node: DHTNode, raw: bytes, requester: PeerID) -> Dict[str, Any]:
    try:
        request = json.loads(raw)
        target = PeerID.from_base58(str(request["peer_id"]))
        maddrs = _tcp_maddrs(request.get("maddrs", []))
    except Exception:
        return {"ok": False, "error": "malformed request"}
    if not maddrs:
        return {"ok": False, "error": "no TCP address to dial"}
    now = time.monotonic()
    _recent[:] = [t for t in _recent if now - t < 60]
    if len(_recent) >= _MAX_PER_MINUTE or _busy is None or _busy.locked():
        return {"ok": False, "error": "busy, ask again in a minute", "busy": True}
    _recent.append(now)
    seen_from = await _address_of(node, requester)
    hosts = {_host(Multiaddr(a)) for a in seen_from} - {None}
    maddrs = [m for m in maddrs if _host(m) in hosts]
    if not maddrs:
        return {"ok": False, "error": "a dial-back dials only the host the request came from", "seen_from": seen_from}
    async with _busy:
        try:
            await asyncio.wait_for(node.p2p._client.connect(target, maddrs), DIAL_TIMEOUT)
        except asyncio.TimeoutError:
            return {"ok": False, "error": f"no answer within {DIAL_TIMEOUT:g} s", "seen_from": seen_from}
        except Exception as e:
            return {"ok": False, "error": _short(e), "seen_from": seen_from}
        try:
            await node.p2p._client.disconnect(target)
        except Exception:
            pass
    return {"ok": True, "seen_from": seen_from}


def _host(maddr: Multiaddr) -> Optional[str]:
    """The IP address of an /ip4 or /ip6 multiaddr (a name is not resolved: it never matches a connection's)."""
    for protocol in ("ip4", "ip6"):
        try:
            return maddr.value_for_protocol(protocol)
        except Exception:
            continue
    return None


async def _address_of(node: DHTNode, peer: PeerID) -> List[str]:
    try:
        for info in await node.p2p.list_peers():
            if info.peer_id == peer:
                return [str(a) for a in info.addrs][:4]
    except Exception:
        pass
    return []


def _short(error: BaseException) -> str:
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return text[:300]


async def _ask(dht: DHT, node: DHTNode, helper: PeerID, target: PeerID, maddrs: List[str],
               timeout: float) -> Dict[str, Any]:
    request = BytesValue(value=json.dumps({"peer_id": target.to_base58(), "maddrs": maddrs}).encode())
    try:
        reply = await asyncio.wait_for(node.p2p.call_protobuf_handler(helper, HANDLER, request, BytesValue), timeout)
        return json.loads(reply.value)
    except asyncio.TimeoutError:
        return {"ok": False, "error": f"{helper} did not answer within {timeout:g} s", "unanswered": True}
    except Exception as e:
        return {"ok": False, "error": f"{helper} could not be asked: {_short(e)}", "unanswered": True}


def ask_dial_back(dht: DHT, helper: PeerID, target: PeerID, maddrs: Sequence[Any],
                  timeout: float = DIAL_TIMEOUT + 5) -> Dict[str, Any]:
    """Ask ``helper`` (a peer of the run), through ``dht``, to dial ``target`` on ``maddrs``. Returns ``ok``, and
    ``error`` (why not), ``seen_from`` (the addresses ``dht``'s connection arrived from), ``unanswered`` (the helper
    could not be asked: an older swarm_opt, or unreachable)."""
    import functools

    coroutine = functools.partial(_ask, helper=helper, target=target, maddrs=[str(m) for m in maddrs],
                                  timeout=timeout)
    return dht.run_coroutine(coroutine, return_future=True).result(timeout=timeout + 5)
