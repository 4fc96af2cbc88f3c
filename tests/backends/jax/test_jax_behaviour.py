"""The behavioural suite (tests/test_behaviour.py) on Keras 3 with the JAX backend: the same checks, the JAX front.

Every check of tests/test_behaviour.py is imported and collected here, in the JAX suite's one process, where
the ``front`` fixture gives the Keras 3 front alone (tests/_behaviour.py ``process_fronts``); the oracle is the
same one-example loop (tests/_keras3_helpers.py, ``jax.grad`` of a batch of one on JAX).
"""

from tests.test_behaviour import *  # noqa: F403 (the checks, collected here)
