"""DHT record validators that remember their verdicts.

A DHT search re-validates every record of a key on every node it visits, and every node re-validates what it
stores: in a swarm, the same progress record (unchanged between two publications) is checked many times a second
(its RSA signature verified, its schema parsed), and that work competes with training for the peer's cores. A
validator's verdict is a function of the record's bytes and of the validator's own configuration, so each one here
keeps the verdicts of the records it saw last (a bounded memory, keyed by a digest of the whole record), and forgets
them when hivemind merges another validator's configuration into it (``CompositeValidator.extend``).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Iterable, Optional

from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.routing import DHTID
from hivemind.dht.schema import BytesWithPublicKey, SchemaValidator
from hivemind.dht.validation import DHTRecord, RecordValidatorBase

_REMEMBERED = 4096  # verdicts per validator: ~0.5 MB, far more records than a swarm's keys hold at once


def record_digest(record: DHTRecord) -> bytes:
    """A collision-resistant digest of everything a verdict depends on: key, subkey, value and expiration time."""
    digest = hashlib.blake2b(digest_size=16)
    for part in (record.key, record.subkey, record.value):
        if part is None:  # a record without a subkey, unlike one with an empty subkey
            digest.update(b"\xff" * 8)
        else:
            digest.update(len(part).to_bytes(8, "little"))
            digest.update(part)
    digest.update(repr(float(record.expiration_time)).encode())
    return digest.digest()


class Verdicts:
    """The last ``capacity`` verdicts, least recently used forgotten first."""

    def __init__(self, capacity: int = _REMEMBERED) -> None:
        self.capacity = capacity
        self._verdicts: OrderedDict[bytes, bool] = OrderedDict()

    def get(self, digest: bytes) -> Optional[bool]:
        verdict = self._verdicts.get(digest)
        if verdict is not None:
            self._verdicts.move_to_end(digest)
        return verdict

    def put(self, digest: bytes, verdict: bool) -> None:
        self._verdicts[digest] = verdict
        self._verdicts.move_to_end(digest)
        while len(self._verdicts) > self.capacity:
            self._verdicts.popitem(last=False)

    def clear(self) -> None:
        self._verdicts.clear()

    def __len__(self) -> int:
        return len(self._verdicts)


class _RemembersVerdicts(RecordValidatorBase):
    """Placed before a hivemind validator in the bases: its ``validate`` runs once per distinct record."""

    @property
    def verdicts(self) -> Verdicts:
        # created on first use: hivemind pickles validators to the DHT process, and SchemaValidator restores its
        # state without calling __init__
        verdicts = self.__dict__.get("_verdicts")
        if verdicts is None:
            verdicts = self.__dict__["_verdicts"] = Verdicts()
        return verdicts

    def validate(self, record: DHTRecord) -> bool:
        digest = record_digest(record)
        verdict = self.verdicts.get(digest)
        if verdict is None:
            verdict = bool(super().validate(record))
            self.verdicts.put(digest, verdict)
        return verdict

    def merge_with(self, other: RecordValidatorBase) -> bool:
        merged = super().merge_with(other)
        if merged:  # this validator's configuration may have changed, and with it any verdict
            self.verdicts.clear()
        return merged

    def __getstate__(self) -> dict:
        return {name: value for name, value in self.__dict__.items() if name != "_verdicts"}


class RememberingSchemaValidator(_RemembersVerdicts, SchemaValidator):
    """hivemind's ``SchemaValidator`` (pydantic), run once per distinct record."""


class RememberingSignatureValidator(_RemembersVerdicts, RSASignatureValidator):
    """hivemind's ``RSASignatureValidator``, each distinct record's signature verified once."""


#: the type of a schema's subkey that its owner signs (``[owner:<RSA public key>]``): a record schema's field is a
#: ``Dict[SignedSubkey, Optional[Record]]``
SignedSubkey = BytesWithPublicKey


class KeysSchemaValidator(RememberingSchemaValidator):
    """A schema whose ``field`` is also stored under the extra key names ``keys`` (a run's shard keys): hivemind's
    validator sees a key only as the hash of its name, so every name it should recognise is hashed here, once."""

    def __init__(self, schema: type, *, prefix: str, field: str, keys: Iterable[str]) -> None:
        super().__init__(schema, prefix=prefix)
        self._key_id_to_field_name.update({DHTID.generate(source=key).to_bytes(): field for key in keys})
