"""The ``weightsync`` console script of the wheel (and ``python -m weightsync``): the command
line of the Rust binary, run in this process (``weightsync --help``).

Subcommands that start copies of themselves (``demo``'s workers, ``bench``'s peers) start this
interpreter with ``-P -m weightsync``. Ctrl-C stops the command as it stops the binary: Python's
own SIGINT handler (which only raises between Python bytecodes) is put back to the default for
the run.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Sequence

from . import _native

__all__ = ["main", "PROGRAM"]

PROGRAM = [sys.executable, "-P", "-m", "weightsync"]
"""How this interpreter runs the command line again (for the subcommands' child processes)."""


def main(argv: Sequence[str] | None = None) -> int:
    """Runs ``weightsync`` with ``argv`` (default: this process's arguments) and returns its
    exit status: 0, 1 for an error (printed as one message), 2 for a usage error."""
    args = list(sys.argv[1:] if argv is None else argv)
    sys.stdout.flush()
    if threading.current_thread() is not threading.main_thread():
        return _native.cli_main(["weightsync", *args], program=PROGRAM)
    before = signal.signal(signal.SIGINT, signal.SIG_DFL)
    try:
        return _native.cli_main(["weightsync", *args], program=PROGRAM)
    finally:
        signal.signal(signal.SIGINT, before)
