"""The ``swarm-opt`` command line (``python -m swarm_opt``): ``dht``, ``train`` and ``monitor``.

Every option can come from a flag, a config file (``--config run.yaml``, ``.json`` or ``.toml``) or an environment
variable ``SWARM_OPT_<OPTION>`` (``--initial-peers`` -> ``SWARM_OPT_INITIAL_PEERS``); a flag wins over the
environment, which wins over the file. Options are declared once (``_Option``), so the three sources and ``--help``
always agree. Bad input never ends in a traceback: it is one line naming the option and the fix, exit status 2.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, NoReturn, Optional, Sequence, Tuple, Union

from swarm_opt import strategies
from swarm_opt.cli.options import PROG, private_run, start_metrics
from swarm_opt.cli.stop import StopRequest
from swarm_opt.errors import ConfigError

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2
ENV_PREFIX = "SWARM_OPT_"

# name -> one-line summary shown by --help
SUBCOMMANDS = {
    "dht": "run a DHT node that peers can join through (a bootstrap peer)",
    "train": "join a run as a training peer",
    "monitor": "follow a run's progress (epoch, peers, samples per second) from the DHT",
    "doctor": "check that this machine can join a run: initial peers, reachability, clock, versions",
}


class _UsageError(Exception):
    def __init__(self, message: str, prog: str) -> None:
        super().__init__(message)
        self.prog = prog


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser that reports bad input in one line instead of usage + error, and never exits by itself."""

    def error(self, message: str) -> NoReturn:
        raise _UsageError(message, self.prog)


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=34, width=100)


# --- value types: each raises ValueError with a message that reads well after "--option: " ------------------------


def positive_int(text: str) -> int:
    try:
        value = int(str(text))
    except ValueError:
        raise ValueError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise ValueError(f"expected a positive integer, got {value}")
    return value


def non_negative_float(text: str) -> float:
    try:
        value = float(str(text))
    except ValueError:
        raise ValueError(f"expected a number, got {text!r}") from None
    if not (0 <= value < float("inf")):
        raise ValueError(f"expected a finite number >= 0, got {text}")
    return value


def lane_address(text: str) -> Tuple[str, int]:
    """``HOST`` or ``HOST:PORT`` (an IPv4 address; port 0 or absent: any free port) for ``--gloo-lane``."""
    host, _, port = text.partition(":")
    try:
        number = int(port) if port else 0
    except ValueError:
        number = -1
    if not host or not 0 <= number <= 65535:
        raise ValueError(f"expected HOST or HOST:PORT, e.g. 10.0.0.5 or 10.0.0.5:29500, got {text!r}")
    return host, number


def host_port(text: str) -> Tuple[str, int]:
    """``[HOST:]PORT`` for a server of this process (``--metrics-port``, ``monitor --serve``): HOST defaults to
    127.0.0.1 (this machine only); 0.0.0.0 serves every interface; port 0 picks a free one."""
    host, _, port = str(text).rpartition(":")
    try:
        number = int(port)
    except ValueError:
        number = -1
    if not 0 <= number <= 65535:
        raise ValueError(f"expected [HOST:]PORT, e.g. 9100 or 0.0.0.0:9100, got {text!r}")
    return host or "127.0.0.1", number


def positive_float(text: str) -> float:
    value = non_negative_float(text)
    if value == 0:
        raise ValueError(f"expected a number > 0, got {text}")
    return value


def worker_momentum(text: str) -> Any:
    """``--worker-momentum``: ``swarm_opt.WorkerMomentum(beta)`` (its ConfigError is a ValueError)."""
    from swarm_opt.strategies import WorkerMomentum

    return WorkerMomentum(non_negative_float(text))


def data_shard(text: str) -> Tuple[int, int]:
    """``--shard INDEX/COUNT``: this peer's part of a streaming source, e.g. 2/8."""
    index, _, count = str(text).partition("/")
    try:
        shard = int(index), int(count)
    except ValueError:
        shard = (-1, 0)
    if not 0 <= shard[0] < shard[1]:
        raise ValueError(f"expected INDEX/COUNT with 0 <= INDEX < COUNT, e.g. 2/8, got {text!r}")
    return shard


def integer(text: str) -> int:
    try:
        return int(str(text))
    except ValueError:
        raise ValueError(f"expected an integer, got {text!r}") from None


