"""JSON nested deeper than Python's recursion limit: a run's input or an event payload written
from SQL reaches the workflow like any other value, and never takes the worker, or the runs
claimed with it, down (flowly.deep_json)."""

from __future__ import annotations

import json
import random
from typing import Any

import psycopg
import pytest

import flowly
from flowly.deep_json import loads
from tests.support import running_worker, scalar, wait_for
from tests.test_cli import flowly as flowly_cli
from tests.test_cli import ok

DEPTH = 5_000  # json.loads gives up at about 1,000


def _nested(depth: int) -> str:
    """Arrays nested ``depth`` deep, as JSON text."""
    return "[" * depth + "]" * depth


def _depth(value: Any) -> int:
    """How deep ``value``'s first elements nest arrays, counted without recursion."""
    depth = 0
    while isinstance(value, list):
        value, depth = value[0] if value else None, depth + 1
    return depth


@flowly.workflow("dj_depths")
async def dj_depths(ctx: flowly.Context, inp: Any) -> Any:
    """The depth of its input and of the payload of an event it waits for."""
    payload = await ctx.wait_for_event("deep")
    return await ctx.step("depths", lambda: [_depth(inp), _depth(payload)])


def test_a_deep_input_and_event_reach_the_workflow_and_the_runs_beside_them_finish(
    dsn: str, client: flowly.Client, db: psycopg.Connection[Any]
) -> None:
    """A run whose input nests 5,000 levels, claimed with ten ordinary runs: psycopg's
    json.loads raised RecursionError inside the claim's fetch, and the worker crashed. Its
    event payload, as deep, comes back from a replay page after the run parked."""
    shallow = [client.start("dj_depths", []) for _ in range(10)]
    deep = scalar(db, "select flowly.start('dj_depths', %s::jsonb)", _nested(DEPTH))
    with running_worker(dsn, workflows=[dj_depths]):  # raises here if the worker crashed
        wait_for(lambda: scalar(db, "select count(*) from flowly.waits") == 11,
                 what="every run parked on its event")
        for run_id in shallow:
            client.send_event(run_id, "deep", [[]])
        db.execute("select flowly.send_event(%s, 'deep', %s::jsonb)", (deep, _nested(DEPTH)))
        runs = [client.wait(run_id, timeout=30) for run_id in [*shallow, deep]]
    assert [r.status for r in runs] == ["completed"] * 11, [r.error for r in runs]
    assert [r.output for r in runs] == [[1, 2]] * 10 + [[DEPTH, DEPTH]]
    assert _depth(client.get(deep).input) == DEPTH  # the client reads it too


@flowly.workflow("dj_echo")
async def dj_echo(ctx: flowly.Context, inp: Any) -> Any:
    """Its input back, through a step's checkpoint."""
    return await ctx.step("echo", lambda: inp)


def test_a_deep_value_goes_back_into_the_database_as_it_came(
    dsn: str, client: flowly.Client
) -> None:
    """A value read past json's depth is written back without recursion too: a step's output,
    a run's output, and a client's start (json.dumps refused it: StepOutputNotSerializable,
    InvalidArgument)."""
    run_id = client.start("dj_echo", loads(_nested(DEPTH)))
    with running_worker(dsn, workflows=[dj_echo]):
        run = client.wait(run_id, timeout=30)
    assert run.status == "completed", run.error
    assert _depth(run.output) == DEPTH
    (step,) = client.steps(run_id)
    assert _depth(step.output) == DEPTH


