"""``python -m swarm_opt``: the ``swarm-opt`` command line."""

from swarm_opt.cli.commands import console_main

if __name__ == "__main__":
    console_main()