_RUN_ID = re.compile(r"^[A-Za-z0-9_\-]{1,128}$")


def run_id(text: str) -> str:
    if not _RUN_ID.match(str(text)):
        raise ValueError(f"expected 1-128 letters, digits, '_' or '-', got {text!r}; e.g. mnist_run42")
    return str(text)


def aggregation(text: str) -> Any:
    """``--aggregation``: ``swarm_opt.aggregation.parse_aggregation``'s forms (its ConfigError is a ValueError)."""
    from swarm_opt.aggregation import parse_aggregation

    return parse_aggregation(text)


def _boolean(text: Any) -> bool:
    if isinstance(text, bool):
        return text
    lowered = str(text).strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"expected true or false, got {text!r}")


def _argparse_type(convert: Callable[[str], Any]) -> Callable[[str], Any]:
    def wrapped(text: str) -> Any:
        try:
            return convert(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    wrapped.__name__ = convert.__name__
    return wrapped


# --- options: declared once, read from flags, environment and config file ------------------------------------------


@dataclass(frozen=True)
class _Option:
    flag: str
    help: Union[str, Callable[[], str]]  # a function: read when the parser is built (a registry's current rows)
    type: Callable[[str], Any] = str
    default: Any = None
    is_list: bool = False
    is_switch: bool = False
    choices: Union[None, Sequence[str], Callable[[], Sequence[str]]] = None
    required: bool = False
    metavar: Optional[str] = None

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.dest.upper()

    def convert(self, value: Any, source: str) -> Any:
        """A value from the environment (a string) or a config file (a string, number, bool or list)."""
        try:
            if self.is_switch:
                return _boolean(value)
            if self.is_list:
                items = value if isinstance(value, list) else [v for v in re.split(r"[\s,]+", str(value)) if v]
                return [self._one(item) for item in items]
            return self._one(value)
        except ValueError as e:
            raise ConfigError(f"{source}: {e}") from None

    def _one(self, value: Any) -> Any:
        if isinstance(value, (list, dict)):
            raise ValueError(f"expected a single value, got {value!r}")
        converted = self.type(str(value))
        choices = self.current_choices()
        if choices is not None and converted not in choices:
            raise ValueError(f"invalid choice {converted!r} (choose from {', '.join(choices)})")
        return converted

    def current_choices(self) -> Optional[Sequence[str]]:
        return self.choices() if callable(self.choices) else self.choices

    def add_to(self, parser: argparse.ArgumentParser) -> None:
        default = "" if self.default in (None, False, [], ()) else f" (default: {_show(self.default)})"
        help_text = f"{self.help() if callable(self.help) else self.help}{default} [env {self.env}]"
        if self.is_switch:
            parser.add_argument(self.flag, action="store_true", default=argparse.SUPPRESS, help=help_text)
            return
        parser.add_argument(self.flag, type=_argparse_type(self.type), default=argparse.SUPPRESS,
                            nargs="+" if self.is_list else None, choices=self.current_choices(), help=help_text,
                            metavar=self.metavar or self._default_metavar())

    def _default_metavar(self) -> Optional[str]:
        if self.current_choices() is not None:
            return None
        if self.type in (positive_int, integer):
            return "N"
        if self.type in (positive_float, non_negative_float):
            return "SECONDS" if re.search(r"time|interval|wait", self.flag) else "X"
        return None


def _show(value: Any) -> str:
    return " ".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)


_NETWORK = [
    _Option("--initial-peers", "multiaddrs of peers already in the swarm, e.g. the lines 'swarm-opt dht' printed",
            is_list=True, default=[], metavar="MADDR"),
    _Option("--host-maddrs", "multiaddrs to listen on", is_list=True, default=["/ip4/0.0.0.0/tcp/0"],
            metavar="MADDR"),
    _Option("--announce-maddrs", "multiaddrs others should dial (behind a port forward or a cloud NAT)",
            is_list=True, default=[], metavar="MADDR"),
    _Option("--identity-path", "private key file that fixes this node's peer id (created if missing)",
            metavar="FILE"),
]

_JOIN = _Option("--join-timeout", "seconds to keep trying while none of --initial-peers can be reached (they may be "
                "starting, or this host's link may be down)", type=non_negative_float, default=60.0)
