"""Runs one docs sample in a process forked by ``tests/test_docs.py``'s forkserver.

``test_docs`` starts it with ``runpy.run_path`` (a test module cannot be imported again in a
forked interpreter under pytest's name for it), passing ``SAMPLE_ARGS = (code, cwd, log)``:
the sample runs as ``__main__`` in ``cwd`` with its stdout and stderr in ``log``, and the
process exits 1 with the traceback in the log when it raises.
"""

from __future__ import annotations

import os
import sys
import traceback


def run_sample(code: str, cwd: str, log: str) -> None:
    """Run ``code`` as a fresh interpreter's ``-c`` would, in ``cwd``, output in ``log``."""
    os.chdir(cwd)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    sys.argv = ["-c"]
    try:
        exec(compile(code, "<sample>", "exec"), {"__name__": "__main__"})
    except SystemExit as e:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(e.code if isinstance(e.code, int) else (0 if e.code is None else 1))
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    sys.stdout.flush()
    sys.stderr.flush()


if __name__ == "__forked__":  # test_docs runs this file with runpy.run_path in a fork
    run_sample(*globals()["SAMPLE_ARGS"])
