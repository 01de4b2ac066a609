"""Retry policies for steps.

A :class:`Retry` only describes the policy; the database decides, when a step fails, whether
another attempt is due and when (``fail_step`` / ``backoff_delay`` in SQL), so every worker
and every SQL caller computes the same backoff.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Literal

from .arguments import at_least, duration
from .errors import InvalidArgument

Backoff = Literal["fixed", "linear", "exponential"]

# the longest delay between two attempts, as the engine's backoff_delay allows
MAX_RETRY_DELAY = 365 * 86_400.0


def _seconds(value: float | timedelta) -> float:
    return value.total_seconds() if isinstance(value, timedelta) else float(value)


@dataclass(frozen=True)
class Retry:
    """How often a failing step is tried and how long to wait between attempts.

    ``max_attempts`` counts every attempt, the first included (1 means no retry). The delay
    before attempt n+1 is ``initial_delay`` (fixed), ``initial_delay * n`` (linear) or
    ``initial_delay * 2**(n-1)`` (exponential), capped at ``max_delay``.
    """

    max_attempts: int = 3
    backoff: Backoff = "exponential"
    initial_delay: float | timedelta = 1.0
    max_delay: float | timedelta = 300.0

    def __post_init__(self) -> None:
        # the database's integer: a count past it failed the step's failure write itself
        at_least("Retry.max_attempts", self.max_attempts, 1)
        if self.backoff not in ("fixed", "linear", "exponential"):
            raise InvalidArgument(
                f"Retry.backoff must be 'fixed', 'linear' or 'exponential', got {self.backoff!r}"
            )
        for name, value in (("initial_delay", self.initial_delay),
                            ("max_delay", self.max_delay)):
            seconds = duration(f"Retry.{name}", value).total_seconds()
            if not 0 <= seconds <= MAX_RETRY_DELAY:
                raise InvalidArgument(f"Retry.{name} must be from 0 to {MAX_RETRY_DELAY:g}"
                                      f" seconds (a year), got {seconds}")

    @property
    def initial_delay_seconds(self) -> float:
        return _seconds(self.initial_delay)

    @property
    def max_delay_seconds(self) -> float:
        return _seconds(self.max_delay)

