"""The ``swarm-opt`` command line (``python -m swarm_opt``).

Subcommands are listed here as they are planned, so that ``--help`` shows what the tool will do; each one that is not
implemented yet says so in one line and exits with status 2. Bad input never ends in a traceback: argparse's usage
errors are reduced to one line that points to ``--help``.
"""

from __future__ import annotations

import argparse
import sys
from typing import List, NoReturn, Optional, Sequence

PROG = "swarm-opt"
EXIT_USAGE = 2

# name -> one-line summary shown by --help
SUBCOMMANDS = {
    "dht": "run a DHT node that peers can join through (a bootstrap peer)",
    "train": "join a run as a training peer",
    "monitor": "follow a run's progress (epoch, peers, samples per second) from the DHT",
}


class _UsageError(Exception):
    def __init__(self, message: str, prog: str) -> None:
        super().__init__(message)
        self.prog = prog


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser that reports bad input in one line instead of usage + error, and never exits by itself."""

    def error(self, message: str) -> NoReturn:
        raise _UsageError(message, self.prog)


def build_parser() -> argparse.ArgumentParser:
    from swarm_opt import __version__

    parser = _Parser(
        prog=PROG,
        description="swarm-opt: train PyTorch models together with peers over the internet (built on hivemind).",
        epilog=f"Run '{PROG} COMMAND --help' for a command's options.",
    )
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands", parser_class=_Parser)
    for name, summary in SUBCOMMANDS.items():
        commands.add_parser(name, help=summary, description=f"{summary} (not implemented yet in this version)")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the command line; returns the exit status (0 success, 2 usage error or unimplemented command)."""
    args_list: List[str] = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    try:
        # a planned command's options are not defined yet: whatever follows it must not hide "not implemented"
        args, unknown = parser.parse_known_args(args_list)
        if unknown and args.command is None:
            parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    except _UsageError as e:
        print(f"{e.prog}: error: {e}; see '{PROG} --help'", file=sys.stderr)
        return EXIT_USAGE
    except SystemExit as e:  # --help and --version print and exit through argparse
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    if args.command is None:
        print(f"{PROG}: error: a command is required ({', '.join(SUBCOMMANDS)}); see '{PROG} --help'",
              file=sys.stderr)
        return EXIT_USAGE
    print(f"{PROG} {args.command}: not implemented yet in this version", file=sys.stderr)
    return EXIT_USAGE


def console_main() -> NoReturn:  # pragma: no cover - the entry point for a `swarm-opt` console script
    try:
        code = main()
    except KeyboardInterrupt:
        code = 130
    sys.exit(code)
