"""Private runs: only peers holding the run's credentials take part.

Built on hivemind's own authorization hooks (``hivemind.utils.auth``): every DHT request and response carries an
access token and an RSA signature over the message, a nonce and a time (so messages cannot be replayed or forged).
hivemind's token scheme needs an authority server; here the token is vouched for by the run's credentials instead:

* a **run secret** shared by the run's peers: the token carries an HMAC of the peer's public key under a key derived
  from the secret, so a peer without the secret can neither read nor write the run's DHT records;
* and/or an **allowlist** of libp2p peer ids: the token's key must be the peer's persistent identity (the file of
  ``identity_path``), whose peer id must be listed.

Averaging and state sharing are closed too: matchmaking happens through the gated DHT, a leader refuses followers
whose schema hash lacks the run's tag (derived from the secret), and a donor serves its state only to peers that
wrote through the gated DHT: a progress record, or the announcement a peer makes before it asks for a state (a
newcomer publishes no record until it joined).

What remains visible: libp2p encrypts every connection (Noise/TLS), so an eavesdropper sees who talks to whom and
how much, not what. A holder of the secret can do anything a peer can (the secret is the run's only key: rotate it
by restarting the run with a new one); an allowlisted peer likewise, until it is removed from every peer's list.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import threading
import time
from pathlib import Path
from typing import Dict, FrozenSet, Iterable, Optional

from hivemind.p2p import PeerID
from hivemind.proto import crypto_pb2
from hivemind.proto.auth_pb2 import AccessToken
from hivemind.utils.auth import TokenAuthorizerBase
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey

from swarm_opt.errors import ConfigError, ConfigTypeError

logger = logging.getLogger(__name__)

_MIN_SECRET_BYTES = 16
_REFUSAL_LOG_PERIOD = 60.0  # seconds between two log lines about the same refused peer
_SHA256_MULTIHASH = bytes([0x12, 0x20])  # a multihash prefix: sha2-256, 32 bytes
_MEMBERS_REFRESH = 2.0  # seconds between two reads of a private run's members by a donor
_ANNOUNCEMENT_TTL = 60.0  # seconds a downloader's announcement stays on the DHT (made again at every download)
_MAX_PEER_ID_BYTES = 64


class PrivateRun:
    """The credentials of a private run. Pass ``authorizer()`` to ``hivemind.DHT(authorizer=...)`` on every peer.

    :param secret: the run's shared secret (at least 16 bytes; e.g. ``openssl rand -hex 32 > run.secret``).
    :param allowed_peers: libp2p peer ids (as ``swarm-opt dht`` prints them) allowed in the run; needs
        ``identity_path``, the file of this peer's own persistent identity.
    :param identity_path: this peer's identity file (``hivemind.DHT(identity_path=...)``); its key signs our
        requests, so that allowlisted peers recognise us.
    """

    def __init__(self, *, secret: Optional[bytes] = None, allowed_peers: Optional[Iterable[str]] = None,
                 identity_path: Optional[str] = None) -> None:
        if secret is None and allowed_peers is None:
            raise ConfigError("a private run needs a run secret, an allowlist of peer ids, or both")
        if secret is not None:
            if not isinstance(secret, bytes):
                raise ConfigTypeError("secret must be bytes, e.g. Path('run.secret').read_bytes()")
            if len(secret.strip()) < _MIN_SECRET_BYTES:
                raise ConfigError(f"the run secret is too short (under {_MIN_SECRET_BYTES} bytes); make one with "
                                  f"`openssl rand -hex 32 > run.secret`")
        self._key = None if secret is None else hashlib.sha256(b"swarm_opt run secret\0" + secret.strip()).digest()
        self.allowed_peers: Optional[FrozenSet[bytes]] = None
        if allowed_peers is not None:
            if identity_path is None:
                raise ConfigError("an allowlist names peers by their persistent identity: pass identity_path (the "
                                  "--identity-path of this peer) too, and list its peer id on the other peers")
            self.allowed_peers = frozenset(_parse_peer_id(p) for p in allowed_peers)
        self.identity_path = identity_path

    @classmethod
    def from_files(cls, *, secret_file: Optional[str] = None, allow_peers_file: Optional[str] = None,
                   identity_path: Optional[str] = None) -> PrivateRun:
        """Read the secret (whole file) and the allowlist (one peer id per line, ``#`` comments) from files."""
        secret = None if secret_file is None else _read(secret_file, "run secret file")
        allowed = None
        if allow_peers_file is not None:
            lines = _read(allow_peers_file, "allowlist file").decode(errors="replace").splitlines()
            allowed = [line.split("#")[0].strip() for line in lines if line.split("#")[0].strip()]
        return cls(secret=secret, allowed_peers=allowed, identity_path=identity_path)

    @property
    def averaging_tag(self) -> bytes:
        """Mixed into the averagers' schema hash, so that a leader refuses followers without the run's secret."""
        return b"" if self._key is None else hmac.new(self._key, b"averaging", hashlib.sha256).digest()

    def authorizer(self) -> RunAuthorizer:
        return RunAuthorizer(self)

    def __repr__(self) -> str:  # never the secret
        allowed = "none" if self.allowed_peers is None else f"{len(self.allowed_peers)} peer(s)"
        return f"PrivateRun(secret={'set' if self._key else 'none'}, allowlist={allowed})"

    def mac(self, public_key: bytes) -> bytes:
        return b"" if self._key is None else hmac.new(self._key, b"token\0" + public_key, hashlib.sha256).digest()


class RunAuthorizer(TokenAuthorizerBase):
    """hivemind's token authorizer with the run's credentials as the authority (see the module docstring). Refused
    peers are logged at WARNING, once a minute each; ``refusals`` counts responses we refused (a peer answering
    without the run's credentials: we hold the wrong secret, or it does)."""

    def __init__(self, run: PrivateRun) -> None:
        super().__init__(_identity_key(run.identity_path) if run.identity_path else RSAPrivateKey())
        self.run = run
        self.refusals = 0
        self._peer_ids: Dict[bytes, Optional[bytes]] = {}
        self._logged: Dict[bytes, float] = {}
        self._lock = threading.Lock()

    def __reduce__(self):  # hivemind pickles the DHT's arguments into its process: rebuild from the credentials
        return RunAuthorizer, (self.run,)

    async def get_token(self) -> AccessToken:
        public_key = self.local_public_key.to_bytes()
        return AccessToken(username="swarm_opt", public_key=public_key, expiration_time="never",
                           signature=self.run.mac(public_key))

    def is_token_valid(self, access_token: AccessToken) -> bool:
        public_key = access_token.public_key
        if not hmac.compare_digest(access_token.signature, self.run.mac(public_key)):
            return False
        return self.run.allowed_peers is None or self._peer_id(public_key) in self.run.allowed_peers

    def does_token_need_refreshing(self, access_token: AccessToken) -> bool:
        return False

    async def validate_request(self, request) -> bool:
        valid = await super().validate_request(request)
        if not valid:
            self._log_refusal(request.auth.client_access_token.public_key, "a request")
        return valid

    async def validate_response(self, response, request) -> bool:
        valid = await super().validate_response(response, request)
        if not valid:
            self.refusals += 1
            self._log_refusal(response.auth.service_access_token.public_key, "an answer")
        return valid

    def _peer_id(self, public_key: bytes) -> Optional[bytes]:
        with self._lock:
            if public_key not in self._peer_ids:
                self._peer_ids[public_key] = _peer_id_of(public_key)
            return self._peer_ids[public_key]

    def _log_refusal(self, public_key: bytes, what: str) -> None:
        now = time.monotonic()
        with self._lock:
            if now - self._logged.get(public_key, -_REFUSAL_LOG_PERIOD) < _REFUSAL_LOG_PERIOD:
                return
            self._logged[public_key] = now
        peer = self._peer_id(public_key) if public_key else None
        who = f"a peer with other credentials (key id {PeerID(peer)})" if peer else "a peer without credentials"
        logger.warning(f"Refused {what} from {who}: it does not hold this private run's credentials")


def _identity_key(identity_path: str) -> RSAPrivateKey:
    """The RSA key of a hivemind identity file (the libp2p key of ``hivemind.DHT(identity_path=...)``)."""
    data = _read(identity_path, "identity file")
    try:
        key = RSAPrivateKey.__new__(RSAPrivateKey)
        key.__setstate__({"_private_key": crypto_pb2.PrivateKey.FromString(data).data})
        return key
    except Exception:
        raise ConfigError(f"'{identity_path}' is not a hivemind identity file; remove it to generate a new "
                          f"one") from None


def _peer_id_of(public_key: bytes) -> Optional[bytes]:
    """The libp2p peer id of an RSA public key as hivemind's tokens carry it (OpenSSH format); None if malformed."""
    from cryptography.hazmat.primitives import serialization

    try:
        der = RSAPublicKey.from_bytes(public_key)._public_key.public_bytes(
            encoding=serialization.Encoding.DER, format=serialization.PublicFormat.SubjectPublicKeyInfo)
    except Exception:  # a stranger's token may hold anything
        return None
    encoded = crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=der).SerializeToString()
    return _SHA256_MULTIHASH + hashlib.sha256(encoded).digest()


