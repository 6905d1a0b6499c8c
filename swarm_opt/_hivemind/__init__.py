"""Everything that subclasses or drives hivemind's internals: the averager and its all-reduce runner and reducers,
PowerSGD's two-phase engine, the DHT process and its start-up, fork helpers and hivemind's logging.

A hivemind upgrade should touch this package only. The rest of swarm_opt sees hivemind through public objects
(``hivemind.DHT``, ``PeerID``, signed DHT records, ``CompressionBase`` for the codecs); what a round averages and
what it returns (``swarm_opt.buffers``) does not depend on how the bytes travel. The traps these modules work around
are described in ``docs/hivemind.md``.
"""
