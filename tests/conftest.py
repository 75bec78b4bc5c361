"""Suite-wide setup: a crash prints native stacks too.

pytest's faulthandler prints every thread's Python stack when the process dies of a signal; torch's fatal
signal handler (c10's, chained before it) adds each thread's C++ stack, so a crash inside an extension on
a machine we cannot log into (a GPU run) leaves the native frames that name the faulting code.

SIGINT gets Python's own handler (``KeyboardInterrupt``) even when pytest was started with SIGINT ignored (as
a background job of a shell script is): the Ctrl-C tests check what a terminal's Ctrl-C does.
"""

from __future__ import annotations

import signal

import torch


def pytest_configure(config) -> None:
    native_stacks = getattr(torch._C, "_set_print_stack_traces_on_fatal_signal", None)
    if native_stacks is not None:
        native_stacks(True)
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
