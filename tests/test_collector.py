"""A worker raises the garbage collector's first threshold while it runs (the objects of runs
in flight, traversed again and again at the default, took 13 % of a drain's CPU), and puts
the process's own thresholds back when the last worker in the process ends; a process that
chose a higher threshold, or turned the collector off, keeps its choice."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

import flowly
from flowly.worker.collector import FIRST_THRESHOLD
from tests import workflows  # noqa: F401  (registers the test workflows)
from tests.support import running_worker


@pytest.fixture(autouse=True)
def process_thresholds() -> Iterator[tuple[int, int, int]]:
    """The default thresholds of CPython around each test, whatever the test changes."""
    saved, enabled = gc.get_threshold(), gc.isenabled()
    gc.set_threshold(700, 10, 10)
    gc.enable()
    yield gc.get_threshold()
    gc.set_threshold(*saved)
    if not enabled:
        gc.disable()


def settings_in_a_step(client: flowly.Client, queue: str = "default") -> list[object]:
    run = client.wait(client.start("collector_settings", queue=queue), timeout=30)
    assert run.status == "completed", run
    assert isinstance(run.output, list)
    return run.output


def test_a_running_worker_raises_the_first_threshold_and_puts_it_back(
        dsn: str, client: flowly.Client, process_thresholds: tuple[int, int, int]) -> None:
    with running_worker(dsn, workflows=["collector_settings"]):
        assert settings_in_a_step(client) == [True, FIRST_THRESHOLD, 10, 10]
    assert gc.get_threshold() == process_thresholds


def test_the_thresholds_come_back_when_the_last_of_two_workers_ends(
        dsn: str, client: flowly.Client, process_thresholds: tuple[int, int, int]) -> None:
    paced = [True, FIRST_THRESHOLD, 10, 10]
    with running_worker(dsn, workflows=["collector_settings"], queues=["first"]):
        assert settings_in_a_step(client, queue="first") == paced
        with running_worker(dsn, workflows=["collector_settings"]):
            assert settings_in_a_step(client) == paced
        # the first worker still runs: still paced for it
        assert settings_in_a_step(client, queue="first") == paced
    assert gc.get_threshold() == process_thresholds


@pytest.mark.parametrize("choice", ["higher threshold", "collector off"])
def test_a_process_that_chose_its_own_collector_settings_keeps_them(
        dsn: str, client: flowly.Client, choice: str) -> None:
    if choice == "higher threshold":
        gc.set_threshold(50_000, 20, 20)
        expected: list[object] = [True, 50_000, 20, 20]
    else:
        gc.disable()
        expected = [False, 700, 10, 10]
    with running_worker(dsn, workflows=["collector_settings"]):
        assert settings_in_a_step(client) == expected
    assert [gc.isenabled(), *gc.get_threshold()] == expected
