"""Protocol versions (swarm_opt.protocol): what each release mixes into a peer's schema, and the one line each side
prints when peers of two releases meet. The previous release (protocol 1) is reproduced exactly by setting
``swarm_opt.protocol.PROTOCOL = 1``: its schema formula and its recipe settings (no protocol setting)."""

from __future__ import annotations

import hashlib
from typing import Optional

import pytest
import torch

from swarm_opt import protocol
from swarm_opt.optimizer import identified_schema, legacy_schemas, model_schema, strategy_schema
from swarm_opt.progress import mismatch_line
from swarm_opt.recipe import difference, encode_record, fingerprint, parse_record, protocol_difference
from swarm_opt.strategies import GradientAveraging


@pytest.fixture
def previous_release(monkeypatch):
    monkeypatch.setattr(protocol, "PROTOCOL", 1)


def _params():
    return list(torch.nn.Linear(3, 2).parameters())


def test_protocol_1_is_the_schema_of_releases_before_protocols(previous_release):
    # the formula of swarm_opt 0.1.0, spelled out: a peer pretending protocol 1 is that release to its peers
    description = "grad;(2, 3):torch.float32;(2,):torch.float32"
    assert model_schema(_params(), "grad") == hashlib.sha256(description.encode()).hexdigest()[:32]
    assert protocol.label() is None


def test_each_protocol_gives_the_same_model_another_schema_and_a_peer_knows_the_older_ones():
    params, strategy = _params(), GradientAveraging()
    strategy.bind(params, torch.optim.SGD(params, lr=0.1))
    now = strategy_schema(params, strategy)
    old = strategy_schema(params, strategy, protocol=1)
    assert now != old and now == strategy_schema(params, strategy, protocol=protocol.PROTOCOL)
    assert legacy_schemas(params, strategy, "id") == {identified_schema(old, "id"): 1}


def test_labels_and_what_to_install():
    assert protocol.label() == "protocol 2; swarm_opt>=0.2.0"
    assert protocol.parse_label(protocol.label()) == (2, "0.2.0")
    assert protocol.parse_label(None) == (1, "0.1.0")  # a recipe without the setting: a release before protocols
    assert protocol.parse_label("protocol x") is None and protocol.parse_label(3) is None
    assert protocol.to_install(1) == "swarm_opt>=0.1.0,<0.2.0"
    assert protocol.to_install(2) == "swarm_opt>=0.2.0"
    assert protocol.to_install(3, "0.3.1") == "swarm_opt>=0.3.1"  # newer than this release knows: from its label


def test_a_newer_peer_refuses_an_older_run_and_an_older_run_s_peer_refuses_a_newer_one_naming_the_release():
    settings = {"lr": 0.1, "target_batch_size": 256}
    ours = {**settings, protocol.SETTING: protocol.label()}
    # this release meets a run of the previous one (its records carry no protocol setting)
    why = protocol_difference(settings, ours)
    assert why == ("its live peers run swarm_opt protocol 1, an older release: install 'swarm_opt>=0.1.0,<0.2.0' "
                   "to train with them (this peer runs protocol 2, 'swarm_opt>=0.2.0')")
    # ... and of a later one, whose label names its release
    why = protocol_difference({**settings, protocol.SETTING: "protocol 3; swarm_opt>=0.3.0"}, ours)
    assert "swarm_opt protocol 3, a newer release: install 'swarm_opt>=0.3.0'" in why
    assert protocol_difference(ours, ours) is None
    assert protocol_difference(ours, settings) is None  # a caller that does not say its protocol: not judged here
    # the previous release reads this release's recipe record (its parse_record and difference are unchanged) and
    # refuses to join in one line that names the release
    base = "b" * 32
    subkey = identified_schema(base, fingerprint(ours))
    theirs = parse_record(subkey, encode_record(ours, base))
    assert theirs == ours
    assert difference(theirs, settings) == ('this run trains with swarm_opt="protocol 2; swarm_opt>=0.2.0"; your '
                                            'recipe says swarm_opt=(none)')


def test_the_tracker_names_peers_of_an_older_release_apart_from_another_model():
    line = mismatch_line("r", ["old", "old", "other"], {"old": 1})
    assert line == ("2 peer(s) in run 'r' train this model with swarm_opt protocol 1, an older release: install "
                    "'swarm_opt>=0.1.0,<0.2.0' to train with them (this peer runs protocol 2, 'swarm_opt>=0.2.0'); "
                    "they are kept apart")
    assert "train a different model or recipe" in mismatch_line("r", ["other"], {"old": 1})


def test_this_release_is_the_first_of_its_protocol_or_later():
    import swarm_opt

    def version(text: str) -> tuple:
        return tuple(int(part) for part in text.split(".")[:3])

    assert version(swarm_opt.__version__) >= version(protocol.RELEASES[protocol.PROTOCOL])
    assert max(protocol.RELEASES) == protocol.PROTOCOL  # raising PROTOCOL names its first release


def test_progress_records_outside_groups_are_exactly_what_the_previous_release_stores_and_accepts():
    """hivemind's schema validator refuses a record that its schema would change (an unknown field is dropped, a
    missing one filled in): records must round-trip through both releases' schemas. The previous release's record is
    this one without ``line`` (the grid line of Moshpit groups, added since)."""
    import pydantic.v1 as pydantic

    from swarm_opt.progress import ProgressRecord

    previous = pydantic.create_model("PreviousProgressRecord", __base__=pydantic.BaseModel, **{
        name: (field.outer_type_, field.default) for name, field in ProgressRecord.__fields__.items()
        if name != "line"})

    def outer(record_type):  # as hivemind validates it: a dict of records under the run's key, compared by dict()
        return pydantic.create_model("Schema", progress=(dict[str, Optional[record_type]], ...))

    record = ProgressRecord(peer_id=b"peer", instance="a", epoch=3, samples=64, samples_per_second=10.0, time=1.0,
                            client_mode=False, model_schema="m", target_batch_size=128, params_digest=[1.0, 2.0])
    stored = {"progress": {"sub": record.dict()}}
    assert "line" not in stored["progress"]["sub"]
    for schema in (outer(previous), outer(ProgressRecord)):  # the previous release's validator, and ours
        assert schema.parse_obj(stored).dict() == stored
    theirs = {"progress": {"sub": previous(**record.dict()).dict()}}
    assert outer(ProgressRecord).parse_obj(theirs).dict() == theirs
    # inside groups the line travels (peers of groups find one another only within this release anyway)
    grouped = {"progress": {"sub": ProgressRecord(**record.dict(), line="01").dict()}}
    assert grouped["progress"]["sub"]["line"] == "01" and outer(ProgressRecord).parse_obj(grouped).dict() == grouped
