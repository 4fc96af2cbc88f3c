"""TensorFlow's start-up log lines kept off the terminal.

TensorFlow 2.21 prints its C++ start-up lines (oneDNN, "Could not find cuda
drivers", the CPU-feature banner, "failed call to cuInit") through absl before
absl's logging is initialized: they go straight to file descriptor 2 and
``TF_CPP_MIN_LOG_LEVEL`` does not filter them. So TensorFlow is imported, and
its devices listed, with descriptor 2 pointing at a temporary file; afterwards
every captured line that is not such a log line is written to the real stderr
(an import error, a Python warning), so nothing but TensorFlow's chatter is
dropped. ``TF_CPP_MIN_LOG_LEVEL`` defaults to 2 (warnings and info hidden,
errors kept) for the lines printed later; a value the user set is kept, and a
user who sets it to 0 sees the start-up lines too.

This module imports without TensorFlow.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile

__all__ = ["import_tensorflow_quietly", "is_tensorflow_log_line"]

# absl/glog prefix: severity, MMDD hh:mm:ss.micro, thread id, file.cc:line]
_LOG_LINE = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d+\.\d+\s+\d+ [\w./-]+:\d+\]")
_START_UP_LINES = (
    "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR",
    "To enable the following instructions:",  # second line of the cpu_feature_guard banner
)


def is_tensorflow_log_line(line: str) -> bool:
    """True for a line TensorFlow's C++ runtime logs (absl format) or its start-up banner."""
    return bool(_LOG_LINE.match(line)) or line.startswith(_START_UP_LINES)


def import_tensorflow_quietly():
    """Imports TensorFlow (and initializes its devices) without its start-up log lines.

    Returns:
      The ``tensorflow`` module.
    """
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if "tensorflow" in sys.modules:
        return sys.modules["tensorflow"]
    if os.environ["TF_CPP_MIN_LOG_LEVEL"].strip() in ("0", ""):
        import tensorflow as tf  # the user asked for every line

        return tf
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError, AttributeError):  # no usable descriptor 2: nothing to keep clean
        import tensorflow as tf

        return tf
    with tempfile.TemporaryFile(mode="w+b") as captured:
        os.dup2(captured.fileno(), 2)
        try:
            import tensorflow as tf

            tf.config.list_physical_devices()  # device start-up (cuInit) logs now, not mid-run
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            text = captured.read().decode("utf-8", errors="replace")
            kept = [line for line in text.splitlines(keepends=True) if not is_tensorflow_log_line(line)]
            if kept:
                sys.stderr.write("".join(kept))
                sys.stderr.flush()
    return tf
