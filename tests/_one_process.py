"""Several example scripts run one after another in ONE fresh Python process (TensorFlow imported once).

Each script runs as ``python examples/NAME.py ARGS`` would run it (``runpy.run_path`` with ``__name__ ==
"__main__"``, ``sys.argv`` set and the script's folder first on ``sys.path``), its stdout captured on its own;
a script's failure (an exception, or a ``sys.exit`` code other than 0) is kept for that script, and the next one
still runs. What is shared is only
the interpreter: the imports (several CPU-seconds of TensorFlow and Keras per process on the CI machine) and
the random generators' state (Keras's session, hence its name counters, is cleared before each script; a script's
draws may still differ from those of a run in a process of its own with the same seed).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Optional, Sequence

_CHILD = """
import contextlib, io, json, os, runpy, sys, traceback

results = []
for path, *argv in json.loads(sys.argv[1]):
    for name in ("keras", "tf_keras"):  # Keras's name counters as in a new process
        if name in sys.modules:
            sys.modules[name].backend.clear_session()
    sys.argv = [path, *argv]
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))  # as `python PATH` puts the script's folder first
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(path, run_name="__main__")
        code, error = 0, ""
    except SystemExit as exit:
        code = exit.code if isinstance(exit.code, int) else (0 if exit.code is None else 1)
        error = "" if code == 0 else f"exit {exit.code!r}"
    except BaseException:
        code, error = 1, traceback.format_exc()
    sys.path.pop(0)
    results.append(dict(code=code, stdout=out.getvalue(), error=error))
print("RESULTS " + json.dumps(results))
"""


def run_scripts(jobs: Sequence[Sequence[str]], *, timeout: float, env: Optional[dict] = None) -> list[dict]:
    """Runs each job ``[path, *argv]`` in order in one fresh process.

    Returns:
      One dict per job: ``code`` (0 on success), ``stdout`` (the script's own), ``error`` (its traceback or exit
      code; the process's stderr where the process itself failed).
    """
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps([list(map(str, job)) for job in jobs])],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2") if env is None else env,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULTS ")]
    if proc.returncode != 0 or not lines:
        failure = dict(code=proc.returncode or 1, stdout=proc.stdout[-2000:], error=proc.stderr[-4000:])
        return [failure for _ in jobs]
    return json.loads(lines[-1][len("RESULTS ") :])
