"""The behavioural suite (tests/test_behaviour.py) on Keras 3 with the torch backend: the same checks, the torch front.

Every check of tests/test_behaviour.py is imported and collected here, in the torch suite's one process, where
the ``front`` fixture gives the Keras 3 front alone (tests/_behaviour.py ``process_fronts``); the oracle is the same one-example
loop (tests/_keras3_helpers.py, ``torch.autograd.grad`` of a batch of one on torch).
"""

from tests.test_behaviour import *  # noqa: F403 (the checks, collected here)