_METRICS = _Option("--metrics-port", "serve Prometheus metrics of this peer on http://HOST:PORT/metrics (HOST "
                   "default 127.0.0.1; 0.0.0.0 for a scraper on another machine)", type=host_port,
                   metavar="[HOST:]PORT")

_PRIVATE = [
    _Option("--run-secret-file", "a private run: file holding the run's shared secret (make one with "
            "`openssl rand -hex 32 > run.secret`); peers without it cannot join", metavar="FILE"),
    _Option("--allow-peers", "a private run: file listing the peer ids allowed in, one per line; needs "
            "--identity-path", metavar="FILE"),
]

OPTIONS: Dict[str, List[_Option]] = {
    "dht": _NETWORK + [_JOIN] + _PRIVATE + [_METRICS],
    "train": [
        _Option("--run-id", "peers with the same run id train together", type=run_id, required=True),
        *_NETWORK,
        _JOIN,
        *_PRIVATE,
        _Option("--client-mode", "only dial out (behind NAT or a firewall); still averages", is_switch=True),
        _Option("--auxiliary", "help the run average without training: reduce a share of every round (a machine "
                "with bandwidth but no accelerator; accepts connections, so not with --client-mode)", is_switch=True),
        _Option("--task", "what to train: digits, mnist, lm-tiny, lm-small, lm-medium, lm-large (a language model "
                "on the Python standard library's sources), MODULE:FUNCTION or FILE.py:FUNCTION; a task's recipe "
                "may set the optimizer, schedule, clipping, precision, strategy and batch sizes, and the options "
                "given here override it", default="digits"),
        _Option("--seed", "seed of the initial model: every peer that starts a run must use the same one",
                type=integer, default=0),
        _Option("--data-seed", "seed of this peer's batch order (default: random)", type=integer),
        _Option("--shard", "this peer's part of a task's streaming source, e.g. 2/8 (default: the run's "
                "least-claimed shard, agreed through the DHT so that no two peers read the same one)", type=data_shard,
                metavar="INDEX/COUNT"),
        _Option("--strategy", strategies.strategy_help, choices=lambda: tuple(strategies.STRATEGY_NAMES),
                default="grad"),
        _Option("--fedprox-mu", "FedProx: strength of the pull toward the round's starting point",
                type=non_negative_float, default=0.01),
        _Option("--outer-lr", "DiLoCo: learning rate of the outer Nesterov SGD", type=positive_float, default=0.7),
        _Option("--outer-momentum", "DiLoCo: momentum of the outer SGD", type=non_negative_float, default=0.9),
        _Option("--worker-momentum", "grad: each peer sends the momentum BETA (e.g. 0.9) of its own round gradients "
                "instead of the gradients, so that a robust --aggregation tells attackers from honest noise; the "
                "inner SGD then has no momentum of its own (raise --lr about 1/(1-BETA) times)", type=worker_momentum,
                metavar="BETA"),
        _Option("--overlap", "grad and diloco: average each round in the background while this peer trains on "
                "(rounds cost no compute time; the steps made meanwhile are one update stale)", is_switch=True),
        _Option("--optimizer", "inner optimizer", choices=("sgd", "adam"), default="sgd"),
        _Option("--lr", "inner learning rate", type=positive_float, default=0.1),
        _Option("--momentum", "SGD momentum (default 0.9; 0 with --worker-momentum)", type=non_negative_float),
        _Option("--clip-grad-norm", "clip the gradient the optimizer applies to this L2 norm (the round's mean "
                "gradient with --strategy grad)", type=positive_float, metavar="NORM"),
        _Option("--precision", "fp32; bf16 (autocast); fp16 (autocast with a GradScaler)",
                choices=("fp32", "bf16", "fp16"), default="fp32"),
        _Option("--batch-size", "samples per local step", type=positive_int, default=32),
        _Option("--target-batch-size", "samples the swarm accumulates per global epoch (the global batch)",
                type=positive_int, default=1024),
        _Option("--epochs", "stop once the run reaches this global epoch (default: train until stopped)",
                type=positive_int),
        _Option("--min-peers", "wait until this many peers are in the run before training", type=positive_int,
                default=1),
        _Option("--matchmaking-time", "seconds peers spend forming an averaging group", type=positive_float,
                default=5.0),
        _Option("--averaging-timeout", "seconds after which a round is abandoned and retried", type=positive_float,
                default=60.0),
        _Option("--aggregation", "how each averaged part is combined, the same on every peer of the run (default: "
                "mean, each member's norm bounded): mean:none (the plain mean), trimmed-mean[:FRACTION], "
                "centered-clip[:tau=T,iterations=N]; reputation:... to leave out members whose values keep "
                "pointing the wrong way, round after round; and audited:... for two reducers per part (contains a "
                "lying reducer, 2x the bytes), e.g. audited:reputation:centered-clip", type=aggregation,
                metavar="SPEC"),
        _Option("--gloo-lane", "average over torch.distributed's gloo, several times faster than hivemind's path, "
                "in rounds whose every member offers the lane: this machine's IP address (and a rendezvous port, "
                "default any) on a trusted network; gloo neither authenticates nor encrypts", type=lane_address,
                metavar="HOST[:PORT]"),
        _Option("--checkpoint-dir", "save checkpoints (model and optimizer, DIR/epoch-NNNNNNNN.pt, "
                "the last 3 kept) at exit and every --checkpoint-every epochs; resume from the latest", metavar="DIR"),
        _Option("--checkpoint-every", "global epochs between checkpoints", type=positive_int, default=10),
        _Option("--eval-every", "global epochs between two evaluations on the task's test data (default: the "
                "task's: every epoch for digits and mnist; the language models evaluate for at most a tenth of "
                "their compute)", type=positive_int, metavar="N"),
        _METRICS,
        _Option("--log-dir", "write TensorBoard scalars (loss, test metrics, epoch, samples/s, round seconds, group "
                "size) to DIR, one point per global epoch", metavar="DIR"),
    ],
    "monitor": [
        _Option("--run-id", "the run to follow", type=run_id, required=True),
        _Option("--initial-peers", "multiaddrs of any peer of the swarm", is_list=True, required=True,
                metavar="MADDR"),
        *_PRIVATE,
        _NETWORK[-1],
        _JOIN,
        _Option("--target-batch-size", "the run's global batch, to show progress toward the next epoch and an ETA",
                type=positive_int),
        _Option("--once", "print one snapshot and exit (status 1 if the run has no live peers)", is_switch=True),
        _Option("--interval", "seconds between refreshes", type=positive_float, default=2.0),
        _Option("--wait", "seconds --once waits for the run's records to appear", type=non_negative_float,
                default=5.0),
        _Option("--plot", "write the run's global epoch over time to this image when the monitor exits",
                metavar="FILE.png"),
        _Option("--serve", "serve a live web page of the run on http://HOST:PORT/ (HOST default 127.0.0.1; "
                "0.0.0.0 for every interface)", type=host_port, metavar="[HOST:]PORT"),
    ],
}