def _parse_peer_id(value: str) -> bytes:
    try:
        peer_id = PeerID.from_base58(value).to_bytes()
    except Exception:
        peer_id = b""
    if len(peer_id) != 34 or not peer_id.startswith(_SHA256_MULTIHASH):  # the ids of hivemind's RSA identities
        raise ConfigError(f"'{value}' in the allowlist is not a peer id; copy the id that `swarm-opt dht` prints "
                          f"(e.g. QmXyz...)")
    return peer_id


def _read(path: str, what: str) -> bytes:
    try:
        return Path(path).expanduser().read_bytes()
    except OSError as e:
        raise ConfigError(f"cannot read the {what} '{path}': {e.strerror or e}") from None


class RunAccess:
    """What a private run's averager checks: its schema hash carries the run's tag (a leader refuses followers
    without it), and it serves its state only to peers that wrote through the gated DHT (a progress record, or an
    announcement made before downloading): only holders of the run's credentials can."""

    def __init__(self, run: PrivateRun, run_id: str) -> None:
        from swarm_opt.sharding import progress_key

        self.run = run
        self.records_key, self.announcements_key = progress_key(run_id), f"{run_id}_downloaders"
        self._members: FrozenSet[bytes] = frozenset()
        self._members_read = -float("inf")
        self._logged: Dict[bytes, float] = {}

    def schema_hash(self, schema_hash: bytes) -> bytes:
        return hashlib.sha256(self.run.averaging_tag + schema_hash).digest() if self.run.averaging_tag \
            else schema_hash

    async def announce(self, dht, peer: PeerID) -> None:
        """Before asking donors for their state (in the averager process): a newcomer has no progress record yet."""
        from hivemind.utils import get_dht_time

        await dht.store(self.announcements_key, subkey=peer.to_bytes(), value=True,
                        expiration_time=get_dht_time() + _ANNOUNCEMENT_TTL, return_future=True)

    async def admits(self, dht, peer: PeerID) -> bool:
        """Runs in the averager process; two DHT reads every few seconds at most."""
        from hivemind.utils import get_dht_time

        from swarm_opt.progress import parse_records

        peer_id = peer.to_bytes()
        if peer_id not in self._members and time.monotonic() - self._members_read > _MEMBERS_REFRESH:
            raw = await dht.get(self.records_key, latest=True, return_future=True)
            records, _ = parse_records(raw, model_schema=None, now=get_dht_time())
            announced = await dht.get(self.announcements_key, latest=True, return_future=True)
            self._members = frozenset(r.peer_id for r in records) | _announced(announced)
            self._members_read = time.monotonic()
        if peer_id in self._members:
            return True
        now = time.monotonic()
        if now - self._logged.get(peer_id, -_REFUSAL_LOG_PERIOD) >= _REFUSAL_LOG_PERIOD:
            self._logged[peer_id] = now
            logger.warning(f"Refused to send our state to peer {peer}: it is not a member of this private run")
        return False


def _announced(raw: object) -> FrozenSet[bytes]:
    """The peer ids announced under a private run's downloaders key (network input: anything else is dropped)."""
    entries = getattr(raw, "value", None)
    if not isinstance(entries, dict):
        return frozenset()
    return frozenset(key for key in entries if isinstance(key, bytes) and 0 < len(key) <= _MAX_PEER_ID_BYTES)


def run_access(dht, run_id: str) -> Optional[RunAccess]:
    """The averager checks of a private run, if ``dht`` was started with ``PrivateRun.authorizer()``."""
    authorizer = getattr(dht, "kwargs", {}).get("authorizer")
    return RunAccess(authorizer.run, run_id) if isinstance(authorizer, RunAuthorizer) else None
