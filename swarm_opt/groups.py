"""Moshpit group averaging (Ryabinin et al., 2021, "Moshpit SGD"): which peers average together in a round.

The live peers sit on a virtual grid of ``dims`` dimensions of ``side`` cells each (``grid_shape``: the fewest
dimensions of at most ``Groups.size`` cells that hold the swarm, and the smallest side that does). Round ``t``
averages along dimension ``t mod dims``: peers that share every other coordinate (a *line* of the grid) look for
each other under one matchmaking key (``RoundPlan.cell``, hivemind's group bits: the dimension, then the line), in
groups of at most ``size``.
On a complete grid (``side ** dims`` peers, one per cell) ``dims`` consecutive rounds give every peer the exact
mean of the swarm: after the round along dimension 0 every line holds its own mean, after the round along
dimension 1 every plane holds the mean of its lines, and so on. A peer that knows every live peer takes the cell of
its rank among them (``ranked_coords``): lines then hold equal numbers of peers. Otherwise peers sit at random
coordinates (from their peer id); after a committed round the members of a group take distinct random coordinates
along the round's dimension (drawn alike by every member from the round and the members), so that they land in
different lines next round (hivemind's ``GroupKeyManager.update_key_on_group_assembled`` does the same with its key
bits); a peer whose round failed (its line was short of peers) draws a new coordinate on its own, so that no peer
stays stuck in a line that the others left.

One code path for every swarm size: a swarm of at most ``size`` peers (or ``groups=None``) is a grid of one
dimension, one line, the empty key: every peer in one group, as without groups.

**Commit rule.** Without groups a round commits only in a group holding a strict majority of the live peers, so
that at most one version of each epoch exists. With groups every line of the grid averages on its own, by design,
so the swarm holds one version per *line* and epoch, and the rule becomes: a group commits if it holds a strict
majority of the peers its line is expected to hold (``cell_peers``: the live peers divided by the lines of the
round's grid). Two disjoint groups of one line can then not both commit while the line holds no more than its expected
share, and with one line (a small swarm) it is exactly the old rule. Random coordinates fill lines unevenly (a line
holds a binomial number of peers), and a line short of its share could never commit: so a group's leader counts the
peers declared under the line's matchmaking key this round, and a group needs a majority of that count where it is
lower (``line_peers``). Leaders that count the same declarations still let at most one group per line commit.
Every member computes the rule from the same count of live peers (``swarm_opt.round.swarm_size_seen_by``) and the
same leader's count (both travel in the matchmaking gather), so a group commits on all its members or on none.
Only strategies whose rounds average the parameters themselves accept groups (``Strategy.use_groups``;
``GradientAveraging``'s rounds carry them in groups): peers of different lines hold different parameters until the
next rounds mix them.
"""

from __future__ import annotations

import hashlib
import math
import random
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, Tuple

_MAX_DIMS = 32  # coordinates a peer keeps: a grid of sides >= 2 with more dimensions would hold 4e9 peers
_COORDINATE_RANGE = 2**16  # coordinates are kept modulo each round's side


def grid_shape(num_peers: int, size: Optional[int]) -> Tuple[int, int]:
    """``(dims, side)``: the fewest dimensions of at most ``size`` cells whose grid holds ``num_peers``, and the
    smallest side that does (so that lines hold about ``side`` peers, not fewer). ``size=None``: one dimension of
    ``num_peers`` cells (everyone in one group)."""
    n = max(1, int(num_peers))
    if size is None or n <= size:
        return 1, n
    dims = 1
    while size ** dims < n:
        dims += 1
    side = max(2, math.ceil(n ** (1.0 / dims)))
    while side ** dims < n:  # float roots err on either side
        side += 1
    while side > 2 and (side - 1) ** dims >= n:
        side -= 1
    return dims, side


@dataclass(frozen=True)
class RoundPlan:
    """Where a peer averages in one round: along grid dimension ``dimension`` of ``dims``, in the line named by
    ``cell`` (hivemind's group bits: '' for the one line of a small swarm)."""

    dimension: int = 0
    dims: int = 1
    side: int = 1
    cell: str = ""

    @property
    def whole_swarm(self) -> bool:
        """The round averages in one line holding every live peer (a one-dimensional grid: no partial groups)."""
        return self.dims == 1


def cell_peers(num_peers: int, plan: RoundPlan) -> int:
    """How many peers the line of ``plan`` is expected to hold in a swarm of ``num_peers``: the live peers over the
    grid's lines. On the plan's grid, not on one drawn again for ``num_peers``: a count above the plan's grows the
    line (a finer grid would shorten it, and lower the majority a group needs)."""
    return max(1, math.ceil(max(1, num_peers) / plan.side ** (plan.dims - 1)))


def line_peers(num_peers: int, plan: RoundPlan, declared: Optional[int] = None, group_size: int = 1) -> int:
    """How many peers a group of ``plan``'s round must hold a strict majority of to commit: every live peer without
    groups; on the grid, the peers its line is expected to hold (``cell_peers``), or fewer if the group's leader
    found fewer declared under the line's key this round (``declared``; never below the group itself)."""
    expected = cell_peers(num_peers, plan)
    if plan.whole_swarm or declared is None:
        return expected
    return min(expected, max(declared, group_size))


