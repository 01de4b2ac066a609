"""Runs that ``start`` hands straight to this worker while it waits idle (migration 0030).

A worker whose claim left it a free slot offers one (``claim_and_offer``); ``start`` takes an
offered slot, claims the run for that worker in its own transaction and sends it the run on
the worker's own channel. At commit the worker has what a claim would have returned, without
a claim's round trip: the enqueue-to-first-step path is the start's commit and one NOTIFY.
The commit offers the slot again while the worker has room (the slot counts it down) and uses
it up after; the worker then offers another with ``offer_slot`` alone (migration 0067), since
a claim would find nothing that no wake-up announces.

The run's first lease is short (``handoff_lease``), so the worker extends it with a heartbeat
once half of it is left, if the run still runs (most end sooner, and cost no call); everything
else (fencing, heartbeats, release) is as for a claimed run. A run read late (its start's
transaction committed long after the start, or the worker was frozen or its event loop
blocked) may have lost that lease to a claim already: the payload says when the
lease ends on the server's clock, and a worker that cannot tell that enough of it is left
confirms the run with a heartbeat before it begins it (migration 0032).

A worker offers slots only once a notification it sent itself, from another session, has
reached its listener (``ListenerProbe``). Behind a pooler in transaction mode none does: the
server connection that ran its LISTEN serves other clients meanwhile, and a run handed to it
would wait out its whole first lease before a claim took it.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from typing import Any

from .. import deep_json

logger = logging.getLogger(__name__)


class ListenerProbe:
    """The payloads a worker sends to its own hand-off channel to learn whether notifications
    reach its listener: one token per listening connection, so a probe of a former listener
    arriving late proves nothing about this one."""

    PREFIX = "probe "

    def __init__(self) -> None:
        self.payload = f"{self.PREFIX}{uuid.uuid4().hex}"

    @classmethod
    def is_probe(cls, payload: str) -> bool:
        return payload.startswith(cls.PREFIX)


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
    # the input was too large to come with the claim: the run reads it (``input`` is None)
    input_deferred: bool = False


@dataclass(frozen=True)
class HandOff:
    """A run start handed to this worker, and its first lease."""

    run: ClaimedRun
    lease_seconds: float
    # when the first lease ends on the server's clock (epoch seconds); None from a schema
    # before 0032, which did not say
    lease_until: float | None
    # whether the slot the run came by was used up, so the worker offers another (0067: the
    # room left in it, -1 for used up; a schema before it used every slot up)
    slot_used_up: bool = True


def parse_handoff(payload: str) -> HandOff | None:
    """The hand-off a NOTIFY carries, or None (logged) if the payload is not one: the worker
    then claims as usual, and the run, if there is one, reaches it that way."""
    try:
        fields: dict[str, Any] = deep_json.loads(payload)
        lease_until = fields.get("lease_until")
        room = fields.get("room")
        return HandOff(
            ClaimedRun(
                run_id=str(fields["run_id"]),
                workflow=str(fields["workflow"]),
                # only new runs are handed off (hand_off)
                status="running",
                input=fields["input"],
                attempt=int(fields["attempt"]),
                generation=int(fields["generation"]),
                epoch=int(fields["lease_epoch"]),
                has_history=False,
            ),
            lease_seconds=float(fields["lease_seconds"]),
            lease_until=None if lease_until is None else float(lease_until),
            slot_used_up=room is None or int(room) < 0,
        )
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        logger.warning("ignoring a hand-off notification that is not one (%s): %.200r",
                       exc, payload)
        return None
