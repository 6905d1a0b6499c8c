"""A hostile stranger: plain hivemind, no swarm_opt peer, that writes its own validly signed progress record with
made-up claims. Run as ``python liar.py CONFIG.json``; CONFIG has initial_peers, run_id, out (a file it touches once
its first lie is stored) and either ``epochs_ahead`` (claims that many epochs ahead of the swarm) or ``samples``
(claims that many samples in the swarm's epoch, at ``samples_per_second``). It stops when OUT.stop exists."""

from __future__ import annotations

import gc
import json
import os
import sys
import time


def main(config_path: str) -> None:
    import hivemind
    from hivemind.utils import get_dht_time

    from swarm_opt.progress import progress_key, progress_validators

    cfg = json.load(open(config_path))
    dht = hivemind.DHT(initial_peers=cfg["initial_peers"], host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    validators = progress_validators(cfg["run_id"])
    dht.add_validators(validators)
    key = progress_key(cfg["run_id"])
    subkey = validators[-1].local_public_key + b"/liar"
    told = False
    while not os.path.exists(cfg["out"] + ".stop"):
        found = dht.get(key, latest=True)
        others = [entry.value for sub, entry in (found.value.items() if found else [])
                  if sub != subkey and isinstance(entry.value, dict)]
        if others:
            honest = max(others, key=lambda r: r["epoch"])
            lie = dict(honest, peer_id=dht.peer_id.to_bytes(), instance="liar", time=float(get_dht_time()),
                       epoch=honest["epoch"] + cfg.get("epochs_ahead", 0),
                       samples=cfg.get("samples", honest["samples"]),
                       samples_per_second=float(cfg.get("samples_per_second", honest["samples_per_second"])))
            if dht.store(key, subkey=subkey, value=lie, expiration_time=get_dht_time() + 6.0) and not told:
                open(cfg["out"], "w").close()
                told = True
        time.sleep(0.3)
    dht.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
    gc.freeze()  # skips the interpreter's final collection of torch's modules (~1 s at exit); nothing left needs it
