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
    # XLA's compile of each test's steps costs more than running them (a few steps of tiny models): compiled
    # without most optimizations, the suite takes about 37% less CPU (hub models and behaviour checks: 79 s of
    # CPU against 125 s); the tests compare values within rounding bounds, which this leaves as they are.
    os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "1"
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    os.environ["XLA_FLAGS"] = " ".join(flags + [TWO_DEVICES])
else:
    collect_ignore_glob = ["test_*.py"]
