"""The version of what swarm_opt peers exchange (progress records, gathers, state downloads, recipe records), and
how peers of two versions meet: they never average together, and each side says so in one line that names the
swarm_opt to install.

``PROTOCOL`` is raised whenever a change would make peers of the previous release misread each other. It is mixed
into every peer's model schema (``swarm_opt.optimizer.model_schema``), which already keeps apart peers that must not
average (other shapes, strategy or recipe): peers of two protocols land in different averaging groups and drop each
other's progress records, so nothing they exchange is misread. Nothing new is added to a record: hivemind's schema
validator refuses a record whose fields an older peer does not know, which would hide the newer peers from it.

Each side names the version: a peer recognises the schema an older protocol gives its own model
(``Optimizer.legacy_schemas``) and says which release that is; the command line also publishes its protocol as a
recipe setting (``SETTING``), so that a volunteer of another version, older ones included, is refused before it
joins, in the recipe check's one line (``this run trains with swarm_opt="protocol 2; swarm_opt>=0.2.0"``).
"""

from __future__ import annotations

import re
from typing import Any, Optional

#: this release's protocol
PROTOCOL = 2
#: the first swarm_opt release that speaks each protocol (protocol 1: every release before protocols were named)
RELEASES = {1: "0.1.0", 2: "0.2.0"}
#: the recipe setting under which the command line publishes its protocol
SETTING = "swarm_opt"
_LABEL = re.compile(r"^protocol (\d+); swarm_opt>=([0-9][0-9A-Za-z.+-]{0,30})$")


def current() -> int:
    """This process's protocol (read at call time, so that a test peer can pretend to be an older release)."""
    return PROTOCOL


def label(protocol: Optional[int] = None) -> Optional[str]:
    """The recipe setting's value: ``protocol 2; swarm_opt>=0.2.0``; None for protocol 1, whose releases published
    none."""
    protocol = current() if protocol is None else protocol
    return f"protocol {protocol}; swarm_opt>={RELEASES[protocol]}" if protocol > 1 else None


def parse_label(value: Any) -> Optional[tuple]:
    """``(protocol, first release)`` of a published label; ``(1, "0.1.0")`` for a recipe without one (a release
    before protocols were named); None for anything else."""
    if value is None:
        return 1, RELEASES[1]
    match = _LABEL.match(value) if isinstance(value, str) else None
    return (int(match.group(1)), match.group(2)) if match else None


def to_install(protocol: int, first_release: Optional[str] = None) -> str:
    """The pip requirement that speaks ``protocol``: ``swarm_opt>=0.2.0,<0.3.0`` (``first_release`` for a
    protocol newer than this release knows)."""
    if protocol > current() or protocol not in RELEASES:
        return f"swarm_opt>={first_release or RELEASES[current()]}"
    upper = RELEASES.get(protocol + 1)
    return f"swarm_opt>={RELEASES[protocol]}" + (f",<{upper}" if upper else "")


def mismatch(theirs: int, first_release: Optional[str] = None) -> str:
    """One phrase: the protocol ``theirs`` of other peers, and what to install to train with them."""
    mine = current()
    age = "an older" if theirs < mine else "a newer"
    return (f"swarm_opt protocol {theirs}, {age} release: install '{to_install(theirs, first_release)}' to train "
            f"with them (this peer runs protocol {mine}, '{to_install(mine)}')")
