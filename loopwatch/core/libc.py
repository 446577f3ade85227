"""The C library, for the few Linux calls Python has no wrapper for: ``prctl`` (a child
that dies with its parent, a thread's OS name) and glibc's ``malloc_trim``. Loaded once;
where there is none (or the call is missing), the callers' calls are no-ops."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import signal

#: ``prctl`` options (linux/prctl.h)
PR_SET_PDEATHSIG = 1
PR_SET_NAME = 15


@functools.cache
def libc() -> ctypes.CDLL | None:
    """The process's C library, or None where it cannot be loaded."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None


def prctl(option: int, argument: int | bytes) -> None:
    """``prctl(option, argument)`` on Linux; a no-op where there is no ``prctl``."""
    with contextlib.suppress(AttributeError):
        library = libc()
        if library is not None:
            library.prctl(option, argument, 0, 0, 0)


def die_with_parent() -> None:
    """SIGTERM the calling process when its parent ends, even by SIGKILL (Linux; a
    ``preexec_fn`` of the child, or the child's first call)."""
    prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
