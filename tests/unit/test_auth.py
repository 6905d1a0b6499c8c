"""Private-run credentials (swarm_opt.auth): validation, tokens, and DHTs that refuse strangers."""

from __future__ import annotations

import asyncio

import pytest
from hivemind.p2p import P2P, PeerID

from swarm_opt import ConfigError, PrivateRun
from swarm_opt.auth import RunAuthorizer, _peer_id_of

SECRET = b"0123456789abcdef0123456789abcdef"


def token_of(authorizer: RunAuthorizer):
    return asyncio.run(authorizer.get_token())


def test_credentials_are_checked_and_the_secret_never_shows(tmp_path):
    with pytest.raises(ConfigError, match="openssl rand"):
        PrivateRun(secret=b"short")
    with pytest.raises(ConfigError, match="needs a run secret, an allowlist"):
        PrivateRun()
    with pytest.raises(ConfigError, match="pass identity_path"):
        PrivateRun(allowed_peers=[])
    with pytest.raises(ConfigError, match="not a peer id"):
        PrivateRun(allowed_peers=["nope"], identity_path=str(tmp_path / "id"))
    with pytest.raises(ConfigError, match="cannot read the run secret file"):
        PrivateRun.from_files(secret_file=str(tmp_path / "missing"))
    run = PrivateRun(secret=SECRET)
    assert SECRET.decode() not in repr(run) and "secret=set" in repr(run)


def test_tokens_hold_only_under_the_same_secret():
    ours, same, other = (PrivateRun(secret=s).authorizer() for s in (SECRET, SECRET, SECRET[::-1]))
    assert ours.is_token_valid(token_of(same)) and same.is_token_valid(token_of(ours))
    assert not ours.is_token_valid(token_of(other))
    forged = token_of(other)
    forged.signature = token_of(same).signature  # a valid MAC belongs to one key only
    assert not ours.is_token_valid(forged)


def test_an_allowlist_names_persistent_identities(tmp_path):
    paths = [str(tmp_path / f"id{i}") for i in range(3)]
    for path in paths:
        P2P.generate_identity(path)
    ids = [PeerID.from_identity(open(p, "rb").read()) for p in paths]
    allowed = [ids[0].to_base58(), ids[1].to_base58()]
    a, b, c = (PrivateRun(secret=SECRET, allowed_peers=allowed, identity_path=p).authorizer() for p in paths)
    assert _peer_id_of(a.local_public_key.to_bytes()) == ids[0].to_bytes()  # the token's key is the peer's id
    assert a.is_token_valid(token_of(b)) and b.is_token_valid(token_of(a))
    assert not a.is_token_valid(token_of(c))  # holds the secret, but is not on the list
    file = tmp_path / "allowed.txt"
    file.write_text(f"# lab machines\n{allowed[0]}  # gpu box\n\n{allowed[1]}\n")
    run = PrivateRun.from_files(allow_peers_file=str(file), identity_path=paths[0])
    assert run.allowed_peers == {ids[0].to_bytes(), ids[1].to_bytes()}


def test_a_donor_reads_announced_downloaders_as_network_input():
    """The downloaders key of a private run may hold anything a member wrote: only peer-id-sized bytes count."""
    from hivemind.utils import ValueWithExpiration

    from swarm_opt.auth import _announced

    peer = PeerID.from_base58("QmNMP3fU2cE6G3CFUAHhgGi4Qmu2ZyUrEx8p8QAjchVpvj").to_bytes()
    entries = {peer: ValueWithExpiration(True, 1.0), "text": ValueWithExpiration(True, 1.0),
               b"": ValueWithExpiration(True, 1.0), b"x" * 65: ValueWithExpiration(True, 1.0)}
    assert _announced(ValueWithExpiration(entries, 1.0)) == {peer}
    for raw in (None, ValueWithExpiration(b"not a dict", 1.0), ValueWithExpiration([peer], 1.0), "garbage"):
        assert _announced(raw) == frozenset()
