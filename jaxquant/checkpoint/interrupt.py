"""SIGINT / SIGTERM during a checkpoint write: an exception, raised once, so the staging directory is removed.

The first SIGINT or SIGTERM raises :class:`Interrupted` (a ``KeyboardInterrupt``) in the main thread; later
ones are ignored while the exception unwinds and the staging directory is deleted, so the cleanup itself is
never cut short. A SIGKILL cannot be handled: it leaves a marked staging directory that the next write to
the same destination removes (``fsutil.remove_stale_staging``).
"""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import sys
import threading
import warnings

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(KeyboardInterrupt):
    """A write was interrupted by ``signum``; ``exit_code`` is the shell convention 128 + signum."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def signame(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def _raise_once(signum, _frame):
    for s in SIGNALS:  # the unwinding below removes staging directories: let nothing cut it short
        signal.signal(s, signal.SIG_IGN)
    raise Interrupted(signum)


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


@contextlib.contextmanager
def cli_handlers():
    """For a command: SIGINT/SIGTERM raise :class:`Interrupted` (once) until the block ends.

    Signals that were blocked while the process started (a supervisor may start us with them blocked so that
    none is lost before the handlers exist) are unblocked once the handlers are in place, so one may be raised
    on entering the block: catch :class:`Interrupted` around the ``with``.
    """
    if not _in_main_thread():
        yield
        return
    previous = {s: signal.getsignal(s) for s in SIGNALS}
    for s in SIGNALS:
        signal.signal(s, _raise_once)
    try:
        if hasattr(signal, "pthread_sigmask"):  # POSIX
            signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


@contextlib.contextmanager
def default_signals_clean_up():
    """Around a write called from library code (``save_dcp``, ``convert``).

    Signals still at their default disposition (SIGINT: ``KeyboardInterrupt``; SIGTERM: terminate) become
    a one-shot :class:`Interrupted`, so the write's own ``except`` removes its staging directory without being
    interrupted again; a SIGTERM then terminates the process as the default disposition would have. Handlers
    the program installed itself are left alone.
    """
    if not _in_main_thread():
        yield
        return
    defaults = {signal.SIGINT: signal.default_int_handler, signal.SIGTERM: signal.SIG_DFL}
    taken = {s: h for s, h in defaults.items() if signal.getsignal(s) is h}
    for s in taken:
        signal.signal(s, _raise_once)
    try:
        yield
    except Interrupted as e:
        if e.signum in taken:
            for s, h in taken.items():
                signal.signal(s, h)
            taken = {}
            if e.signum == signal.SIGTERM:
                os.kill(os.getpid(), signal.SIGTERM)  # cleaned up: now terminate as SIGTERM would have
        raise
    finally:
        for s, h in taken.items():
            signal.signal(s, h)


@contextlib.contextmanager
def deferred():
    """Hold SIGINT/SIGTERM for a short critical section (marker removal + rename); deliver them after."""
    if not _in_main_thread():
        yield
        return
    caught = []
    previous = {s: signal.getsignal(s) for s in SIGNALS}
    for s in SIGNALS:
        signal.signal(s, lambda signum, _frame: caught.append(signum))
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        for signum in caught[:1]:
            signal.raise_signal(signum)


def report(message: str, e: Interrupted) -> int:
    """Print the one line an interrupted command ends with; its exit status.

    What the interrupted code left half-built (an asyncio loop inside Orbax, unawaited coroutines) is freed
    here with its ``__del__`` complaints silenced: the process is about to exit and the line above says why.
    """
    if _in_main_thread():
        for s in SIGNALS:  # exiting: a second signal must not turn the line below into a traceback
            signal.signal(s, signal.SIG_IGN)
    print(message, file=sys.stderr, flush=True)
    e.__traceback__ = e.__context__ = None  # lets the interrupted frames go now
    sys.unraisablehook = lambda _unraisable: None
    warnings.simplefilter("ignore")
    gc.collect()
    return e.exit_code
