"""The ``swarm-opt`` command line: ``commands`` (the parser and ``dht`` / ``monitor``), ``train`` (the volunteer's
training loop) and ``tasks`` (the built-in tasks and ``--task module:function``). It trains through the public
``swarm_opt.Optimizer`` and has no training logic of its own."""

from swarm_opt.cli.commands import console_main, main

__all__ = ["main", "console_main"]
