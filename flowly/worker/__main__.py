"""``python -m flowly.worker --app module[:attr]``: run a worker process.

Importing ``module`` registers its workflows. ``attr``, if given, names what to serve: a
workflow function, a list of them, or a ready :class:`flowly.Worker` (whose settings then
win over the command line's).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

from ..config import resolve_dsn
from . import Worker


def add_worker_arguments(parser: argparse.ArgumentParser) -> None:
    """The worker's options, shared with ``flowly worker``."""
    parser.add_argument("--app", required=True, metavar="MODULE[:ATTR]",
                        help="module that registers the workflows (imported from the cwd)")
    parser.add_argument("--queue", action="append", dest="queues", metavar="NAME",
                        help="queue to serve (repeatable; default: default)")
    parser.add_argument("--concurrency", type=int, default=32, help="runs in flight (32)")
    parser.add_argument("--lease", type=float, default=30.0, help="lease seconds (30)")
    parser.add_argument("--poll-interval", type=float, default=0.5,
                        help="seconds between polls when no NOTIFY arrives (0.5)")
    parser.add_argument("--drain-timeout", type=float, default=10.0,
                        help="seconds in-flight runs get to finish on SIGTERM (10)")
    parser.add_argument("--max-connections", type=int, default=4,
                        help="database connections besides the listener (4)")


def load_app(spec: str) -> Any:
    """Import ``module[:attr]`` and return ``attr`` (None when not given)."""
    module_name, _, attr = spec.partition(":")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise SystemExit(f"error: --app {spec}: cannot import {module_name!r}: {exc}") from None
    if not attr:
        return None
    try:
        return getattr(module, attr)
    except AttributeError:
        raise SystemExit(
            f"error: --app {spec}: module {module_name!r} has no attribute {attr!r}") from None


def worker_from_args(args: argparse.Namespace) -> Worker:
    """Build the worker the parsed command line describes."""
    target = load_app(args.app)
    if isinstance(target, Worker):
        return target
    workflows = None if target is None else (target if isinstance(target, list) else [target])
    return Worker(
        resolve_dsn(args.dsn),
        workflows,
        schema=args.schema,
        queues=args.queues or ["default"],
        concurrency=args.concurrency,
        lease=args.lease,
        poll_interval=args.poll_interval,
        drain_timeout=args.drain_timeout,
        max_connections=args.max_connections,
    )


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m flowly.worker", description=__doc__)
    parser.add_argument("--dsn", help="database (default: FLOWLY_DSN, DATABASE_URL, embedded)")
    parser.add_argument("--schema", default="flowly", help="flowly's schema (flowly)")
    parser.add_argument("--log-level", default="INFO", help="logging level (INFO)")
    add_worker_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(worker_from_args(args).run())


if __name__ == "__main__":
    main()
