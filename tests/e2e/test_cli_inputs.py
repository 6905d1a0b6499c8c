"""Bad input to ``swarm-opt dht/train/monitor`` is one clear line and a non-zero exit, never a traceback; options
come from flags, a config file and SWARM_OPT_* variables, flags winning. Fresh processes, as a user runs them."""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
from pathlib import Path

import pytest

from swarm_opt.cli.commands import main, resolve_options
from swarm_opt.errors import ConfigError

pytestmark = pytest.mark.timeout(120)

PEER = "/ip4/127.0.0.1/tcp/1/p2p/QmXfVzj2hTV9zJ4uH4LJAMEmg5L8Jr9fVwRtDxY5n2dUDs"


def assert_one_line_error(result, *fragments: str, status: int = 2) -> None:
    assert result.returncode == status, (result.returncode, result.stdout, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    assert result.stderr.count("\n") == 1, result.stderr
    for fragment in fragments:
        assert fragment in result.stderr, result.stderr


@pytest.mark.parametrize("args, fragments", [
    (["dht", "--initial-peers", "not-a-maddr"], ["--initial-peers: 'not-a-maddr' is not a valid multiaddr"]),
    (["dht", "--host-maddrs", "/ip4/1.2.3.4/tcp/notaport"], ["--host-maddrs", "not a valid multiaddr"]),
    (["train", "--run-id", "r", "--initial-peers", "/ip4/127.0.0.1/tcp/5"], ["has no /p2p/PEER_ID part"]),
    (["train", "--run-id", "r", "--task", "imagenet"], ["unknown task 'imagenet'", "digits, mnist"]),
    (["train", "--run-id", "r", "--task", "no_such_module_xyz:make"], ["cannot find task module 'no_such_module_xyz'"]),
    (["train", "--run-id", "r", "--task", "json:no_such_function"], ["task module 'json' has no function"]),
    (["train", "--run-id", "r", "--task", "missing_file.py:make"], ["task file 'missing_file.py' does not exist"]),
    (["train", "--initial-peers", PEER], ["--run-id is required"]),
    (["train", "--run-id", "bad run id"], ["argument --run-id", "letters, digits"]),
    (["train", "--run-id", "r", "--lr", "-1"], ["argument --lr"]),
    (["train", "--run-id", "r", "--strategy", "adamw"], ["invalid choice: 'adamw'"]),
    (["train", "--run-id", "r", "--matchmaking-time", "10", "--averaging-timeout", "5"],
     ["averaging_timeout (5.0) must exceed matchmaking_time"]),
    (["monitor", "--run-id", "r"], ["--initial-peers is required"]),
    (["train", "--run-id", "r", "--auxiliary", "--client-mode"], ["--auxiliary peers", "drop --client-mode"]),
    (["train", "--run-id", "r", "--config", "missing.yaml"], ["cannot read config file 'missing.yaml'"]),
    (["train", "--run-id", "r", "--gloo-lane", "10.0.0.5:port"], ["argument --gloo-lane", "HOST:PORT"]),
    (["train", "--run-id", "r", "--gloo-lane", "my-laptop"], ["Gloo(host='my-laptop')", "IP address"]),
    (["train", "--run-id", "r", "--aggregation", "median"], ["argument --aggregation", "unknown aggregation",
                                                              "trimmed-mean:0.25", "(reputation:centered-clip)",
                                                              "audited:reputation:centered-clip"]),
    (["train", "--run-id", "r", "--aggregation", "trimmed-mean:0.5"], ["argument --aggregation", "[0, 0.5)"]),
    (["train", "--run-id", "r", "--aggregation", "centered-clip", "--gloo-lane", "127.0.0.1"],
     ["drop --gloo-lane or --aggregation"]),
])
def test_bad_input_is_one_line(args, fragments, capsys, tmp_path, monkeypatch):
    """In-process through main(argv) (the same code as the console script): many cases, no start-up cost each."""
    monkeypatch.chdir(tmp_path)
    status = main(args, environ={})
    captured = capsys.readouterr()
    assert_one_line_error(subprocess.CompletedProcess(args, status, captured.out, captured.err), *fragments)


@pytest.mark.parametrize("args, fragments", [
    (["dht", "--initial-peers", "not-a-maddr"], ["--initial-peers: 'not-a-maddr' is not a valid multiaddr"]),
    (["train", "--run-id", "r", "--task", "imagenet"], ["unknown task 'imagenet'", "digits, mnist"]),
    (["train", "--run-id", "r", "--task", "no_such_module_xyz:make"], ["cannot find task module 'no_such_module_xyz'"]),
])
def test_bad_input_is_one_line_in_a_fresh_process(cli, args, fragments):
    assert_one_line_error(cli.run(*args), *fragments)


def test_a_broken_user_task_is_one_line(cli):
    (cli.workdir / "user_task.py").write_text("def make():\n    return 1 / 0\n\ndef wrong():\n    return 42\n")
    assert_one_line_error(cli.run("train", "--run-id", "r", "--task", "user_task:make"),
                          "task 'user_task:make' failed: ZeroDivisionError")
    assert_one_line_error(cli.run("train", "--run-id", "r", "--task", "user_task.py:wrong"),
                          "must return a swarm_opt.Recipe or (model, train_dataset, test_dataset, loss_fn)")


def test_a_port_in_use_is_one_line(cli):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = cli.run("dht", "--host-maddrs", f"/ip4/127.0.0.1/tcp/{port}")
    assert_one_line_error(result, f"port {port} is already in use")


def test_config_file_errors_are_one_line(cli):
    (cli.workdir / "typo.yaml").write_text("run_id: r\nlearning_rate: 0.1\n")
    assert_one_line_error(cli.run("train", "--config", "typo.yaml"), "unknown option 'learning_rate'")
    assert_one_line_error(cli.run("train", "--run-id", "r", SWARM_OPT_LR="fast"), "SWARM_OPT_LR: expected a number")


@pytest.mark.parametrize("name, text, fragment", [
    ("bad.json", "{not json", "cannot parse config file 'bad.json'"),
    ("types.toml", 'run_id = "r"\nbatch_size = "many"\n', "batch_size: expected a positive integer"),
    ("list.yaml", "- 1\n- 2\n", "must hold a mapping"),
    ("run.ini", "[x]\n", "must end in .json, .toml, .yaml or .yml"),
])
def test_config_file_errors_in_process(name, text, fragment, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / name).write_text(text)
    status = main(["train", "--config", name], environ={})
    captured = capsys.readouterr()
    assert_one_line_error(subprocess.CompletedProcess([], status, captured.out, captured.err), fragment)


# in-process: how the three sources combine


def test_flags_win_over_environment_which_wins_over_the_config_file(tmp_path: Path):
    config = tmp_path / "run.json"
    config.write_text(json.dumps({"run_id": "from_file", "lr": 0.5, "batch_size": 8, "initial_peers": [PEER],
                                  "once": True,  # a monitor option: ignored by train at top level
                                  "train": {"epochs": 7}}))
    given = argparse.Namespace(config=str(config), lr=0.01)
    args = resolve_options("train", given, {"SWARM_OPT_LR": "0.2", "SWARM_OPT_BATCH_SIZE": "16",
                                            "SWARM_OPT_CLIENT_MODE": "yes"})
    assert (args.run_id, args.lr, args.batch_size, args.epochs) == ("from_file", 0.01, 16, 7)
    assert args.initial_peers == [PEER] and args.client_mode is True
    assert args.target_batch_size == 1024  # the default
    env_list = resolve_options("monitor", argparse.Namespace(), {
        "SWARM_OPT_RUN_ID": "r", "SWARM_OPT_INITIAL_PEERS": f"{PEER}, {PEER}"})
    assert env_list.initial_peers == [PEER, PEER]
    with pytest.raises(ConfigError, match="unknown option 'lr' in section 'monitor'"):
        config.write_text(json.dumps({"monitor": {"lr": 1}}))
        resolve_options("monitor", argparse.Namespace(config=str(config)), {})


def test_every_help_has_examples(capsys):
    for name in ("dht", "train", "monitor"):
        assert main([name, "--help"]) == 0
        text = capsys.readouterr().out
        assert "examples:" in text and f"swarm-opt {name} " in text and "SWARM_OPT_" in text
