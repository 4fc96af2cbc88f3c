"""Issue 37, classes 2 and 3 on Keras 3 with the JAX backend: the checks of tests/step/test_fed_lots.py, the JAX front.

The lots that reach the step set the ledger's rate; fixed-size batches with a Poisson rate are refused before
any weight changes (the JAX fit takes the values out of the variables before its first step: they stay); an
epoch is one number of steps for the plan and the fit.
"""

from tests.step.test_fed_lots import *  # noqa: F403 (the checks, collected here)
