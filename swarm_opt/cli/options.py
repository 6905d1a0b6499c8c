"""What the command line's subcommands share: the program's name and the objects that several of them build from
their options (``swarm-opt train`` and ``swarm-opt doctor`` both start from a run's credentials). ``commands`` parses
the options; the subcommands import from here, never from ``commands``, so that the imports run one way."""

from __future__ import annotations

import argparse
import sys
from typing import Any

PROG = "swarm-opt"


def start_metrics(args: argparse.Namespace) -> Any:
    """The Prometheus exporter of --metrics-port, already serving (None without the option); before any DHT starts,
    so that a port in use costs nothing."""
    if args.metrics_port is None:
        return None
    from swarm_opt.monitor.prometheus import PrometheusMetrics

    host, port = args.metrics_port
    metrics = PrometheusMetrics()
    port = metrics.serve(port, host)
    print(f"{PROG} {args.command}: Prometheus metrics on http://{host}:{port}/metrics", file=sys.stderr, flush=True)
    return metrics


def private_run(args: argparse.Namespace) -> Any:
    """The run's credentials from --run-secret-file / --allow-peers (None for an open run)."""
    if args.run_secret_file is None and args.allow_peers is None:
        return None
    from swarm_opt.auth import PrivateRun

    if args.allow_peers is not None and args.identity_path is not None:
        from swarm_opt._hivemind.node import ensure_identity

        ensure_identity(args.identity_path)
    return PrivateRun.from_files(secret_file=args.run_secret_file, allow_peers_file=args.allow_peers,
                                 identity_path=args.identity_path)
