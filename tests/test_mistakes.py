"""Mistakes in a workflow's code fail the run at once, with a message that names them.

Retrying cannot help when the code itself is wrong (a step not awaited, a name used twice, an
output that is not JSON, an unknown start option, a body that does not take (ctx, input)),
so such a run fails on its first attempt instead of three.
"""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

import flowly
from tests.support import running_worker, scalar


@pytest.mark.parametrize(("workflow", "error_type", "message"), [
    ("forgets_await", "WorkflowCodeError", "returned without awaiting its step 'never'"),
    ("name_twice", "WorkflowCodeError", "name 'same' is used twice"),
    ("object_output", "StepOutputNotSerializable", "workflow 'object_output' returned a object"),
    ("bad_start_option", "WorkflowCodeError", "unknown start option(s): priorty"),
    ("no_input", "WorkflowCodeError", "must take (ctx, input)"),
])
def test_a_mistake_in_workflow_code_fails_the_run_at_once(
    dsn: str, client: flowly.Client, db: psycopg.Connection[Any], workflow: str,
    error_type: str, message: str,
) -> None:
    run_id = client.start(workflow, None, max_attempts=3)
    with running_worker(dsn, workflows=[workflow, "quick"]):
        run = client.wait(run_id, timeout=30)
    assert run.status == "dead_letter"
    assert run.attempt == 1, "retried a run that could never succeed"
    assert run.error["type"] == error_type
    assert message in run.error["message"]
    # the un-awaited step never ran
    assert scalar(db, "select count(*) from public.test_effects where run_id = %s", run_id) == 0