OPTIONS["doctor"] = [
    _Option("--initial-peers", "multiaddrs of peers already in the swarm", is_list=True, required=True,
            metavar="MADDR"),
    _Option("--run-id", "the run to join: compare this machine's versions with its peers'", type=run_id),
    *_NETWORK[1:],
    *_PRIVATE,
    _Option("--client-mode", "this peer will train with --client-mode (nobody needs to reach it)", is_switch=True),
    _Option("--timeout", "seconds each network check may take", type=positive_float, default=5.0),
]

_EXAMPLES = {
    "dht": """\
examples:
  swarm-opt dht                                        # listen on any free port of every interface
  swarm-opt dht --host-maddrs /ip4/0.0.0.0/tcp/31337 --identity-path dht.id
                                                       # a fixed port and peer id: the address survives restarts
  swarm-opt dht --host-maddrs /ip4/0.0.0.0/tcp/31337 --announce-maddrs /ip4/203.0.113.5/tcp/31337

It prints the multiaddrs to share, one per line (give them to 'swarm-opt train --initial-peers'),
and runs until Ctrl-C or SIGTERM.""",
    "train": """\
examples:
  swarm-opt train --run-id digits42 --initial-peers /ip4/203.0.113.5/tcp/31337/p2p/QmBootstrap... \\
      --task digits --target-batch-size 512 --epochs 20 --checkpoint-dir ckpt
  swarm-opt train --config run.yaml --client-mode         # behind NAT: options from a file
  swarm-opt train --run-id my_run --initial-peers ... --task my_task:make_task --strategy diloco --outer-lr 0.7
  swarm-opt train --run-id lm42 --initial-peers ... --task lm-tiny --epochs 200 --checkpoint-dir ckpt

A task function takes no arguments and returns a swarm_opt.Recipe (docs/language-model.md) or
(model, train_dataset, test_dataset, loss_fn).
Ctrl-C (or SIGTERM) finishes the current step, saves a checkpoint and leaves the swarm; press it twice to
abandon the step.""",
    "monitor": """\
examples:
  swarm-opt monitor --run-id digits42 --initial-peers /ip4/203.0.113.5/tcp/31337/p2p/QmBootstrap...
  swarm-opt monitor --run-id digits42 --initial-peers ... --once           # one snapshot, for scripts
  swarm-opt monitor --config run.yaml --target-batch-size 512 --plot progress.png
  swarm-opt monitor --run-id digits42 --initial-peers ... --serve 8080    # then open http://127.0.0.1:8080/""",
    "doctor": """\
examples:
  swarm-opt doctor --initial-peers /ip4/203.0.113.5/tcp/31337/p2p/QmBootstrap... --run-id digits42
  swarm-opt doctor --config run.yaml --host-maddrs /ip4/0.0.0.0/tcp/31400   # the port this peer will listen on

One line per check (ok, warn or FAIL) with the fix; exit status 0 when everything checked is fine.""",
}

