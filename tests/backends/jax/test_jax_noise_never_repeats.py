"""Issue 37.4 on Keras 3 with the JAX backend: tests/step/test_noise_never_repeats.py's checks, the JAX front.

A seed passed again (a new optimizer, ``make_private_with_epsilon`` twice) never draws the noise or the lots
of a release already in the model's ledger; a fresh model with the same seed reproduces a run bit for bit.
The repeat checks failed on the code before the fix (correlation 1.0; the same lots twice).
"""

from tests.step.test_noise_never_repeats import *  # noqa: F403 (its __all__: the checks of every Keras 3 backend)
