"""The JAX suite: collected only in a process that asked for it (tests/test_backend_suites.py starts one).

Keras fixes its backend when it is first imported, and the normal suite runs on TensorFlow
(tests/conftest.py), so these modules run in one subprocess with KERAS_DPSGD_JAX_SUITE=1, where
this file selects the JAX backend before anything imports keras, and 2 host CPU devices before
JAX starts (XLA_FLAGS), for test_jax_distribute.py: every other test runs on device 0 as with one.
"""

import os

TWO_DEVICES = "--xla_force_host_platform_device_count=2"

if os.environ.get("KERAS_DPSGD_JAX_SUITE") == "1":
    os.environ["KERAS_BACKEND"] = "jax"
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    os.environ["XLA_FLAGS"] = " ".join(flags + [TWO_DEVICES])
else:
    collect_ignore_glob = ["test_*.py"]