_CONFIG_HELP = """\
options also come from a config file (--config FILE: .json, .toml, or .yaml/.yml) with the option names as keys
(run_id: digits42, initial_peers: [...]), optionally under a section per command ([train], [monitor], [dht]), and
from environment variables SWARM_OPT_<OPTION>; a flag wins over the environment, which wins over the file."""


def build_parser() -> argparse.ArgumentParser:
    from swarm_opt import __version__

    parser = _Parser(
        prog=PROG,
        description="swarm-opt: train PyTorch models together with peers over the internet (built on hivemind).",
        epilog=f"Run '{PROG} COMMAND --help' for a command's options and examples.",
    )
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands", parser_class=_Parser)
    for name, summary in SUBCOMMANDS.items():
        sub = commands.add_parser(name, help=summary, description=f"{summary}.\n\n{_CONFIG_HELP}",
                                  epilog=_EXAMPLES[name], formatter_class=_HelpFormatter)
        for option in OPTIONS[name]:
            option.add_to(sub)
        sub.add_argument("--config", metavar="FILE", default=argparse.SUPPRESS,
                         help=f"read options from this file [env {ENV_PREFIX}CONFIG]")
        sub.add_argument("-v", "--verbose", action="count", default=0,
                         help="show swarm_opt's log (-v) and hivemind's debug log (-vv)")
    return parser


def load_config_file(path: str) -> Dict[str, Any]:
    file = Path(path).expanduser()
    try:
        text = file.read_text()
    except OSError as e:
        raise ConfigError(f"cannot read config file '{path}': {e.strerror or e}") from None
    suffix = file.suffix.lower()
    try:
        if suffix == ".json":
            data = json.loads(text)
        elif suffix == ".toml":
            try:
                import tomllib
            except ImportError:  # Python < 3.11
                raise ConfigError("TOML config files need Python 3.11+; use .json or .yaml") from None
            data = tomllib.loads(text)
        elif suffix in (".yaml", ".yml"):
            try:
                import yaml
            except ImportError:
                raise ConfigError("YAML config files need PyYAML: pip install swarm_opt[cli]; or use .json / .toml") \
                    from None
            data = yaml.safe_load(text)
        else:
            raise ConfigError(f"config file '{path}' must end in .json, .toml, .yaml or .yml")
    except ConfigError:
        raise
    except Exception as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"cannot parse config file '{path}': {reason}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file '{path}' must hold a mapping of option names to values")
    return data


def resolve_options(command: str, given: argparse.Namespace, environ: Dict[str, str]) -> argparse.Namespace:
    """Merge flags (``given``, only what was typed) over environment variables over the config file over defaults."""
    options = {o.dest: o for o in OPTIONS[command]}
    values: Dict[str, Any] = {dest: option.default for dest, option in options.items()}
    explicit = set()  # what the user set (in the file, the environment or a flag): it overrides a task's recipe
    config_path = getattr(given, "config", None) or environ.get(ENV_PREFIX + "CONFIG")
    if config_path:
        from_file = _from_config_file(command, config_path, options)
        values.update(from_file)
        explicit.update(from_file)
    for dest, option in options.items():
        if option.env in environ:
            values[dest] = option.convert(environ[option.env], option.env)
            explicit.add(dest)
    for dest in options:
        if hasattr(given, dest):
            values[dest] = getattr(given, dest)
            explicit.add(dest)
    for dest, option in options.items():
        if option.required and values[dest] in (None, []):
            raise ConfigError(f"{option.flag} is required (or '{dest}' in the config file, or {option.env})")
    values["command"], values["verbose"] = command, getattr(given, "verbose", 0)
    values["explicit"] = frozenset(explicit)
    return argparse.Namespace(**values)


