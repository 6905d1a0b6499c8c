"""The gather message: what each member of an averaging group sends its groupmates as the group forms.

hivemind's matchmaking carries one opaque ``gather`` blob per member and hands every member the blobs of all (the
round's result, ``AveragingResult.gathered``). swarm_opt's blob is a dict with the entries below; every key is
spelled here once. A groupmate is not trusted: a blob that is not a dict reads as ``{}`` (``member_info``), and each
reader checks the type and bounds of the entries it uses.

Written by ``TensorAverager.schedule`` (host process), for every round:

* ``ROUND_KEY`` (int): the round the member is in (the epoch it completes); a group that mixes rounds is discarded;
* ``STEP_PERIOD_KEY`` (float seconds): the member's time between steps; groupmates wait about twice that for it to
  start sending;
* ``DUE_KEY`` (float, DHT time): when the member expected the round to be due;
* ``AUX_KEY`` (bool): an auxiliary peer (it reduces, sends nothing, counts in no majority);
* ``AGGREGATION_KEY`` (str): the ``repr`` of the member's aggregation: a group that mixes them discards its round;
* ``CELL_KEY`` (str of '0'/'1'): the round's line of the Moshpit averaging grid (its matchmaking key);
* ``LANE_KEY`` (str, "host:port"): the member's gloo lane address, if it offers the lane.
* ``DEADLINE_KEY`` (float seconds): this round's averaging deadline (``swarm_opt.deadlines``), read by the
  member's own averager process (its all-reduce timeouts), not by the groupmates.

Written by the optimizer (``Optimizer._member_info``), for every round:

* ``PEERS_KEY`` / ``BOUND_KEY`` (int): the live peers the member saw, and its upper bound on them (majorities);
* ``COUNTED_KEY`` (int): the live peers a member counted, having read every progress record (not a sample);
* ``DIGEST_KEY``: a digest of the member's parameters (strategies that share parameters, ``swarm_opt.digest``).

Told to the group by the averager process as the group forms (``_Engine._tell_group``):

* ``LINE_KEY`` (int): the peers a leader found declared this round under its line's matchmaking key (Moshpit grid);
* ``DISTRUSTS_KEY`` (list of str): the senders this member's reducer distrusts (``Reputation``);
* ``POWERSGD_KEY`` (list): PowerSGD's tag (attempt, rank, seed, Q lineage; ``swarm_opt._hivemind.powersgd_engine``).
"""

from __future__ import annotations

from typing import Any

ROUND_KEY = "round"
STEP_PERIOD_KEY = "step_period"
DUE_KEY = "due"
AUX_KEY = "aux"
AGGREGATION_KEY = "aggregation"
CELL_KEY = "cell"
LANE_KEY = "lane"
DEADLINE_KEY = "deadline"
PEERS_KEY = "peers"
BOUND_KEY = "bound"
COUNTED_KEY = "counted"
DIGEST_KEY = "digest"
LINE_KEY = "line"
DISTRUSTS_KEY = "distrusts"
POWERSGD_KEY = "powersgd"


def member_info(serializer: Any, data: bytes) -> dict:
    """What a member sent along in the matchmaking gather ({} if it is not a dict: a peer we do not trust)."""
    try:
        info = serializer.loads(serializer.loads(data)[2])
    except Exception:
        return {}
    return info if isinstance(info, dict) else {}


def rounds_differ(serializer: Any, gather: bytes, control: Any) -> bool:
    """Whether a follower's gather names another round than this leader's step ``control`` (``None``: not looking).
    Helpers are never refused (their round does not matter), nor members that name no round (the check after the
    all-reduce decides)."""
    if control is None:
        return False
    theirs, ours = member_info(serializer, gather), member_info(serializer, control.data_for_gather)
    rounds = [info.get(ROUND_KEY) for info in (theirs, ours)]
    return (not (theirs.get(AUX_KEY) or ours.get(AUX_KEY)) and all(type(r) is int for r in rounds)
            and rounds[0] != rounds[1])


def valid_cell(cell: Any) -> bool:
    """Whether ``cell`` (a groupmate's ``CELL_KEY``) names a line of the grid: a bounded string of '0' and '1'."""
    return isinstance(cell, str) and len(cell) <= 256 and all(bit in "01" for bit in cell)
