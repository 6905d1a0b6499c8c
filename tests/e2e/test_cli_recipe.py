"""Recipes through ``swarm-opt train``: bad recipes are one line; a streaming source that runs out or fails makes the
peer leave with its checkpoint; three volunteers of the built-in language model with its full recipe (AdamW,
warmup then cosine, clipping, bf16, a data shard each, perplexity) reach one process's loss at equal tokens, and a
volunteer with another learning rate is refused in one line. On a CPU that emulates bf16 (no native bf16 arithmetic:
ten times slower than fp32, ``Recipe.emulated_precision``) the volunteers and the one process run in fp32."""

from __future__ import annotations

import concurrent.futures
import re
import subprocess
from typing import Any, Dict, List, Optional, Tuple

import pytest
import torch

import swarm_opt
from swarm_opt.cli.commands import main
from swarm_opt.recipe import DataShard
from tests.e2e.test_cli_inputs import assert_one_line_error

FAST_ROUNDS = ["--matchmaking-time", "1", "--averaging-timeout", "30"]

USER_RECIPES = '''
import torch
from swarm_opt import Recipe
from swarm_opt.recipe import DataShard


def _model():
    return torch.nn.Linear(4, 2)


def _data():
    return torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randint(2, (64,)))


def stream(n, fail_at=None):
    def source(shard: DataShard):
        for i in range(shard.index, n, shard.count):
            if i == fail_at:
                raise OSError("disk gone")
            yield torch.randn(4), torch.tensor(i % 2)
    return source


def finite():
    return Recipe(model=_model(), loss_fn=torch.nn.functional.cross_entropy, train_data=stream(40),
                  num_shards=1, batch_size=4, target_batch_size=8)


def failing():
    return Recipe(model=_model(), loss_fn=torch.nn.functional.cross_entropy, train_data=stream(400, fail_at=23),
                  num_shards=1, batch_size=4, target_batch_size=8)


def bad_schedule():
    return Recipe(model=_model(), loss_fn=torch.nn.functional.cross_entropy, train_data=_data(),
                  schedule=lambda opt: torch.optim.lr_scheduler.StepLR(opt))


def bad_optimizer():
    return Recipe(model=_model(), loss_fn=torch.nn.functional.cross_entropy, train_data=_data(),
                  optimizer=lambda groups: torch.optim.AdamW(groups, lr=-0.1))


def bad_precision():
    return Recipe(model=_model(), loss_fn=torch.nn.functional.cross_entropy, train_data=_data(), precision="fp8")


def wrong_shape():
    return _model(), _data()
'''


@pytest.mark.parametrize("task, fragments", [
    ("broken.py:make", ["importing broken.py failed: NameError"]),
    ("recipes:wrong_shape", ["must return a swarm_opt.Recipe or (model, train_dataset, test_dataset, loss_fn), "
                             "got tuple"]),
    ("recipes:bad_schedule", ["the recipe's schedule raised TypeError", "fix the recipe's schedule"]),
    ("recipes:bad_optimizer", ["the recipe's optimizer raised ValueError", "Invalid learning rate: -0.1",
                               "fix the recipe's optimizer"]),
    ("recipes:bad_precision", ["Recipe(precision='fp8'): choose one of fp32, bf16, fp16"]),
    ("recipes:finite", []),  # a valid recipe with a bad option
])
def test_a_bad_recipe_is_one_line_before_any_network(task, fragments, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "recipes.py").write_text(USER_RECIPES)
    (tmp_path / "broken.py").write_text("import torch\nundefined_name\n")
    extra = ["--shard", "1/1"] if task == "recipes:finite" else []
    if task == "recipes:finite":
        fragments = ["argument --shard", "0 <= INDEX < COUNT"]
    status = main(["train", "--run-id", "r", "--task", task, *extra], environ={})
    captured = capsys.readouterr()
    assert_one_line_error(subprocess.CompletedProcess([], status, captured.out, captured.err), *fragments)


def peer_args(run_id: str, maddr: str, *extra: str) -> List[str]:
    return ["train", "--run-id", run_id, "--initial-peers", maddr, "--host-maddrs", "/ip4/127.0.0.1/tcp/0",
            *FAST_ROUNDS, *extra]


