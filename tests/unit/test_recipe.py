"""``swarm_opt.recipe`` without a network: validation, settings and their fingerprint, the one-phrase difference,
published records (hostile input), the command line's overrides, and the built-in language-model task's data."""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import replace

import pytest
import torch

from swarm_opt.cli.commands import resolve_options
from swarm_opt.cli.language_model import SIZES, TRAINING, eval_every, language_model
from swarm_opt.cli.train import _Batches, apply_recipe
from swarm_opt.errors import ConfigError
from swarm_opt.optimizer import identified_schema
from swarm_opt.recipe import DataShard, Evaluation, Recipe, difference, encode_record, fingerprint, parse_record


def make_recipe(**changes) -> Recipe:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    data = torch.utils.data.TensorDataset(torch.randn(32, 4), torch.randint(2, (32,)))
    fields = dict(model=model, loss_fn=torch.nn.functional.cross_entropy, train_data=data,
                  optimizer=lambda groups: torch.optim.AdamW(groups, lr=1e-3),
                  schedule=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda e: min(1.0, (e + 1) / 5)),
                  clip_grad_norm=1.0, precision="bf16")
    fields.update(changes)
    return Recipe(**fields)


def settings(recipe: Recipe) -> dict:
    return recipe.settings(target_batch_size=256, strategy="grad")


@pytest.mark.parametrize("changes, fragment", [
    (dict(precision="fp8"), "precision='fp8'): choose one of fp32, bf16, fp16"),
    (dict(model="mlp"), "model=...) must be a torch.nn.Module"),
    (dict(train_data=42), "train_data=...) must be a map-style dataset, an IterableDataset or a function"),
    (dict(clip_grad_norm=-1.0), "clip_grad_norm"),
    (dict(strategy="adamw"), "strategy='adamw'): choose one of"),
    (dict(batch_size=0), "batch_size=...) must be a positive integer"),
    (dict(schedule=3), "schedule=...) must be a function"),
])
def test_a_bad_recipe_names_the_field_and_the_fix(changes, fragment):
    with pytest.raises(ConfigError) as error:
        make_recipe(**changes)
    assert fragment in str(error.value)


def test_bad_evaluations_and_shards_are_refused():
    with pytest.raises(ConfigError, match="map-style dataset"):
        Evaluation(data=iter([]))
    with pytest.raises(ConfigError, match="every_epochs=...\\) must be a positive integer"):
        Evaluation(data=[1], every_epochs=0)
    with pytest.raises(ConfigError, match="0 <= INDEX < COUNT"):
        DataShard(3, 3)


@pytest.mark.parametrize("changes, fragment", [
    (dict(optimizer=lambda groups: torch.optim.AdamW(groups, lr=-1)), "optimizer raised ValueError"),
    (dict(optimizer=lambda groups: "adam"), "must return a torch.optim.Optimizer, got str"),
    (dict(schedule=lambda opt: 1 / 0), "schedule raised ZeroDivisionError"),
    (dict(schedule=lambda opt: None), "must return a learning-rate scheduler"),
    (dict(param_groups=lambda model: []), "param_groups must return a non-empty list"),
])
def test_factories_that_fail_are_one_message_naming_the_fix(changes, fragment):
    recipe = make_recipe(**changes)
    with pytest.raises(ConfigError) as error:
        settings(recipe)
    assert fragment in str(error.value) and "\n" not in str(error.value)


def test_settings_describe_what_changes_training_and_their_fingerprint_is_stable():
    a, b = settings(make_recipe()), settings(make_recipe())
    assert a == b and fingerprint(a) == fingerprint(b)
    assert a["optimizer"] == "AdamW" and a["lr"] == 1e-3 and a["precision"] == "bf16" and a["clip_grad_norm"] == 1.0
    assert "foreach" not in a and a["schedule"][:6] == [0.2, 0.4, 0.6, 0.8, 1.0, 1.0]
    json.dumps(a)  # published as JSON
    for changes, key in [(dict(optimizer=lambda g: torch.optim.AdamW(g, lr=1e-2)), "lr"),
                         (dict(clip_grad_norm=2.0), "clip_grad_norm"), (dict(precision="fp16"), "precision"),
                         (dict(schedule=None), "schedule"), (dict(data_id="other corpus"), "data")]:
        other = settings(make_recipe(**changes))
        assert other[key] != a[key] and fingerprint(other) != fingerprint(a), key


def test_the_difference_is_one_phrase_naming_the_setting_and_both_values():
    run = settings(make_recipe())
    mine = settings(make_recipe(optimizer=lambda g: torch.optim.AdamW(g, lr=1e-2)))
    assert difference(run, mine) == "this run trains with lr=0.001; your recipe says lr=0.01"
    assert difference(run, mine, {"lr": "--lr"}) == "this run trains with lr=0.001; your --lr says lr=0.01"
    slower = settings(make_recipe(schedule=lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda e: 0.5 ** e)))
    assert difference(run, slower) == ("this run's schedule sets the learning rate to 0.2x its base at global "
                                       "epoch 0; your recipe's sets 1x")
    assert difference(run, run) is None


