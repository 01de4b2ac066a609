"""Attacks on the idle-worker latency path, as production would make them: workers frozen,
killed or stopped with a slot offered, starts whose transactions roll back or stay open, a
burst of starts against several worker processes, and runs announced due later whose start
or worker connections misbehave. Each test checks what the README promises: the run executes
once (never twice at once), none is lost, none waits for a poll it was promised not to."""

from __future__ import annotations

import signal
import threading
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg

import flowly
from tests.support import running_worker, scalar, wait_for, worker_process


def handed_off(db: psycopg.Connection[Any], run_id: str) -> bool:
    return bool(scalar(db, "select started_at = created_at from flowly.runs where id = %s",
                       run_id))


def offered(db: psycopg.Connection[Any], worker: str) -> bool:
    return bool(scalar(db, "select count(*) from flowly.handoff_slots where worker_id = %s",
                       worker))


def effects(db: psycopg.Connection[Any], run_id: str) -> list[tuple[str, int]]:
    return db.execute("select step, pid from public.test_effects where run_id = %s"
                      " order by at", (run_id,)).fetchall()


def test_a_slot_a_start_held_while_its_worker_stopped_takes_no_more_runs(
        dsn: str, db: psycopg.Connection[Any], client: flowly.Client) -> None:
    """A worker that stops withdraws its offer, but a slot a start holds in an open
    transaction is skipped, not waited for. That start's commit must not offer the slot of a
    worker that is gone again (the starts after it would be handed to nobody, each waiting
    out its first lease while a live worker sits idle), nor leave its own run to that lease."""
    open_tx = psycopg.connect(dsn)
    with running_worker(dsn, workflows=["echo"], concurrency=4, poll_interval=0.2) as gone:
        wait_for(lambda: offered(db, gone.worker_id), what="an idle slot offered")
        held = scalar(open_tx, "select flowly.start('echo', '{\"value\": \"held\"}')")
        assert scalar(open_tx, "select locked_by from flowly.runs where id = %s",
                      held) == gone.worker_id
    # the worker has stopped (and unregistered); the start commits only now
    with open_tx, running_worker(dsn, workflows=["echo"], concurrency=4,
                                 poll_interval=0.2) as live:
        wait_for(lambda: offered(db, live.worker_id), what="the live worker's slot offered")
        open_tx.commit()
        committed = time.monotonic()
        assert client.wait(held, timeout=15).output == "held"
        waits = [time.monotonic() - committed]
        for value in range(3):
            started = time.monotonic()
            run_id = client.start("echo", {"value": value})
            assert client.wait(run_id, timeout=15).output == value
            waits.append(time.monotonic() - started)
    # neither the held run nor those after it wait out a 5 s first lease for the worker gone
    assert max(waits) < 2, waits
    assert scalar(db, "select count(*) from flowly.handoff_slots where worker_id = %s",
                  gone.worker_id) == 0


def test_runs_handed_to_a_frozen_worker_with_room_reach_another_within_their_first_lease(
        dsn: str, db: psycopg.Connection[Any], client: flowly.Client) -> None:
    """A worker frozen (SIGSTOP) with a slot offered for eight runs takes eight starts on their
    5 s first leases; the next starts go the claim way at once. A live worker takes the eight
    once those leases lapse, and the frozen worker, resumed, begins none of them."""
    with worker_process(dsn, "--lease", "30", "--concurrency", "8") as frozen:
        wait_for(lambda: scalar(db, "select room from flowly.handoff_slots") == 7,
                 what="an idle slot offered with room for seven more runs")
        frozen_id = scalar(db, "select worker_id from flowly.handoff_slots")
        frozen.signal(signal.SIGSTOP)
        with worker_process(dsn, "--lease", "30") as live:
            wait_for(lambda: scalar(db, "select count(distinct worker_id)"
                                        " from flowly.handoff_slots") == 2,
                     what="the live worker's slot offered")
            started = time.monotonic()
            run_ids = [client.start("three_steps", {"step_seconds": 0}) for _ in range(10)]
            holders = [scalar(db, "select locked_by from flowly.runs where id = %s", run_id)
                       for run_id in run_ids]
            runs = [client.wait(run_id, timeout=30) for run_id in run_ids]
            waited = time.monotonic() - started
            frozen.signal(signal.SIGCONT)  # it reads the eight hand-offs only now
            time.sleep(2)
            said = frozen.stop()
            live.stop()
    assert holders[:8] == [frozen_id] * 8 and frozen_id not in holders[8:], holders
    assert [run.status for run in runs] == ["completed"] * 10, said
    assert waited < 8, waited  # the first leases (5 s) and a poll, not a whole lease
    for run_id in run_ids:
        assert [pid for _, pid in effects(db, run_id)] == [live.pid] * 3
    assert said.count("too late to run") == 8, said


