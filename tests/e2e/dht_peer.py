"""A DHT peer for the partition tests, run on a test host: every second it publishes its own key and reads the
others', as a training peer's tracker does, and prints one line of what it sees.

    python tests/e2e/dht_peer.py INDEX PEERS HOST_MADDR [--initial-peers MADDR ...] [--identity-path FILE] [--no-watch]

Lines: ``address MADDR`` once started, then ``seen t=SECONDS table=N peers=I,J,...``: the routing table's size and
the indices whose fresh values it read.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("index", type=int)
    parser.add_argument("peers", type=int)
    parser.add_argument("host_maddr")
    parser.add_argument("--initial-peers", nargs="*", default=[])
    parser.add_argument("--identity-path")
    parser.add_argument("--no-watch", action="store_true", help="plain hivemind: no re-bootstrapping watcher")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(asctime)s %(name)s %(message)s")
    for name in ("hivemind", "swarm_opt.hivemind"):
        logging.getLogger(name).setLevel(logging.ERROR)

    import hivemind
    from hivemind.utils import get_dht_time

    kwargs = dict(initial_peers=args.initial_peers, host_maddrs=[args.host_maddr], start=True)
    if args.identity_path:
        kwargs["identity_path"] = args.identity_path
    if args.no_watch:
        dht = hivemind.DHT(**kwargs)
    else:
        from swarm_opt._hivemind.node import start_dht

        dht = start_dht(initial_peers=args.initial_peers, host_maddrs=[args.host_maddr],
                        identity_path=args.identity_path)
    for maddr in dht.get_visible_maddrs():
        print(f"address {maddr}", flush=True)
    start = time.monotonic()
    while dht.is_alive():
        dht.store(f"partition_test_{args.index}", time.time(), expiration_time=get_dht_time() + 6)
        seen = []
        for j in range(args.peers):
            found = dht.get(f"partition_test_{j}", latest=True)
            if found is not None and time.time() - found.value < 5:
                seen.append(j)
        table = dht.run_coroutine(_table_size)
        print(f"seen t={time.monotonic() - start:.1f} table={table} peers={','.join(map(str, seen))}", flush=True)
        time.sleep(1.0)


async def _table_size(dht, node) -> int:
    return len(node.protocol.routing_table.uid_to_peer_id)


if __name__ == "__main__":
    main()
