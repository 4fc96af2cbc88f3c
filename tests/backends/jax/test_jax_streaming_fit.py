"""Issue 40, item 5 on Keras 3 with the JAX backend: the checks of tests/step/test_streaming_fit.py, the JAX front.

Streamed Poisson lots (a tf.data stream, memory-mapped .npy shards) feed the stateless JAX step; the ledger's ε
after k lots is the in-memory sampler's.
"""

from tests.step.test_streaming_fit import *  # noqa: F403 (the checks, collected here)
