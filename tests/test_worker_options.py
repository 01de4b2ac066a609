"""Worker options are checked when the Worker is made, each bad one named (InvalidArgument,
a ValueError): before, ``queues="urgent"`` served the queues u, r, g, e, n and t, ``queues=[]``
served nothing for ever, ``concurrency=2.5`` and ``lease="30"`` passed, and a
``purge_after`` of NaN made the worker's periodic purge raise in its maintenance loop."""

from __future__ import annotations

import math
from datetime import timedelta
from typing import Any

import pytest

import flowly
from tests import workflows  # noqa: F401  (registers the test workflows)
from tests.support import running_worker
from tests.test_cli import flowly as flowly_cli
from tests.test_cli import one_error_line


@pytest.mark.parametrize(("options", "message"), [
    ({"queues": []}, "at least one queue"),
    ({"queues": [5]}, "queue must be a string, got int"),
    ({"queues": ["default", ""]}, "queue must be a non-empty text"),
    ({"queues": ["a\x00"]}, "queue must not contain the NUL"),
    ({"concurrency": 2.5}, "concurrency must be an integer, got float"),
    ({"concurrency": 0}, "concurrency must be at least 1"),
    ({"max_connections": 1}, "max_connections must be at least 2"),
    ({"max_output_bytes": 1e6}, "max_output_bytes must be an integer"),
    ({"lease": "30"}, "lease must be seconds or a timedelta, got str"),
    ({"lease": math.inf}, "lease must be a finite number of seconds"),
    ({"lease": timedelta(days=2)}, "lease must be at most 86400 seconds"),
    # taken before: every run looked expired almost at once, and healthy runs were taken
    # over until they ended as poison
    ({"lease": 0.01}, "lease must be at least 1 second, got 0.01"),
    ({"lease": timedelta(milliseconds=999)}, "lease must be at least 1 second, got 0.999"),
    ({"poll_interval": 0}, "poll_interval must be a positive number of seconds"),
    ({"drain_timeout": -1}, "drain_timeout must be zero or more seconds"),
    ({"purge_after": math.nan}, "purge_after must be a finite number of seconds"),
    ({"purge_after": -5}, "purge_after must be zero or more seconds"),
    ({"purge_after": "7d"}, "purge_after must be seconds or a timedelta"),
    # taken before, and each failing far from the mistake: an int as the default retry
    # dead-lettered every run whose step failed with "'int' object has no attribute
    # 'max_attempts'", "no" as install_schema installed (a non-empty str is true), and
    # bytes as queues served the queues 120 ("x")
    ({"default_retry": 5}, "default_retry must be a flowly.Retry, got int"),
    ({"install_schema": "no"}, "install_schema must be True or False, got str"),
    ({"queues": b"x"}, "queues must be a queue name or an iterable of them, got bytes"),
])
def test_a_bad_worker_option_is_refused_naming_it(options: dict[str, Any], message: str
                                                  ) -> None:
    with pytest.raises(flowly.InvalidArgument, match=message):
        flowly.Worker("postgresql://unused/unused", workflows=["quick"], **options)


def test_a_worker_needs_a_dsn_as_text() -> None:
    with pytest.raises(flowly.InvalidArgument, match="dsn must be a string, got NoneType"):
        flowly.Worker(None, workflows=["quick"])  # type: ignore[arg-type]


def test_the_worker_command_names_a_bad_option_without_blaming_the_app(dsn: str) -> None:
    for option, message in ((["--queue", ""], "error: queue must be a non-empty text"),
                            (["--concurrency", "0"], "error: concurrency must be at least 1"),
                            (["--lease", "0.01"], "error: lease must be at least 1 second")):
        result = flowly_cli("worker", "--app", "examples.order", *option, dsn=dsn, timeout=30)
        one_error_line(result, 2)
        assert result.stderr.strip().startswith(message), result.stderr


def test_one_queue_given_alone_is_that_queue(dsn: str, client: flowly.Client) -> None:
    run_id = client.start("quick", 1, queue="urgent")
    with running_worker(dsn, workflows=["quick"], queues="urgent") as worker:
        assert worker.queues == ["urgent"]
        assert client.wait(run_id, timeout=30).status == "completed"
