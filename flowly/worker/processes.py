"""Several worker processes under one command: ``flowly worker --processes N``.

A worker runs its Python on one core. Where the machine has cores to spare, a second
process drains about half as much again (two processes drained 1.47 to 1.53 times one on
two cores, see bench/RESULTS.md), so one command, one systemd unit or one container can use
them all. The supervisor starts N copies of the same ``flowly worker`` command, each a worker of its
own (its own worker id, connections and leases), and:

- passes SIGTERM and SIGINT on to them, and exits once they all have (each drains and
  releases its runs as a lone worker does); a second SIGTERM or SIGINT kills the workers
  still running (one frozen by SIGSTOP, a paused container, never acts on its SIGTERM);
- replaces one that ended (killed by the OOM killer, a segfault, a stray ``kill -9``, or a
  step that ended its process) after a pause, which grows while its replacements die young;
  the runs it held are taken over when their leases expire, as for any crashed worker, and
  a run that kills every worker that takes it ends as poison;
- stops them all when one could not start: a worker that exits with an error of its own
  (status 1 or 2, its ``error:`` line saying why) within seconds of its start met what it
  cannot mend (a database or a role that does not exist, a schema it refuses), which every
  copy and every replacement would meet again. The supervisor then exits with its status.

On Linux each worker is sent SIGTERM when its supervisor dies, so a ``kill -9`` of the
supervisor leaves no worker running unsupervised.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from types import FrameType

logger = logging.getLogger(__name__)

# how often the supervisor looks at its workers (it has nothing else to do)
_LOOK_EVERY = 0.1
# the pause before a worker that ended is replaced: at first, at most (short: while a run
# that kills every worker that takes it is on its way to poison, the paused places serve
# nothing); a replacement that lived _SETTLED seconds counts as healthy, and the next pause
# starts again from the first
_FIRST_PAUSE, _MAX_PAUSE, _SETTLED = 0.5, 5.0, 60.0
# how soon after its start a worker's exit with an error of its own says that it could not
# start (a refused connection or schema is told within a second; a database that cannot be
# reached yet is waited for, not an error)
_STARTING = 10.0
_PR_SET_PDEATHSIG = 1


@dataclass
class _Slot:
    """One of the N places a worker process fills, through its replacements."""

    number: int
    process: subprocess.Popen[bytes] | None = None
    started: float = 0.0
    pause: float = _FIRST_PAUSE
    replace_at: float | None = None
    told_to_stop: bool = False


def supervise(command: Sequence[str], processes: int, env: Mapping[str, str],
              own_errors: Collection[int]) -> int:
    """Run ``processes`` copies of ``command``, each replaced when it ends, until a signal
    stops them or one of them could not start (exited with one of ``own_errors``, the
    statuses the command exits with for an error of its own, soon after its start); returns
    the exit status for the supervisor (0, or the status of the worker that could not
    start)."""
    slots = [_Slot(number) for number in range(1, processes + 1)]
    stopping = signalled = False
    status = 0

    def stop(signum: int, _frame: FrameType | None) -> None:
        nonlocal stopping, signalled
        # noted first: a second signal may run this again while the first one logs
        signalled_before, signalled, stopping = signalled, True, True
        if signalled_before:
            _kill_all(slots, _signal_name(signum))
            return
        logger.info("%s: stopping the %d worker processes", _signal_name(signum), processes)
        _stop_all(slots)

    before_exec = _stopped_with(os.getpid())
    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        for slot in slots:
            _start(slot, command, env, before_exec)
        while True:
            now = time.monotonic()
            for slot in slots:
                process = slot.process
                if process is not None and process.poll() is not None:
                    slot.process = None
                    if stopping:
                        continue
                    if (process.returncode in own_errors
                            and now - slot.started < _STARTING):
                        logger.error("worker process %d (pid %d) could not start (exit status"
                                     " %d); stopping the others", slot.number, process.pid,
                                     process.returncode)
                        status = process.returncode
                        stopping = True
                        _stop_all(slots)
                    else:
                        _schedule_replacement(slot, process, now)
                if (not stopping and slot.process is None and slot.replace_at is not None
                        and now >= slot.replace_at):
                    _start(slot, command, env, before_exec)
            if stopping:
                # a process started while the signal was being handled is told here
                _stop_all(slots)
                if all(slot.process is None for slot in slots):
                    return status
            time.sleep(_LOOK_EVERY)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        _stop_all(slots)  # only if the supervisor itself failed


def _start(slot: _Slot, command: Sequence[str], env: Mapping[str, str],
           before_exec: Callable[[], None] | None) -> None:
    slot.process = subprocess.Popen(command, env=dict(env), preexec_fn=before_exec)
    slot.started = time.monotonic()
    slot.replace_at = None
    slot.told_to_stop = False
    logger.info("worker process %d started (pid %d)", slot.number, slot.process.pid)


def _schedule_replacement(slot: _Slot, process: subprocess.Popen[bytes], now: float) -> None:
    if now - slot.started >= _SETTLED:
        slot.pause = _FIRST_PAUSE
    code = process.returncode
    how = f"was killed by {_signal_name(-code)}" if code < 0 else f"exited with status {code}"
    logger.warning("worker process %d (pid %d) %s; another starts in %gs", slot.number,
                   process.pid, how, slot.pause)
    slot.replace_at = now + slot.pause
    slot.pause = min(slot.pause * 2, _MAX_PAUSE)


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:  # a real-time signal, say
        return f"signal {number}"


def _stop_all(slots: Sequence[_Slot]) -> None:
    """SIGTERM, once, to each worker process not yet told to stop."""
    for slot in slots:
        if slot.process is not None and not slot.told_to_stop and slot.process.poll() is None:
            slot.process.send_signal(signal.SIGTERM)
            slot.told_to_stop = True


def _kill_all(slots: Sequence[_Slot], why: str) -> None:
    """SIGKILL to each worker process still running (told to stop, it has not)."""
    for slot in slots:
        if slot.process is not None and slot.process.poll() is None:
            logger.warning("%s again: killing worker process %d (pid %d), which has not"
                           " stopped", why, slot.number, slot.process.pid)
            slot.process.kill()


def _stopped_with(supervisor: int) -> Callable[[], None] | None:
    """What a worker runs before it starts, on Linux: SIGTERM to itself when its supervisor
    dies (at once if it died already)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None

    def preexec() -> None:
        # until the exec, the supervisor's own handler would only note a SIGTERM
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != supervisor:
            os._exit(1)

    return preexec
