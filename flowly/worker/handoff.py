"""Runs that ``start`` hands straight to this worker while it waits idle (migration 0030).

A worker whose claim left it a free slot offers one (``claim_and_offer``); ``start`` takes an
offered slot, claims the run for that worker in its own transaction and sends it the run on
the worker's own channel. At commit the worker has what a claim would have returned, without
a claim's round trip: the enqueue-to-first-step path is the start's commit and one NOTIFY.

The run's first lease is short (``handoff_lease``), so the worker extends it at once with a
heartbeat; everything else (fencing, heartbeats, release) is as for a claimed run.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ClaimedRun:
    """What a claim (or a hand-off) gives the worker to execute a run."""

    run_id: str
    workflow: str
    status: str
    input: Any
    attempt: int
    generation: int
    epoch: int
    has_history: bool


def parse_handoff(payload: str) -> tuple[ClaimedRun, float] | None:
    """The run a hand-off NOTIFY carries and the seconds of its first lease, or None (logged)
    if the payload is not one: the worker then claims as usual, and the run, if there is one,
    reaches it that way."""
    try:
        fields: dict[str, Any] = json.loads(payload)
        return ClaimedRun(
            run_id=str(fields["run_id"]),
            workflow=str(fields["workflow"]),
            # only new runs are handed off (insert_handed_off_run)
            status="running",
            input=fields["input"],
            attempt=int(fields["attempt"]),
            generation=int(fields["generation"]),
            epoch=int(fields["lease_epoch"]),
            has_history=False,
        ), float(fields["lease_seconds"])
    except (ValueError, TypeError, KeyError) as exc:
        logger.warning("ignoring a hand-off notification that is not one (%s): %.200r",
                       exc, payload)
        return None
