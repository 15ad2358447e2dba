"""SIGTERM and Ctrl-C (SIGINT): a run stops cleanly whenever one arrives.

A command installs the handlers first (`install`, before jax is imported), so no signal finds the
default action while a run is being set up. Until the training loop starts, a signal stops the
process at once: it raises `Interrupted` where the main thread is, and what the run had set up is
undone on the way out (its lock released, the entries it created and left empty removed). Inside
the loop (`StopRequest.deferred`), a signal asks the loop to stop after the step in progress — a
jitted step cannot be interrupted halfway anyway — with a checkpoint; a second signal gets the
default action: it stops at once. Once a loop has run, a first signal no longer interrupts
anything: the run is ending with its checkpoint.

`critical` holds signals back for a few lines that must not be cut in the middle (moving an
earlier run aside, replacing config.json): one that arrives there is delivered when they end.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from typing import Iterator

from absl import logging

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Interrupted(BaseException):
    """A SIGTERM or SIGINT before the training loop started: the run stops without training. A
    BaseException, as KeyboardInterrupt is, so that no ``except Exception`` on the way swallows it.
    ``signum``: the signal's number."""

    def __init__(self, signum: int):
        super().__init__(f"{signal.Signals(signum).name} before the first step")
        self.signum = signum


class StopRequest:
    """The process's SIGTERM / SIGINT handler (signals reach the main thread only)."""

    def __init__(self):
        self.signum: int | None = None
        self._deferring = False
        self._looped = False   # a loop ran: from then on no signal raises Interrupted
        # The signal that raised Interrupted before the loop: Python drops an exception raised
        # where the handler happened to run inside a finalizer or a gc callback (it prints
        # "Exception ignored in ..." and goes on), so the loop raises it again as it starts.
        self._before_loop: int | None = None
        self._previous: dict[int, object] = {}

    def install(self) -> "StopRequest":
        """Makes `_handle` the handler of both signals (again: a library may have replaced it —
        JAX's distributed runtime installs its own for SIGTERM)."""
        if threading.current_thread() is threading.main_thread():
            for signum in SIGNALS:
                previous = signal.signal(signum, self._handle)
                self._previous.setdefault(signum, previous)
        return self

    def uninstall(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}

    def _handle(self, signum, frame):
        del frame
        if not (self._deferring or self._looped):
            self._before_loop = signum
            raise Interrupted(signum)
        self.signum = signum
        for s in SIGNALS:   # a second signal stops at once
            signal.signal(s, signal.SIG_DFL if s == signal.SIGTERM else signal.default_int_handler)
        if self._deferring:
            logging.warning("%s: stopping after this step, with a checkpoint (again: stop now)",
                            signal.Signals(signum).name)
        else:
            logging.warning("%s: the run is ending with its checkpoint (again: stop now)",
                            signal.Signals(signum).name)

    @contextlib.contextmanager
    def deferred(self) -> Iterator["StopRequest"]:
        """The training loop: a signal asks it to stop after its step (``self.signum`` is set).
        A signal that came before, and whose `Interrupted` was lost, stops the run here."""
        if self._before_loop is not None:
            raise Interrupted(self._before_loop)
        self.signum, self._deferring, self._looped = None, True, True
        self.install()
        try:
            yield self
        finally:
            self._deferring = False
            self.install()   # after a first signal the handlers were the defaults


_installed: StopRequest | None = None


def install() -> StopRequest:
    """Installs the process's handlers (a command calls it first thing in ``main``), and keeps an
    `Interrupted` that Python drops (raised inside a finalizer or a gc callback) from printing
    its traceback: the loop raises it again (`StopRequest.deferred`)."""
    global _installed
    if _installed is None:
        _installed = StopRequest()
        sys.unraisablehook = _quiet_about_interruptions(sys.unraisablehook)
    return _installed.install()


def _quiet_about_interruptions(hook):
    def unraisable(info):
        if not isinstance(info.exc_value, Interrupted):
            hook(info)
    return unraisable


def reinstall() -> None:
    """The installed handlers again, after starting what may have replaced them (JAX's
    distributed runtime installs its own SIGTERM handler); nothing where none was installed."""
    if _installed is not None:
        _installed.install()


@contextlib.contextmanager
def deferred() -> Iterator[StopRequest]:
    """The training loop's stop request: the installed handlers', else (a library caller that
    installed none) handlers installed for the loop's duration only."""
    if _installed is not None:
        with _installed.deferred() as stop:
            yield stop
        return
    own = StopRequest().install()
    try:
        with own.deferred() as stop:
            yield stop
    finally:
        own.uninstall()


@contextlib.contextmanager
def critical() -> Iterator[None]:
    """Holds SIGTERM and SIGINT back for the block (the main thread's mask); one that arrived
    meanwhile is delivered, and handled, as the block ends."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
