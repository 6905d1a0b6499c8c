"""``swarm-opt`` as the previous release speaks to its peers (protocol 1: its schema formula, no protocol setting in
its recipe): ``python -m tests.e2e.previous_release train ...``. Everything else is this checkout's code."""

from swarm_opt import protocol

protocol.PROTOCOL = 1

if __name__ == "__main__":
    from swarm_opt.cli.commands import console_main

    console_main()
