"""A run released until a time is claimed again at that time by the worker that released it,
not at its next poll (flowly.worker.due_timer): a durable sleep, a step's retry backoff, a
body's retry backoff, a wait's timeout. Each worker here polls once a minute."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import psycopg

import flowly
from flowly.worker.due_timer import DueTimer
from tests.support import running_worker, scalar


def test_a_durable_sleep_ends_on_time_on_a_worker_that_polls_once_a_minute(
        dsn: str, client: flowly.Client) -> None:
    with running_worker(dsn, workflows=["sleepy"], poll_interval=60):
        began = time.time()
        run_id = client.start("sleepy", {"seconds": 0.5})
        run = client.wait(run_id, timeout=20)
    assert run.status == "completed"
    assert 0.5 <= run.output["woke"] - began < 3


def test_a_step_s_retry_backoff_ends_on_time(dsn: str, client: flowly.Client,
                                              db: psycopg.Connection[Any]) -> None:
    # its step fails twice, backing off 0.05 s, then 0.1 s
    with running_worker(dsn, workflows=["flaky"], poll_interval=60):
        began = time.monotonic()
        run_id = client.start("flaky", {"failures": 2, "backoff": "exponential",
                                         "initial_delay": 0.05})
        run = client.wait(run_id, timeout=20)
        took = time.monotonic() - began
    assert run.status == "completed" and run.output == 3
    assert scalar(db, "select count(*) from flowly.step_attempts where run_id = %s",
                  run_id) == 2
    assert took < 5


def test_a_body_s_retry_backoff_ends_on_time(dsn: str, client: flowly.Client) -> None:
    # the body fails once outside any step; the engine backs its run off for about a second
    with running_worker(dsn, workflows=["replay", "quick"], poll_interval=60):
        began = time.monotonic()
        run_id = client.start("replay", None)
        run = client.wait(run_id, timeout=20)
        took = time.monotonic() - began
    assert run.status == "completed" and run.output["attempt"] == 2
    assert took < 5


def test_a_wait_s_timeout_ends_on_time(dsn: str, client: flowly.Client) -> None:
    with running_worker(dsn, workflows=["event_or_timeout"], poll_interval=60):
        began = time.monotonic()
        run_id = client.start("event_or_timeout", {"timeout": 0.5})
        run = client.wait(run_id, timeout=20)
        took = time.monotonic() - began
    assert run.status == "completed" and run.output == "timed out"
    assert 0.5 <= took < 3.5


def test_the_timer_wakes_once_per_time_in_order_and_keeps_no_time_beyond_its_horizon() -> None:
    async def scenario() -> tuple[list[float], int]:
        loop = asyncio.get_running_loop()
        woken: list[float] = []
        done = asyncio.Event()

        def wake() -> None:
            woken.append(loop.time())
            if len(woken) == 3:
                done.set()

        timer = DueTimer(loop, wake)
        now = loop.time()
        for delay in (0.3, 0.1, 0.2, 10 * 86400):
            timer.at(now + delay)
        kept = len(timer)
        await asyncio.wait_for(done.wait(), 5)
        timer.close()
        return [at - now for at in woken], kept

    woken, kept = asyncio.run(scenario())
    assert kept == 3  # a run that sleeps ten days is left to the poll
    assert [round(at, 1) for at in woken] == [0.1, 0.2, 0.3]
