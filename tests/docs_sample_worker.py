"""Runs one docs script in a process forked by ``tests/test_docs.py``'s forkserver.

``test_docs`` starts it with ``runpy.run_path`` (a test module cannot be imported again in a
forked interpreter under pytest's name for it), passing ``SAMPLE_ARGS = (script, log, server)``:
the script (a file the test wrote) runs as ``python script.py`` would run it, as ``__main__``
with ``__file__``, ``sys.argv[0]`` and ``sys.path[0]`` pointing at it, in its folder, with its
stdout and stderr in ``log``; the process exits 1 with the traceback in the log when it raises.

A sample that starts ranks with ``spawn`` then works as it does for a user: each rank imports
the file again as ``__mp_main__`` (its ``if __name__ == "__main__":`` part skipped) and finds the
rank function there. With ``server`` (the test's forkserver's address), a spawned rank is a
fork of that server instead of a fresh interpreter: the server imported torch and computectx and
never ran an op, and the fork then prepares itself exactly as a spawned interpreter does (the
parent's ``sys.path`` and folder, the script imported as ``__mp_main__``, the process object
unpickled), so a rank function that is not importable, a launch outside the guard or a rank
function that a later sample redefines fails as under spawn, and no rank inherits the script's
thread pools; what it saves is each rank's seconds of ``import torch``. What differs from a
fresh interpreter: the rank's environment and stdout are the server's (its errors still reach the
script's traceback through torch's launcher), and the server's modules are already imported. A
sample that asks for ``fork`` gets a real fork of this process.
"""

from __future__ import annotations

import os
import runpy
import sys
import traceback
from multiprocessing import context, forkserver, popen_forkserver


def _flush() -> None:
    sys.stdout.flush()
    sys.stderr.flush()


def _spawn_from(server: str) -> None:
    """Start ``spawn`` processes as forks of the running forkserver at ``server``."""
    # This process is a fork of that server: _serve_one set the server's alive fd and the
    # resource tracker's fd here, only the address is missing; and the server is not a child of
    # this process, so ensure_running (which waitpids on it) must not run.
    state = forkserver._forkserver
    state._forkserver_address = server  # type: ignore[attr-defined]  # private, untyped
    state.ensure_running = lambda: None  # type: ignore[method-assign]
    context.SpawnProcess._Popen = staticmethod(popen_forkserver.Popen)  # type: ignore[method-assign, assignment]


def run_script(script: str, log: str, server: str | None) -> None:
    """Run the file ``script`` as ``python script`` would, output in ``log``."""
    folder = os.path.dirname(script)
    os.chdir(folder)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    _flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    sys.argv = [script]
    sys.path.insert(0, folder)
    if server is not None:
        _spawn_from(server)
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        _flush()
        os._exit(e.code if isinstance(e.code, int) else (0 if e.code is None else 1))
    except BaseException:
        traceback.print_exc()
        _flush()
        os._exit(1)
    _flush()


if __name__ == "__forked__":  # test_docs runs this file with runpy.run_path in a fork
    run_script(*globals()["SAMPLE_ARGS"])