def _from_config_file(command: str, path: str, options: Dict[str, _Option]) -> Dict[str, Any]:
    data = load_config_file(path)
    known_anywhere = {o.dest for opts in OPTIONS.values() for o in opts}
    values: Dict[str, Any] = {}
    flat = {k: v for k, v in data.items() if k not in SUBCOMMANDS}
    section = data.get(command, {}) or {}
    if not isinstance(section, dict):
        raise ConfigError(f"config file '{path}': section '{command}' must be a mapping of options")
    for key, value in list(flat.items()) + list(section.items()):
        dest = str(key).replace("-", "_")
        if dest not in options:
            if key in section or dest not in known_anywhere:  # shared keys of other commands are fine at top level
                where = f"section '{command}'" if key in section else "it"
                raise ConfigError(f"config file '{path}': unknown option '{key}' in {where} "
                                  f"(known: {', '.join(sorted(options))})")
            continue
        values[dest] = options[dest].convert(value, f"config file '{path}': {key}")
    return values


def _setup_logging(verbose: int) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
    swarm_logger = logging.getLogger("swarm_opt")
    swarm_logger.addHandler(handler)
    swarm_logger.propagate = False
    swarm_logger.setLevel(logging.WARNING if verbose == 0 else logging.INFO if verbose == 1 else logging.DEBUG)
    if verbose < 2:  # hivemind's chatter is re-emitted under swarm_opt.hivemind at DEBUG
        logging.getLogger("swarm_opt.hivemind").setLevel(logging.CRITICAL)


# --- commands -------------------------------------------------------------------------------------------------------


def run_dht(args: argparse.Namespace) -> int:
    stop = StopRequest().install()  # before the imports: swarm_opt.cli.stop says why
    from swarm_opt._hivemind.node import ensure_identity, start_dht

    peer_id = ensure_identity(args.identity_path) if args.identity_path else None
    metrics = start_metrics(args)
    dht = start_dht(initial_peers=args.initial_peers, host_maddrs=args.host_maddrs,
                    announce_maddrs=args.announce_maddrs, identity_path=args.identity_path,
                    private_run=private_run(args), join_timeout=args.join_timeout, stop=stop.event)
    try:
        for maddr in dht.get_visible_maddrs():
            print(maddr, flush=True)
        if metrics is not None:
            metrics.watch(dht=dht)
        identity = f" (identity {args.identity_path}, peer id {peer_id})" if peer_id else ""
        print(f"{PROG} dht: running{identity}; share the addresses above with --initial-peers. "
              f"Ctrl-C to stop.", file=sys.stderr, flush=True)
        while not stop.wait(1.0):
            if not dht.is_alive():
                print(f"{PROG} dht: the DHT process died unexpectedly", file=sys.stderr)
                return EXIT_FAILURE
    except KeyboardInterrupt:
        pass
    finally:
        import signal

        signal.signal(signal.SIGINT, signal.SIG_IGN)
        dht.shutdown()
    print(f"{PROG} dht: stopped", file=sys.stderr, flush=True)
    return EXIT_OK