@pytest.mark.swarm
@pytest.mark.timeout(240)
def test_a_stream_that_runs_out_or_fails_leaves_with_its_checkpoint(cli):
    (cli.workdir / "recipes.py").write_text(USER_RECIPES)
    _, maddr = cli.dht()
    finite = cli.start("finite", *peer_args("dry", maddr, "--task", "recipes:finite", "--checkpoint-dir", "ck1"))
    failing = cli.start("failing", *peer_args("fails", maddr, "--task", "recipes:failing", "--checkpoint-dir",
                                              "ck2"))
    assert finite.wait(180) == 0, finite.describe()
    assert re.search(r"the training source of data shard 0/1 ran out after 40 samples at epoch 5; left the run\. To "
                     r"train on, give the task's source more data", finite.stderr), finite.describe()
    assert "saved checkpoint" in finite.stderr and "Traceback" not in finite.stderr, finite.describe()
    assert swarm_opt.load_checkpoint(sorted((cli.workdir / "ck1").glob("epoch-*.pt"))[-1])["epoch"] == 5
    assert failing.wait(180) == 1, failing.describe()
    assert re.search(r"the training source of data shard 0/1 failed after 20 samples at epoch 2: OSError: disk gone; "
                     r"left the run\. Fix the task's streaming source", failing.stderr), failing.describe()
    assert "saved checkpoint" in failing.stderr and "Traceback" not in failing.stderr, failing.describe()


@pytest.mark.swarm
@pytest.mark.timeout(180)
def test_a_volunteer_whose_settings_differ_is_refused_in_one_line(cli):
    _, maddr = cli.dht()
    common = peer_args("refusal", maddr, "--task", "digits", "--target-batch-size", "256")
    peer = cli.start("peer", *common, "--lr", "0.05")
    peer.wait_for(r"^epoch 1: ", 120)
    # two volunteers at once (each is a whole start-up): the default lr, 0.1, and the run's lr with clipping
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        refused, clipped = pool.map(lambda extra: cli.run(*common, *extra, timeout=120),
                                    [(), ("--lr", "0.05", "--clip-grad-norm", "1")])
    assert_one_line_error(refused, "run 'refusal': this run trains with lr=0.05; your recipe says lr=0.1",
                          "or another --run-id")
    assert_one_line_error(clipped, "this run trains with clip_grad_norm=(none); your --clip-grad-norm says "
                                   "clip_grad_norm=1.0")
    peer.interrupt()
    assert peer.wait(60) == 0, peer.describe()
    assert "ERROR" not in peer.stderr, peer.describe()  # the refused volunteers never showed up in the run


# --- the language model: three volunteers against one process -----------------------------------------------------

EPOCH_LINE = re.compile(r"^epoch (\d+): (?:test loss ([\d.]+), )?(.*)$", re.MULTILINE)  # loss when evaluated
AVERAGED = re.compile(r"averaged with (\d+) of \d+ peer\(s\) \((\d+) samples from this peer\)")
CAUGHT_UP = re.compile(r"caught up by downloading the swarm's state \((\d+) local samples dropped\)")


def contributions(text: str) -> Dict[int, Optional[int]]:
    """What a peer's epoch lines say: epoch -> the samples it contributed to that epoch's round, or None where it
    caught up by downloading the swarm's state (whether its samples were in the others' round: ``replay_counts``)."""
    return {int(epoch): int(found.group(2)) if (found := AVERAGED.search(rest)) else None
            for epoch, _, rest in EPOCH_LINE.findall(text)}


