"""OS names for the threads ``loopwatch up`` starts, which ``/proc`` and ``top -H`` show
(Python's own thread names stay inside the interpreter): the bench counts a named
thread's CPU apart from the others."""

from __future__ import annotations

import threading

from loopwatch.core.libc import PR_SET_NAME, prctl

#: the processors' fold thread (:class:`loopwatch.processors.app.Processor`)
FOLD_THREAD_NAME = "lw-fold"


def name_os_thread(name: str) -> None:
    """Give the calling thread ``name`` (its first 15 bytes: the kernel's limit); a
    no-op where there is no ``prctl``.

    >>> import threading
    >>> def named(): name_os_thread("lw-doctest"); seen.append(os_thread_name())
    >>> seen = []; thread = threading.Thread(target=named); thread.start(); thread.join()
    >>> seen
    ['lw-doctest']
    """
    prctl(PR_SET_NAME, name.encode()[:15])


def os_thread_name() -> str | None:
    """The calling thread's OS name, or None where ``/proc`` does not show it."""
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/comm") as comm:
            return comm.read().strip()
    except OSError:
        return None
