"""DHT validators that remember their verdicts (``swarm_opt._hivemind.validation``): each distinct record is
checked once, a changed byte is checked again, and a merged configuration forgets what was decided before."""

from __future__ import annotations

import dataclasses
import pickle

from hivemind.dht.routing import DHTID
from hivemind.dht.validation import CompositeValidator, DHTRecord
from hivemind.utils import MSGPackSerializer, get_dht_time
from hivemind.utils.crypto import RSAPrivateKey

from swarm_opt._hivemind.validation import RememberingSignatureValidator, Verdicts, record_digest
from swarm_opt.progress import ProgressRecord, _ShardedSchemaValidator, progress_key, progress_validators


def signed_record(run_id: str, validators, samples: int = 10) -> DHTRecord:
    signer = CompositeValidator(validators)
    record = ProgressRecord(peer_id=b"p" * 34, instance="0123456789abcdef", epoch=1, samples=samples,
                            samples_per_second=5.0, time=get_dht_time(), client_mode=False, model_schema="m",
                            target_batch_size=100)
    raw = DHTRecord(key=DHTID.generate(source=progress_key(run_id)).to_bytes(),
                    subkey=MSGPackSerializer.dumps(validators[-1].local_public_key + b"/0123456789abcdef"),
                    value=MSGPackSerializer.dumps(record.dict()), expiration_time=get_dht_time() + 10)
    return dataclasses.replace(raw, value=signer.sign_value(raw))


def test_a_signature_is_verified_once_per_distinct_record_and_a_forgery_stays_rejected(monkeypatch):
    validators = progress_validators("memo")
    composite = CompositeValidator(validators)
    record = signed_record("memo", validators)
    checked = []
    verify = type(RSAPrivateKey().get_public_key()).verify
    monkeypatch.setattr(type(RSAPrivateKey().get_public_key()), "verify",
                        lambda self, data, signature: checked.append(1) or verify(self, data, signature))
    assert all(composite.validate(record) for _ in range(5))
    assert len(checked) == 1
    forged = dataclasses.replace(record, value=record.value.replace(b"\x0a", b"\x0b", 1))  # one byte changed
    assert forged.value != record.value
    assert not composite.validate(forged) and not composite.validate(forged)
    assert len(checked) == 2
    later = dataclasses.replace(record, expiration_time=record.expiration_time + 1)  # signed for another expiry
    assert not composite.validate(later)
    assert len(checked) == 3


def test_a_merged_schema_forgets_the_verdicts_given_before_it():
    """A schema validator allows keys it does not know; once another run's schema merges into it, a record under
    that run's key that breaks the schema must be rejected, not remembered as allowed."""
    mine, theirs = _ShardedSchemaValidator("mine"), _ShardedSchemaValidator("theirs")
    junk = DHTRecord(key=DHTID.generate(source=progress_key("theirs")).to_bytes(), subkey=MSGPackSerializer.dumps(b"x"),
                     value=MSGPackSerializer.dumps("not a record"), expiration_time=get_dht_time() + 10)
    assert mine.validate(junk)
    assert mine.merge_with(theirs)
    assert not mine.validate(junk)


def test_verdicts_are_bounded_and_never_pickled():
    verdicts = Verdicts(capacity=3)
    digests = [bytes([i]) * 16 for i in range(5)]
    for digest in digests:
        verdicts.put(digest, True)
    assert len(verdicts) == 3 and verdicts.get(digests[0]) is None and verdicts.get(digests[4]) is True
    validator = RememberingSignatureValidator()
    validator.verdicts.put(digests[0], False)
    copy = pickle.loads(pickle.dumps(validator))
    assert len(copy.verdicts) == 0 and copy.local_public_key == validator.local_public_key


def test_the_digest_tells_apart_every_part_of_a_record():
    base = DHTRecord(key=b"k", subkey=b"s", value=b"v", expiration_time=1.0)
    variants = [base, dataclasses.replace(base, key=b"k2"), dataclasses.replace(base, subkey=b""),
                dataclasses.replace(base, subkey=None), dataclasses.replace(base, value=b"v2"),
                dataclasses.replace(base, expiration_time=1.5), DHTRecord(key=b"ks", subkey=b"", value=b"v",
                                                                          expiration_time=1.0)]
    assert len({record_digest(r) for r in variants}) == len(variants)
