"""Everything that subclasses or drives hivemind's internals: the averager process's engine and its host side, their
all-reduce runner and reducers, PowerSGD's two-phase engine, the DHT process and its start-up, DHT record
validation, fork helpers and hivemind's logging.

The rest of swarm_opt sees hivemind through its public objects (``PUBLIC``: ``hivemind.DHT``, ``PeerID``,
``get_dht_time``, ``CompressionBase`` for the codecs...), with the exceptions listed in ``REACHED_FROM_OUTSIDE``: a
hivemind upgrade touches this package and checks those (``tests/unit/test_import_graph.py`` keeps the list true).
What a round averages and what it returns (``swarm_opt.buffers``) does not depend on how the bytes travel. The traps
these modules work around are described in ``docs/hivemind.md``.
"""

from typing import Dict, Tuple

#: hivemind's modules whose public objects the rest of swarm_opt may import
PUBLIC: Tuple[str, ...] = ("hivemind", "hivemind.dht", "hivemind.p2p", "hivemind.utils", "hivemind.compression")

#: the modules outside this package that reach into hivemind beyond ``PUBLIC``, and what for
REACHED_FROM_OUTSIDE: Dict[str, str] = {
    "swarm_opt.compression.codecs": "the codecs' wire format (hivemind.proto.runtime_pb2) and the process-wide "
                                    "codec table they install a slot in (serialization._BASE_COMPRESSION_TYPES): "
                                    "codecs sit below the transport, so this cannot move here",
    "swarm_opt.auth": "a private run's authorizer (hivemind.utils.auth, hivemind.proto.auth_pb2), RSA keys "
                      "(hivemind.utils.crypto) and hivemind.proto.crypto_pb2",
    "swarm_opt.cli.doctor": "hivemind.proto.dht_pb2 and hivemind.utils.multiaddr, to ask a DHT node directly",
}
