"""The torch suite: collected only in a process that asked for it (tests/test_backend_suites.py starts one).

Keras fixes its backend when it is first imported, and the normal suite runs on TensorFlow
(tests/conftest.py), so these modules run in one subprocess with KERAS_DPSGD_TORCH_SUITE=1, where this
file selects the torch backend before anything imports keras.
"""

import os

if os.environ.get("KERAS_DPSGD_TORCH_SUITE") == "1":
    os.environ["KERAS_BACKEND"] = "torch"
else:
    collect_ignore_glob = ["test_*.py"]
