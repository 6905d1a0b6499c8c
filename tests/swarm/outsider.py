"""A stranger who knows a private run's address but not its secret asks a member for its state directly over
libp2p (no DHT: the DHT refuses it). Run as ``python outsider.py CONFIG.json``; writes CONFIG["out"] (JSON) with how
many state messages it received."""

from __future__ import annotations

import asyncio
import json
import sys


async def ask_for_state(cfg: dict) -> int:
    from hivemind.p2p import P2P, PeerID
    from hivemind.proto import averaging_pb2

    from swarm_opt._hivemind.engine import _Engine
    from swarm_opt.optimizer import averaging_prefix, model_schema
    from tests.swarm.peer import make_model

    for attempt in range(3):  # the daemon gives up dialing its bootstrap peer quickly on a loaded machine
        try:
            p2p = await P2P.create(initial_peers=cfg["initial_peers"], host_maddrs=["/ip4/127.0.0.1/tcp/0"])
            break
        except Exception:
            if attempt == 2:
                raise
    try:
        donor = PeerID.from_base58(cfg["initial_peers"][0].rsplit("/p2p/", 1)[1])
        schema = model_schema(list(make_model().parameters()), "grad")
        stub = _Engine.get_stub(p2p, donor, namespace=averaging_prefix(cfg["run_id"], "grad", schema))
        received = 0
        stream = await stub.rpc_download_state(averaging_pb2.DownloadRequest())
        async for _message in stream:
            received += 1
        return received
    finally:
        await p2p.shutdown()


if __name__ == "__main__":
    config = json.load(open(sys.argv[1]))
    count = asyncio.run(asyncio.wait_for(ask_for_state(config), 60))
    json.dump({"received": count}, open(config["out"], "w"))