def replay_counts(texts: List[str]) -> Tuple[List[Dict[int, int]], List[Dict[int, int]], int]:
    """From the peers' epoch lines, per peer: epoch -> samples it gave the swarm's round, and epoch -> samples it read
    that the round left out, for epochs 1 to the last returned (as far as every peer's lines tell). A peer that
    caught up by downloading read the samples it dropped; they were in the round if its group (the size the others
    print) counts it (its result came too late), and not if the others committed without it."""
    lines = [{int(epoch): rest for epoch, _, rest in EPOCH_LINE.findall(text)} for text in texts]
    used: List[Dict[int, int]] = [{} for _ in texts]
    skipped: List[Dict[int, int]] = [{} for _ in texts]
    epoch = 1
    while all(epoch in peer for peer in lines):
        averaged = [AVERAGED.search(peer[epoch]) for peer in lines]
        caught = [CAUGHT_UP.search(peer[epoch]) for peer in lines]
        sizes = {int(found.group(1)) for found in averaged if found}
        if len(sizes) != 1 or not all(a or c for a, c in zip(averaged, caught)):
            break  # no round, two rounds, or a line that says neither
        members = sum(1 for found in averaged if found)
        late_members = sizes.pop() - members  # caught-up peers counted in the round
        if late_members not in (0, len(texts) - members):
            break  # some of the caught-up peers were in the round, not all: which ones is not known
        for i, (a, c) in enumerate(zip(averaged, caught)):
            if a:
                used[i][epoch] = int(a.group(2))
            else:
                (used if late_members else skipped)[i][epoch] = int(c.group(1))
        epoch += 1
    return used, skipped, epoch - 1


def logged_losses(text: str) -> Dict[int, float]:
    return {int(epoch): float(loss) for epoch, loss, _ in EPOCH_LINE.findall(text) if loss}


def lm_precision() -> str:
    """The built-in language model's recipe precision (bf16), or fp32 where this CPU only emulates bf16."""
    from swarm_opt.cli.tasks import load_task

    return "fp32" if load_task("lm-tiny", seed=0).emulated_precision() else "bf16"


def _recipe(task: str, seed: int, precision: Optional[str]) -> Any:
    from dataclasses import replace

    from swarm_opt.cli.tasks import load_task

    recipe = load_task(task, seed=seed)
    return recipe if precision is None else replace(recipe, precision=precision)


