"""SIGTERM in a command that runs Ray work: stopped like SIGINT, said as SIGTERM.

ray.init installs two SIGTERM handlers in the driver: a Python one (`sys.exit(15)`) and, in its core
worker, a C-level one that prints a stack and aborts. Neither reaches the user as a stop: a
`packbench audit reexecute` terminated while it waited on its worker exited 1 with no line (Ray's
blocking calls turn a SystemExit raised inside them into SystemExit(1)), or died of SIGABRT (134)
after Ray's stack lines. KeyboardInterrupt is the one exception `ray.get` and `ray.wait` pass on
as it is, so the handler installed after ray.init (`install`) raises it and remembers the signal:
the console entry point then prints "terminated (SIGTERM)" and exits 143 (`exit_code`).
"""

from __future__ import annotations

import signal
import threading

received: list[int] = []  # the SIGTERMs `on_sigterm` turned into KeyboardInterrupt, in this process


def on_sigterm(signum, frame) -> None:
    received.append(signum)
    raise KeyboardInterrupt


def install() -> None:
    """`on_sigterm` for SIGTERM, where signals arrive (the main thread); a caller with its own
    handler (the dispatcher's) installs it afterwards, over this one."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, on_sigterm)


def stop_line() -> str:
    """What the command says when a KeyboardInterrupt stopped it."""
    return "terminated (SIGTERM)" if received else "interrupted"


def exit_code() -> int:
    """The shell's code for the stop a KeyboardInterrupt stands for: 143 after SIGTERM, else 130 (SIGINT)."""
    return 143 if received else 130