def run_monitor(args: argparse.Namespace) -> int:
    stop = StopRequest().install()  # before the imports: swarm_opt.cli.stop says why
    from swarm_opt._hivemind.node import start_dht
    from swarm_opt.monitor import RunMonitor, format_snapshot, plot_history

    page = None
    if args.serve is not None:
        if args.once:
            raise ConfigError("--serve runs until stopped; drop --once (or --serve)")
        from swarm_opt.monitor.web import MonitorPage

        page = MonitorPage(*args.serve, run_id=args.run_id)  # a port in use fails here, before the DHT starts
    dht = start_dht(initial_peers=args.initial_peers, client_mode=True, identity_path=args.identity_path,
                    private_run=private_run(args), join_timeout=args.join_timeout, stop=stop.event)
    monitor = RunMonitor(dht, args.run_id, target_batch_size=args.target_batch_size, with_stats=page is not None)
    try:
        if page is not None:
            from swarm_opt.monitor.web import serve_forever

            print(f"{PROG} monitor: serving run '{args.run_id}' on {page.url} (Ctrl-C to stop)", file=sys.stderr,
                  flush=True)
            serve_forever(monitor, page, stop.event)
            return EXIT_OK
        if args.once:
            deadline = time.monotonic() + args.wait
            snapshot = monitor.read()
            while not snapshot.peers and time.monotonic() < deadline and not stop.requested:
                stop.wait(0.5)
                snapshot = monitor.read()
            if not snapshot.peers:
                print(f"{PROG} monitor: no live peers found for run '{args.run_id}' within {args.wait:g} s; "
                      f"check --run-id and that its peers are training", file=sys.stderr)
                return EXIT_FAILURE
            print(format_snapshot(snapshot), flush=True)
            return EXIT_OK
        live = sys.stdout.isatty()
        while not stop.requested:
            snapshot = monitor.read()
            text = format_snapshot(snapshot) if snapshot.peers else f"run {args.run_id}: no live peers (yet)"
            stamp = time.strftime("%H:%M:%S")
            if live:
                print("\x1b[H\x1b[J" + f"{stamp}  " + text, flush=True)
            else:
                print(f"[{stamp}] {text}\n", flush=True)
            stop.wait(args.interval)
        return EXIT_OK
    except KeyboardInterrupt:
        return EXIT_OK
    finally:
        import signal

        signal.signal(signal.SIGINT, signal.SIG_IGN)
        if page is not None:
            page.close()
        dht.shutdown()
        if args.plot:
            if monitor.history:
                plot_history(monitor.history, args.plot, args.run_id)
                print(f"{PROG} monitor: wrote {args.plot}", file=sys.stderr)
            else:
                print(f"{PROG} monitor: nothing to plot (no records were seen); {args.plot} not written",
                      file=sys.stderr)


def _run_doctor(args: argparse.Namespace) -> int:
    from swarm_opt.cli.doctor import run_doctor

    return run_doctor(args)


def _run_train(args: argparse.Namespace) -> int:
    stop = StopRequest(f"{PROG} train: stopping before joining the run (Ctrl-C again to stop at once)").install()
    from swarm_opt.cli.train import run_train  # torch, hivemind: seconds on a loaded machine (swarm_opt.cli.stop)

    stop.raise_if_requested()
    return run_train(args, stop)


_COMMANDS: Dict[str, Callable[[argparse.Namespace], int]] = {"dht": run_dht, "train": _run_train,
                                                             "monitor": run_monitor, "doctor": _run_doctor}


def main(argv: Optional[Sequence[str]] = None, environ: Optional[Dict[str, str]] = None) -> int:
    """Run the command line; returns the exit status (0 success, 1 failure, 2 bad input)."""
    args_list: List[str] = list(sys.argv[1:] if argv is None else argv)
    environ = dict(os.environ if environ is None else environ)
    parser = build_parser()
    try:
        given = parser.parse_args(args_list)
    except _UsageError as e:
        print(f"{e.prog}: error: {e}; see '{e.prog} --help'", file=sys.stderr)
        return EXIT_USAGE
    except SystemExit as e:  # --help and --version print and exit through argparse
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    if given.command is None:
        print(f"{PROG}: error: a command is required ({', '.join(SUBCOMMANDS)}); see '{PROG} --help'",
              file=sys.stderr)
        return EXIT_USAGE
    prog = f"{PROG} {given.command}"
    try:
        args = resolve_options(given.command, given, environ)
        _setup_logging(args.verbose)
        return _COMMANDS[given.command](args)
    except ConfigError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # a bug or an unexpected failure: one line, the traceback only when asked for
        if getattr(given, "verbose", 0):
            raise
        print(f"{prog}: failed: {type(e).__name__}: {e} (run with -v for the traceback)", file=sys.stderr)
        return EXIT_FAILURE


def console_main() -> NoReturn:  # pragma: no cover - the entry point for a `swarm-opt` console script
    try:
        code = main()
    except KeyboardInterrupt:
        code = 130
    gc.freeze()  # skips the interpreter's final collection of torch's modules (~1 s at exit): everything is shut down
    sys.exit(code)