def test_published_records_are_validated_and_bound_to_the_schema_they_are_stored_under():
    mine = settings(make_recipe())
    base = "a" * 32
    schema = identified_schema(base, fingerprint(mine))
    value = encode_record(mine, base)
    assert parse_record(schema, value) == mine
    forged = dict(mine, lr=0.5)  # other settings under a schema they do not hash to
    assert parse_record(schema, encode_record(forged, base)) is None
    assert parse_record(schema, value + b" " * 20000) is None  # too large
    assert parse_record(schema, b"{not json") is None
    assert parse_record(schema, json.dumps({"settings": {"x": {"deep": 1}}, "schema": base}).encode()) is None
    assert parse_record(schema, "a string") is None
    assert identified_schema(base, None) == base


def test_flags_override_the_recipe_and_the_defaults_do_not():
    recipe = make_recipe(strategy="local", batch_size=8, target_batch_size=64)

    def args(**given):
        return resolve_options("train", argparse.Namespace(run_id="r", **given), {})

    plain = args()
    effective = apply_recipe(recipe, plain)
    assert (plain.strategy, plain.batch_size, plain.target_batch_size) == ("local", 8, 64)
    assert settings(effective) == settings(recipe)

    typed = args(lr=0.01, clip_grad_norm=3.0, precision="fp32", batch_size=4, strategy="grad")
    effective = apply_recipe(recipe, typed)
    assert (typed.strategy, typed.batch_size, typed.target_batch_size) == ("grad", 4, 64)
    s = settings(effective)
    assert (s["lr"], s["clip_grad_norm"], s["precision"], s["optimizer"]) == (0.01, 3.0, "fp32", "AdamW")
    assert s["schedule"] == settings(recipe)["schedule"]
    env = resolve_options("train", argparse.Namespace(run_id="r"), {"SWARM_OPT_LR": "0.5"})
    assert settings(apply_recipe(recipe, env))["lr"] == 0.5

    evaluated = replace(recipe, evaluation=Evaluation(data=[1], every_epochs=2))
    assert apply_recipe(evaluated, args()).evaluation.every_epochs == 2
    assert apply_recipe(evaluated, args(eval_every=5)).evaluation.every_epochs == 5
    with pytest.raises(ConfigError, match="--eval-every: this task's recipe has no evaluation"):
        apply_recipe(recipe, args(eval_every=5))

    sgd = apply_recipe(recipe, args(optimizer="sgd", lr=0.2))
    assert (settings(sgd)["optimizer"], settings(sgd)["lr"], settings(sgd)["momentum"]) == ("SGD", 0.2, 0.9)
    with pytest.raises(ConfigError, match="--momentum sets the command line's optimizer"):
        apply_recipe(recipe, args(momentum=0.5))


def test_a_config_file_entry_equal_to_the_default_still_overrides_the_recipe(tmp_path):
    config = tmp_path / "run.json"
    config.write_text(json.dumps({"run_id": "r", "batch_size": 32, "strategy": "grad"}))
    args = resolve_options("train", argparse.Namespace(config=str(config)), {})
    apply_recipe(make_recipe(strategy="local", batch_size=8), args)
    assert (args.batch_size, args.strategy) == (32, "grad")


def test_lr_keeps_the_ratio_of_parameter_groups():
    def groups(model):
        return [{"params": model[0].parameters()}, {"params": model[2].parameters(), "lr": 5e-4}]
    recipe = apply_recipe(make_recipe(param_groups=groups),
                          resolve_options("train", argparse.Namespace(run_id="r", lr=2e-3), {}))
    s = settings(recipe)
    assert s["lr"] == 2e-3 and s["group1.lr"] == pytest.approx(1e-3)


def finite_stream(n: int, fail_at=None):
    def source(shard: DataShard):
        for i in range(shard.index, n, shard.count):
            if i == fail_at:
                raise OSError("disk gone")
            yield torch.full((4,), float(i)), torch.tensor(i % 2)
    return source


def test_a_stream_is_read_by_shard_and_its_end_and_failure_are_told_apart():
    recipe = make_recipe(train_data=finite_stream(20))
    assert recipe.streaming
    batches = _Batches(recipe, 4, seed=0, shard=DataShard(1, 2))
    seen = []
    while (batch := batches.next()) is not None:
        seen += [int(v) for v in batch[0][:, 0]]
    assert seen == list(range(1, 20, 2)) and batches.exhausted and batches.failure is None and batches.samples == 10
    collated = _Batches(make_recipe(train_data=finite_stream(8), collate=lambda samples: ("batch", [0] * len(samples))),
                        3, seed=0, shard=DataShard(0, 1))
    assert [collated.next() for _ in range(4)] == [("batch", [0] * 3), ("batch", [0] * 3), ("batch", [0] * 2), None]
    failing = _Batches(make_recipe(train_data=finite_stream(20, fail_at=9)), 4, seed=0, shard=DataShard(1, 2))
    assert failing.next() is not None and failing.next() is None
    assert failing.failure == "OSError: disk gone" and not failing.exhausted


