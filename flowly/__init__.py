"""flowly: durable workflows in the PostgreSQL database you already have.

Workflows are async functions whose steps are checkpointed in Postgres; a crashed or
redeployed worker resumes each run at its last completed step. The state machine lives in
PL/pgSQL (``sql/``); this package registers workflows, runs them and talks to those functions.
"""

from .client import AsyncClient, Client, Run, Step
from .context import Context, Interrupt, SleepInterrupt
from .errors import (
    ChildFailed,
    DatabaseTimeout,
    EventTimeout,
    FlowlyError,
    InvalidArgument,
    InvalidState,
    LeaseLost,
    OutputTooLarge,
    RunBusy,
    RunNotFound,
    RunTimeout,
    SchemaError,
    SchemaNotInstalled,
    StepOutputNotSerializable,
    UnknownWorkflow,
    WorkflowCodeError,
)
from .retry import Retry
from .schedules import Schedule
from .schema import install, install_dsn
from .worker import Worker
from .workflow import Workflow, workflow

__version__ = "0.1.0"

__all__ = [
    "ChildFailed",
    "EventTimeout",
    "AsyncClient",
    "Client",
    "Context",
    "DatabaseTimeout",
    "FlowlyError",
    "Interrupt",
    "InvalidArgument",
    "InvalidState",
    "LeaseLost",
    "OutputTooLarge",
    "Retry",
    "Run",
    "RunBusy",
    "RunNotFound",
    "RunTimeout",
    "Schedule",
    "SchemaError",
    "SchemaNotInstalled",
    "SleepInterrupt",
    "Step",
    "StepOutputNotSerializable",
    "UnknownWorkflow",
    "Worker",
    "Workflow",
    "WorkflowCodeError",
    "__version__",
    "install",
    "install_dsn",
    "workflow",
]