def test_a_hand_off_of_a_deep_input_reaches_the_workflow(
    dsn: str, client: flowly.Client, db: psycopg.Connection[Any]
) -> None:
    """A start handed to an idle worker carries the input in its notification when it is
    stored in less than 7,900 bytes: arrays 980 deep are (8 bytes a level), and json.loads,
    called some frames down the worker's stack, gives up before that depth."""
    with running_worker(dsn, workflows=[dj_depths], poll_interval=30):
        wait_for(lambda: scalar(db, "select count(*) from flowly.handoff_slots"),
                 what="the idle worker's offer")
        run_id = scalar(db, "select flowly.start('dj_depths', %s::jsonb)", _nested(980))
        wait_for(lambda: scalar(db, "select count(*) from flowly.waits"),
                 what="the run parked on its event, handed off")
        # handed off: its start wrote it as started (a claim starts it later)
        assert scalar(db, "select started_at = created_at from flowly.runs where id = %s",
                      run_id)
        client.send_event(run_id, "deep", None)
        run = client.wait(run_id, timeout=30)
    assert (run.status, run.output) == ("completed", [980, 0])


def test_the_command_line_shows_a_run_with_a_deep_input(
    dsn: str, db: psycopg.Connection[Any]
) -> None:
    """`flowly show` and `flowly --json show` wrote the run with json.dumps and
    dataclasses.asdict, which recurse: a traceback instead of the run."""
    run_id = scalar(db, "select flowly.start('dj_depths', %s::jsonb)", _nested(DEPTH))
    assert "[[[[[[" in ok(flowly_cli("show", run_id, dsn=dsn))
    shown = loads(ok(flowly_cli("--json", "show", run_id, dsn=dsn)))
    assert _depth(shown["run"]["input"]) == DEPTH
    (listed,) = loads(ok(flowly_cli("--json", "runs", dsn=dsn)))
    assert listed["id"] == run_id


def _random_document(depth: int = 0) -> Any:
    roll = random.random()
    if depth > 5 or roll < 0.3:
        return random.choice([None, True, False, random.randint(-10**20, 10**20),
                              random.random() * 1e10, 'quote " back \\ é \u2028' * 2])
    if roll < 0.65:
        return [_random_document(depth + 1) for _ in range(random.randint(0, 4))]
    return {f"k{i}": _random_document(depth + 1) for i in range(random.randint(0, 4))}


def test_the_decoder_without_recursion_reads_what_json_loads_reads() -> None:
    """Past the recursion limit the value is read by flowly's own loop: it must agree with
    json.loads wherever both can read, and refuse what json.loads refuses."""
    from flowly.deep_json import _loads_without_recursion as decode

    rng_state = random.getstate()
    random.seed(11)
    try:
        for _ in range(500):
            text = json.dumps(_random_document(), indent=random.choice([None, 1]))
            assert decode(text) == json.loads(text), text
    finally:
        random.setstate(rng_state)
    for bad in ["[1,]", '{"a" 1}', "[1", '{"a": 1,}', "[1] x", "", "{1: 2}", "nul", '["a]']:
        with pytest.raises(json.JSONDecodeError):
            decode(bad)
    assert _depth(loads(_nested(100_000).encode())) == 100_000


def test_loads_reads_what_json_loads_reads_and_refuses_it_the_same_way() -> None:
    """loads scans a value without json.loads's wrapper when nothing surrounds it (jsonb's
    text): with or without white space, as text or UTF-8 bytes, it must read what json.loads
    reads, and refuse what json.loads refuses with json.loads's own message."""
    rng_state = random.getstate()
    random.seed(12)
    try:
        for _ in range(500):
            text = json.dumps(_random_document(), indent=random.choice([None, 1]),
                              ensure_ascii=random.choice([True, False]))
            text = random.choice(["", " ", "\n"]) + text + random.choice(["", " ", "\n"])
            assert loads(text) == json.loads(text), text
            assert loads(text.encode()) == json.loads(text), text
    finally:
        random.setstate(rng_state)
    for bad in ["[1,]", '{"a" 1}', "[1", "[1] x", "1 2", "", " ", "nul", '["a]', '"\\x"']:
        with pytest.raises(json.JSONDecodeError) as refused:
            loads(bad)
        with pytest.raises(json.JSONDecodeError) as expected:
            json.loads(bad)
        assert str(refused.value) == str(expected.value), bad
    assert loads("NaN") != loads("NaN")  # as json.loads reads it
    assert _depth(loads(" " + _nested(DEPTH))) == DEPTH