def test_a_run_handed_to_a_worker_killed_as_the_hand_off_commits_runs_once_after_its_first_lease(
        dsn: str, db: psycopg.Connection[Any], client: flowly.Client) -> None:
    """The hand-off's NOTIFY is in flight when its worker dies (SIGKILL): the run is taken over
    by a live worker once its first lease lapses, not a whole lease later, and runs once."""
    with worker_process(dsn, "--lease", "30") as doomed:
        doomed_id = wait_for(lambda: scalar(db, "select worker_id from flowly.handoff_slots"),
                             what="an idle slot offered")
        doomed.signal(signal.SIGSTOP)  # so the notification is not read before the kill
        run_id = client.start("three_steps", {"step_seconds": 0})
        started = time.monotonic()
        doomed.kill()
        assert scalar(db, "select locked_by from flowly.runs where id = %s", run_id) == doomed_id
        with worker_process(dsn, "--lease", "30") as live:
            run = client.wait(run_id, timeout=30)
            waited = time.monotonic() - started
            live.stop()
    assert run.status == "completed"
    assert 4.5 < waited < 8, waited
    assert [pid for _, pid in effects(db, run_id)] == [live.pid] * 3
    assert scalar(db, "select lease_epoch from flowly.runs where id = %s", run_id) == 2


def test_a_start_rolled_back_whole_leaves_the_slot_offered_and_sends_nothing(
        dsn: str, db: psycopg.Connection[Any], client: flowly.Client) -> None:
    """A top-level ROLLBACK of a start that took a slot (its commit trigger never fires): the
    same slot is offered again, untouched, no run reaches the worker, and the next start is
    handed to it."""
    with running_worker(dsn, workflows=["three_steps"], poll_interval=30) as worker:
        wait_for(lambda: offered(db, worker.worker_id), what="an idle slot offered")
        slot = db.execute("select id, room from flowly.handoff_slots").fetchone()
        with psycopg.connect(dsn) as tx:
            phantom = scalar(tx, "select flowly.start('three_steps', '{}')")
            assert scalar(tx, "select locked_by from flowly.runs where id = %s",
                          phantom) == worker.worker_id
            tx.rollback()
        assert db.execute("select id, room from flowly.handoff_slots"
                          " where handed_run_id is null").fetchone() == slot
        time.sleep(1)
        assert effects(db, phantom) == []
        again = client.start("three_steps", {})
        assert client.wait(again, timeout=15).status == "completed"
    assert handed_off(db, again)
    assert scalar(db, "select count(*) from flowly.runs where id = %s", phantom) == 0