class _Numbers(torch.utils.data.IterableDataset):
    """A stream of numbered samples that remembers what was read of it."""

    def __init__(self, values) -> None:
        self.values, self.read = list(values), []

    def __iter__(self):
        for v in self.values:
            self.read.append(v)
            yield torch.full((4,), float(v)), torch.tensor(v % 2)


def test_an_iterable_dataset_is_sharded_by_its_own_shard_method_when_it_has_one():
    plain = _Numbers(range(12))
    assert [int(x[0]) for x, _ in make_recipe(train_data=plain).stream(DataShard(1, 3))] == [1, 4, 7, 10]
    assert plain.read == list(range(12))  # kept every third sample of the whole stream

    class Shardable(_Numbers):  # as Hugging Face ``datasets`` streams: reads only the shard it is asked for
        def shard(self, num_shards, index):
            return _Numbers(self.values[index::num_shards])

    shardable = Shardable(range(12))
    assert [int(x[0]) for x, _ in make_recipe(train_data=shardable).stream(DataShard(1, 3))] == [1, 4, 7, 10]
    assert shardable.read == []  # read nothing but its shard

    class Broken(_Numbers):
        def shard(self, num_shards, index):
            raise KeyError("no such split")

    with pytest.raises(ConfigError, match=r"train_data.shard raised KeyError.*fix the recipe's train_data.shard"):
        make_recipe(train_data=Broken(range(4))).stream(DataShard(0, 2))


def test_the_language_model_recipe_is_complete_and_sized():
    recipe = language_model("tiny")
    s = recipe.settings(target_batch_size=64, strategy="grad")
    assert (s["optimizer"], s["precision"], s["clip_grad_norm"]) == ("AdamW", "bf16", 1.0)
    assert s["weight_decay"] == 0.1 and s["group1.weight_decay"] == 0.0 and s["data"].startswith("python3.")
    assert s["schedule"][0] == pytest.approx(0.1) and max(s["schedule"]) == 1.0 and s["schedule"][-1] < 0.2
    params = sum(p.numel() for p in recipe.model.parameters())
    assert 0.5e6 < params < 1.5e6
    layers, width, _, _ = SIZES["large"]
    assert 12 * layers * width ** 2 > 90e6  # the large size is ~100M parameters (not built here: seconds)
    x, y = next(recipe.stream(DataShard(0, 16, seed=1)))
    assert x.shape == y.shape == (64,) and torch.equal(x[1:], y[:-1])
    assert recipe.evaluation is not None and len(recipe.evaluation.data) >= 4 * recipe.evaluation.batch_size
    # evaluating takes at most a tenth of the compute: a window's forward costs about a third of a training window's
    for target in (1, 8, 64, 256, 10_000):
        every = eval_every(target)
        assert len(recipe.evaluation.data) / 3 <= 0.1 * target * every < len(recipe.evaluation.data) / 3 + 0.1 * target
    assert recipe.evaluation.every_epochs == eval_every(TRAINING["tiny"][2])
    held_out = set(recipe.evaluation.data.x[0].tolist())
    assert held_out  # a fixed slice
    with torch.no_grad():
        logits = recipe.model(x[None])
    assert logits.shape == (1, 64, 256)
    assert math.isclose(float(recipe.loss_fn(logits, y[None])), math.log(256), rel_tol=0.05)


def test_the_peer_identity_covers_strategy_options_and_matches_the_optimizers_schema():
    from swarm_opt.cli.train import _identity, make_strategy

    def identity(**given):
        args = resolve_options("train", argparse.Namespace(run_id="r", **given), {})
        recipe = apply_recipe(make_recipe(), args)
        return _identity(recipe, make_strategy(args), args)

    base = identity(strategy="fedprox")
    assert base.settings["fedprox_mu"] == 0.01 and base.settings["strategy"] == "fedprox"
    other = identity(strategy="fedprox", fedprox_mu=0.1)
    assert other.fingerprint != base.fingerprint and other.base == base.base
    assert identity(strategy="diloco", outer_lr=0.5).settings["outer_lr"] == 0.5
    assert identity().schema == identified_schema(identity().base, identity().fingerprint)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_a_precision_the_cpu_emulates_is_named_and_one_it_runs_natively_is_not(monkeypatch, precision):
    """A volunteer whose CPU has no native bfloat16 runs a bf16 recipe several times slower than fp32 (measured: 1.16
    s against 0.11 s a step of ``lm-tiny`` on an AVX2 CPU): the peer says so in one line (``swarm-opt train``)."""
    for native in (False, True):
        monkeypatch.setattr(torch.ops.mkldnn, f"_is_mkldnn_{precision}_supported", lambda native=native: native)
        said = make_recipe(precision=precision).emulated_precision()
        if native:
            assert said is None
        else:
            assert said is not None and f"no native {precision}" in said and "slower than fp32" in said
    assert make_recipe(precision="fp32").emulated_precision() is None
