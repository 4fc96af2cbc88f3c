"""The JAX suite: collected only in a process that asked for it (tests/test_backend_suites.py starts one).

Keras fixes its backend when it is first imported, and the normal suite runs on TensorFlow
(tests/conftest.py), so these modules run in one subprocess with KERAS_DPSGD_JAX_SUITE=1, where
this file selects the JAX backend before anything imports keras, and 2 host CPU devices before
JAX starts (XLA_FLAGS), for test_jax_distribute.py: every other test runs on device 0 as with one.
"""

import os

TWO_DEVICES = "--xla_force_host_platform_device_count=2"
# XLA's CPU compile, cheaper still: fusions emitted by the older elemental emitter (the newer fusion emitters cost
# about twice the compile time on these tiny models) and each module compiled as one LLVM module, not split for
# parallel codegen (threads that a 2-core machine running two pytest workers has no core for). Measured on the
# hub models, behaviour checks and models of 2026 (45 tests): 130 s of CPU before, 56 s after. Both flags are
# known to TensorFlow's XLA too, which reads XLA_FLAGS in this process and aborts on a flag it does not know.
FAST_COMPILE = ["--xla_cpu_use_fusion_emitters=false", "--xla_cpu_parallel_codegen_split_count=1"]

if os.environ.get("KERAS_DPSGD_JAX_SUITE") == "1":
    os.environ["KERAS_BACKEND"] = "jax"
    # XLA's compile of each test's steps costs more than running them (a few steps of tiny models): compiled
    # without most optimizations, the suite takes about 37% less CPU (hub models and behaviour checks: 79 s of
    # CPU against 125 s); the tests compare values within rounding bounds, which this leaves as they are.
    os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "1"
    ours = [TWO_DEVICES, *FAST_COMPILE]
    names = tuple(f.split("=")[0] for f in ours)
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(names)]
    os.environ["XLA_FLAGS"] = " ".join(flags + ours)
    # Keras's random weights drawn once per size class, the same values (tests/_jax_initializers.py).
    from tests._jax_initializers import install

    install()
else:
    collect_ignore_glob = ["test_*.py"]