def test_a_hand_off_committed_after_its_first_lease_runs_once_with_another_worker_claiming(
        dsn: str, db: psycopg.Connection[Any], client: flowly.Client) -> None:
    """At the commit of a transaction open longer than the hand-off's first lease, the run is
    claimable at once: the worker it was handed to confirms it while another worker's poll
    may claim it. Whichever wins, each step runs once."""
    for _ in range(3):
        with running_worker(dsn, workflows=["three_steps"], lease=2,
                            poll_interval=30) as handed_to, \
                psycopg.connect(dsn) as tx:
            wait_for(lambda: offered(db, handed_to.worker_id), what="an idle slot offered")
            run_id = scalar(tx, "select flowly.start('three_steps', '{}')")
            assert scalar(tx, "select locked_by from flowly.runs where id = %s",
                          run_id) == handed_to.worker_id
            with running_worker(dsn, workflows=["three_steps"], lease=2, poll_interval=0.01):
                time.sleep(2.3)  # the first lease (2 s) lapses before the commit
                tx.commit()
                assert client.wait(run_id, timeout=20).status == "completed"
        # each step begun once: no execution of it besides the one that won
        assert [step for step, _ in effects(db, run_id)] == ["a", "b", "c"]


def test_a_burst_of_starts_against_four_idle_worker_processes_runs_each_once_without_a_poll(
        dsn: str, db: psycopg.Connection[Any]) -> None:
    """Four idle worker processes (polling once a minute) and starts from four threads at
    once: each run's steps run once, whether it was handed off or claimed on a wake-up, and
    none waits for a poll."""
    workers = [worker_process(dsn, "--lease", "30", "--poll-interval", "60",
                              "--concurrency", "4") for _ in range(4)]
    procs = [w.__enter__() for w in workers]
    try:
        wait_for(lambda: scalar(db, "select count(distinct worker_id)"
                                    " from flowly.handoff_slots") == 4,
                 what="four idle workers offering slots")
        ids: list[str] = []
        lock = threading.Lock()

        def start_some() -> None:
            with flowly.Client(dsn) as own:
                for _ in range(15):
                    run_id = own.start("three_steps", {"step_seconds": 0})
                    with lock:
                        ids.append(run_id)

        started = time.monotonic()
        threads = [threading.Thread(target=start_some) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        with flowly.Client(dsn) as client:
            statuses = [client.wait(run_id, timeout=50).status for run_id in ids]
        waited = time.monotonic() - started
    finally:
        said = [w.stop() for w in procs]
        for w in workers:
            w.__exit__(None, None, None)
    assert statuses == ["completed"] * 60, said
    assert waited < 20, waited  # not the minute's poll
    assert db.execute("select count(*), count(distinct (run_id, step)) from public.test_effects"
                      " where run_id = any(%s)", (ids,)).fetchone() == (180, 180)
    assert scalar(db, "select count(*) from flowly.runs where id = any(%s)"
                      " and started_at = created_at", ids) > 0


def test_a_run_announced_due_later_starts_on_time_whatever_its_start_and_connections_do(
        dsn: str, db: psycopg.Connection[Any], client: flowly.Client) -> None:
    """Runs due 0.2 s (and 1.5 s) after their start, with a worker that polls once a minute:
    one whose start commits after its due time is claimed at the commit; one cancelled before
    its due time never runs; one announced before all the worker's connections are cut
    (pg_terminate_backend, as a server restart does) is still claimed at its time."""
    with running_worker(dsn, workflows=["three_steps"], poll_interval=60) as worker:
        wait_for(lambda: offered(db, worker.worker_id), what="the worker idle")
        # committed late: announced at commit with a time already past
        with psycopg.connect(dsn) as tx:
            late = scalar(tx, "select flowly.start('three_steps', '{}',"
                              " scheduled_for => clock_timestamp() + interval '0.2 seconds')")
            time.sleep(1)
        committed = time.monotonic()
        assert client.wait(late, timeout=30).status == "completed"
        assert time.monotonic() - committed < 2
        # cancelled before its time: the timer fires and the claim finds nothing
        cancelled = client.start("three_steps", {}, delay=0.5)
        assert client.cancel(cancelled) == "cancelled"
        # announced, then every connection of the worker cut before its due time
        due_at = datetime.now(UTC) + timedelta(seconds=1.5)
        cut = client.start("three_steps", {}, delay=1.5)
        time.sleep(0.3)  # the announcement has reached the worker
        assert scalar(db, "select count(pg_terminate_backend(pid)) from pg_stat_activity"
                          " where datname = current_database() and pid <> pg_backend_pid()"
                          " and application_name = 'flowly worker'") >= 1
        assert client.wait(cut, timeout=30).status == "completed"
        began = scalar(db, "select min(at) from public.test_effects where run_id = %s", cut)
        time.sleep(0.5)
    assert effects(db, cancelled) == []
    assert client.get(cancelled).status == "cancelled"
    assert timedelta(0) <= began - due_at < timedelta(seconds=2.5), began - due_at


def test_a_run_announced_due_later_while_the_worker_s_listener_was_down_starts_on_time(
        dsn: str, db: psycopg.Connection[Any], client: flowly.Client) -> None:
    """A run started to be due later is announced by NOTIFY; a worker whose LISTEN connection
    had just been cut (a terminated backend, a restarted pooler) hears nothing of it. Once it
    listens again it must still claim the run when it comes due, not at its next poll (a
    minute here), as it does for runs handed to it meanwhile (0054)."""
    with worker_process(dsn, "--lease", "30", "--poll-interval", "60") as deaf:
        wait_for(lambda: scalar(db, "select channel from flowly.handoff_slots"),
                 what="the worker idle")
        deaf.signal(signal.SIGSTOP)
        assert scalar(db, "select count(pg_terminate_backend(listener_pid))"
                          " from flowly.workers where listener_pid is not null") == 1
        due_at = datetime.now(UTC) + timedelta(seconds=2)
        run_id = client.start("three_steps", {}, delay=2)
        deaf.signal(signal.SIGCONT)
        run = client.wait(run_id, timeout=20)
        said = deaf.stop()
    assert run.status == "completed", said
    began = scalar(db, "select min(at) from public.test_effects where run_id = %s", run_id)
    assert timedelta(0) <= began - due_at < timedelta(seconds=2.5), (began - due_at, said)


def test_runs_handed_off_and_claimed_in_a_race_never_exceed_the_worker_s_concurrency(
        dsn: str, db: psycopg.Connection[Any]) -> None:
    """Starts from four sessions, some committed at once and some after a while in an open
    transaction, while the worker of concurrency 2 claims, offers slots and is handed runs
    all at once: at no moment do more than two of its steps run. A step's span is its
    recorded start and end, each narrowed by 20 ms for the two clocks that write them."""
    def start_runs(offset: int) -> None:
        with psycopg.connect(dsn, autocommit=True) as conn:
            for i in range(10):
                inp = psycopg.types.json.Jsonb({"value": offset + i, "wait": 0.15})
                if i % 3 == 0:
                    with conn.transaction():
                        conn.execute("select flowly.start('echo', %s)", (inp,))
                        time.sleep(0.05 * (i % 4))
                else:
                    conn.execute("select flowly.start('echo', %s)", (inp,))
                time.sleep(0.01 * (offset % 7))

    with running_worker(dsn, workflows=["echo"], concurrency=2, poll_interval=60) as worker:
        wait_for(lambda: offered(db, worker.worker_id), what="an idle slot offered")
        starters = [threading.Thread(target=start_runs, args=(100 * n,)) for n in range(4)]
        for thread in starters:
            thread.start()
        for thread in starters:
            thread.join()
        wait_for(lambda: scalar(db, "select count(*) from flowly.runs"
                                    " where status = 'completed'") == 40,
                 timeout=60, what="every run completed")
    most = scalar(db, """
        with spans as (
            select started_at + interval '20 ms' as s, finished_at - interval '20 ms' as e
            from flowly.steps)
        select max((select count(*) from spans o where o.s <= p.s and o.e > p.s))
        from spans p""")
    assert most <= 2, f"{most} steps ran at once on a worker of concurrency 2"