#: the plan of a swarm averaged in one group (no grid)
ONE_GROUP = RoundPlan()


class Grid:
    """One peer's coordinates on the averaging grid (``size`` the most peers in a group; ``None``: one group).

    :param seed: where the peer starts (its peer id): peers draw their coordinates independently.
    :param live_peers: the ids of the live peers, this one included, where this peer knows them all (None where its
        view is a sample): every peer then takes the cell of its rank among them (``ranked_coords``), so that lines
        hold equal numbers of peers; the random coordinates serve the other rounds.
    """

    def __init__(self, size: Optional[int], seed: Any,
                 live_peers: Callable[[], Optional[Sequence[Any]]] = lambda: None) -> None:
        self.size = size
        self._seed = _digest(seed)
        self._live_peers = live_peers
        rng = random.Random(self._seed)
        self.coords = [rng.randrange(_COORDINATE_RANGE) for _ in range(_MAX_DIMS)]
        self._planned: Optional[Tuple[int, RoundPlan]] = None

    def plan(self, round_id: int, num_peers: int) -> RoundPlan:
        """Where this peer averages in round ``round_id`` of a swarm of ``num_peers`` live peers. The first plan of
        a round holds until the round is over (matchmaking, which starts ahead of the round, and the strategy's round
        must agree, whatever the count of live peers meanwhile)."""
        if self._planned is not None and self._planned[0] == round_id:
            return self._planned[1]
        plan = self._plan(round_id, num_peers)
        self._planned = (round_id, plan)
        return plan

    def _plan(self, round_id: int, num_peers: int) -> RoundPlan:
        dims, side = grid_shape(num_peers, self.size)
        if dims == 1:
            return RoundPlan(0, 1, side, "")
        dimension = round_id % dims
        coords = ranked_coords(self._seed, self._live_peers(), round_id, dims, side) or self.coords
        cell = 0
        for j in range(dims):
            if j != dimension:
                cell = cell * side + coords[j] % side
        # the dimension leads the key: a peer a round behind (along another dimension) never meets this round's line
        width, dimension_width = (side ** (dims - 1) - 1).bit_length(), (dims - 1).bit_length()
        return RoundPlan(dimension, dims, side, format(dimension, f"0{dimension_width}b") + format(cell, f"0{width}b"))

    def moved(self, plan: RoundPlan, peers: Sequence[Any], me: Any, round_id: int) -> None:
        """After a committed round in group ``peers``: take distinct coordinates along the round's dimension, the
        same draw on every member (seeded by the round and the members)."""
        if plan.dims == 1 or me not in peers:
            return
        salt = round_id.to_bytes(8, "little", signed=True)
        order = sorted(peers, key=lambda peer: hashlib.sha256(salt + _digest(peer)).digest())
        draw = random.Random(hashlib.sha256(salt + b"".join(_digest(peer) for peer in order)).digest())
        slots = draw.sample(range(max(plan.side, len(order))), len(order))
        self.coords[plan.dimension] = slots[order.index(me)]
        self._planned = None

    def missed(self, plan: RoundPlan, round_id: int) -> None:
        """After a failed round: a new random coordinate along the round's dimension (a new line next round)."""
        if plan.dims == 1:
            return
        draw = random.Random(hashlib.sha256(round_id.to_bytes(8, "little", signed=True) + self._seed).digest())
        self.coords[plan.dimension] = draw.randrange(_COORDINATE_RANGE)
        self._planned = None


def ranked_coords(me: bytes, peers: Optional[Sequence[Any]], round_id: int, dims: int, side: int
                  ) -> Optional[Sequence[int]]:
    """This peer's coordinates (``me``: the digest of its id) from its rank among ``peers``, ordered by a hash of
    their ids and of the block of ``dims`` rounds that ``round_id`` belongs to: the digits of the rank in base
    ``side``. Peers with the same view take distinct cells, filled in order, so that the lines of every round hold
    equal numbers of peers (random coordinates fill them binomially: in a swarm of 4 on a 2 x 2 grid, a line of one
    peer, which finds no group, every other round), and a complete grid gives the exact mean after the ``dims``
    rounds of each block. A new order each block, so that the same peers do not always meet. None where the view is
    unknown or does not hold this peer."""
    if not peers:
        return None
    digests = {_digest(peer) for peer in peers}
    if me not in digests:
        return None
    salt = (round_id // dims).to_bytes(8, "little", signed=True)
    order = sorted(digests, key=lambda digest: hashlib.sha256(salt + digest).digest())
    rank = order.index(me) % side ** dims
    return [(rank // side ** j) % side for j in range(dims)]


def _digest(value: Any) -> bytes:
    """Stable bytes of a peer id (hivemind's ``PeerID``), bytes, or anything with a stable ``repr``."""
    if hasattr(value, "to_bytes") and not isinstance(value, int):
        value = value.to_bytes()
    if not isinstance(value, bytes):
        value = repr(value).encode()
    return hashlib.sha256(value).digest()