def train_one_process(task: str, peers: List[Dict[int, int]], shards: List[Any], *, seed: int = 0,
                      batch_size: int = 16, skipped: Optional[List[Dict[int, int]]] = None,
                      precision: Optional[str] = None) -> float:
    """One process with the task's recipe: at each global epoch, one clipped AdamW step on the mean gradient of
    that epoch's samples, the schedule stepped once; returns the evaluation's loss. ``peers[i][epoch]`` samples of
    the epoch come from ``shards[i]``'s stream, read in batches of ``batch_size`` as the peer read them (after
    ``skipped[i][epoch]`` samples it read and the swarm left out): with the peers' shards and counts, the very
    samples the swarm averaged. ``precision`` replaces the recipe's."""
    from swarm_opt.cli.tasks import evaluate

    recipe = _recipe(task, seed, precision)
    optimizer = recipe.build_optimizer(recipe.groups())
    schedule = recipe.schedule(optimizer)
    streams = [recipe.stream(shard) for shard in shards]
    for epoch in range(1, max((max(p) for p in peers if p), default=0) + 1):  # (a peer late to the first rounds)
        total = sum(p.get(epoch, 0) for p in peers)
        optimizer.zero_grad()
        for stream, counts, left_out in zip(streams, peers, skipped or [{} for _ in peers]):
            for _ in range(left_out.get(epoch, 0)):
                next(stream)
            count = counts.get(epoch, 0)
            assert count % batch_size == 0, counts  # the peers' streams never run out: full batches
            for _ in range(count // batch_size):
                x, y = torch.utils.data.default_collate([next(stream) for _ in range(batch_size)])
                with recipe.autocast():
                    loss = recipe.loss_fn(recipe.model(x), y)
                (loss * len(y) / total).backward()
        torch.nn.utils.clip_grad_norm_(recipe.model.parameters(), recipe.clip_grad_norm)
        optimizer.step()
        schedule.step()
    return evaluate(recipe)["loss"]


def swarm_loss(task: str, checkpoint_dir, precision: Optional[str] = None) -> float:
    from swarm_opt.cli.tasks import evaluate

    recipe = _recipe(task, 0, precision)
    recipe.model.load_state_dict(swarm_opt.load_checkpoint(sorted(checkpoint_dir.glob("epoch-*.pt"))[-1])["model"])
    return evaluate(recipe)["loss"]


@pytest.mark.swarm
@pytest.mark.extended
@pytest.mark.timeout(1500)
def test_three_lm_volunteers_reach_one_process_loss_and_refuse_another_learning_rate(cli):
    epochs, target, every = 50, 128, 5
    _, maddr = cli.dht()
    precision = lm_precision()
    common = peer_args("lm_e2e", maddr, "--task", "lm-tiny", "--target-batch-size", str(target), "--epochs",
                       str(epochs), "--min-peers", "3", "--precision", precision)
    evaluating = ("--eval-every", str(every))  # the task's own cadence at this batch is every 14 epochs
    peers = [cli.start(f"peer{i}", *common, "--shard", f"{i}/3", "--data-seed", str(i), "--checkpoint-dir",
                       f"ckpt{i}", "--checkpoint-every", "1000", *evaluating) for i in range(3)]
    peers[0].wait_for(r"^epoch 2: ", 300)

    refused = cli.run(*common, "--lr", "0.01", timeout=300)  # its start-up took over 120 s beside 24 peers in CI
    assert_one_line_error(refused, "run 'lm_e2e': this run trains with lr=0.001; your --lr says lr=0.01",
                          "use the run's (the same --task and options as its peers) or another --run-id")

    for peer in peers:
        assert peer.wait(1200) == 0, peer.describe()
        assert f"reached epoch {epochs}; done" in peer.stderr and "Traceback" not in peer.stderr, peer.describe()
        assert re.search(r"^epoch \d+: test loss [\d.]+, test perplexity [\d.]+, averaged", peer.stdout, re.M)
    peer_counts = [contributions(peer.stdout) for peer in peers]
    swarm = [swarm_loss("lm-tiny", cli.workdir / f"ckpt{i}", precision) for i in range(3)]
    assert max(swarm) - min(swarm) < 1e-4, swarm  # one model
    # one process on the very tokens the swarm averaged (each peer's shard, data seed and counts) over the first 10
    # epochs, compared with the loss the peers printed then: the same steps, equal to float rounding. Later, rounding
    # differences grow into different trajectories, and so the end is compared with a run of one process on as many
    # tokens. A peer that caught up by downloading (under load a round's result can reach one member too late) read
    # samples that the round may have left out: replay_counts tells from the others' group size
    used, skipped, resolved = replay_counts([peer.stdout for peer in peers])
    last = min(10, resolved)
    last -= last % every  # an epoch the peers evaluated at
    assert last >= 5, peer_counts
    logged = logged_losses(peers[0].stdout)[last]
    prefix, left_out = ([{e: n for e, n in c.items() if e <= last} for c in counts] for counts in (used, skipped))
    same_tokens = train_one_process("lm-tiny", prefix, [DataShard(i, 3, seed=i) for i in range(3)],
                                    skipped=left_out, precision=precision)
    # at the end, one process on as many tokens drawn from the whole corpus in another order (runs of one process in
    # different orders differ by about 0.6 % among each other at this size: docs/language-model.md)
    per_epoch = {e: sum(c.get(e) or 0 for c in peer_counts) or 128 for e in range(1, epochs + 1)}
    other_order = train_one_process("lm-tiny", [per_epoch], [DataShard(0, 1, seed=0)], precision=precision)
    print(f"\n3 peers at epoch {last}: test loss {logged:.4f}; one process on the same "
          f"{sum(sum(c.values()) for c in prefix) * 64:,} tokens: {same_tokens:.4f} "
          f"({abs(logged - same_tokens) / same_tokens:.2%} apart)\n3 peers at epoch {epochs}: {swarm[0]:.4f}; one "
          f"process on {sum(per_epoch.values()) * 64:,} tokens in another order: {other_order:.4f} "
          f"({abs(swarm[0] - other_order) / other_order:.2%} apart)")
    assert abs(logged - same_tokens) <= 0.005 * same_tokens, (logged, same_tokens, peer_counts)
    assert abs(swarm[0] - other_order) <= 0.01 * other_order, (swarm, other_order)
