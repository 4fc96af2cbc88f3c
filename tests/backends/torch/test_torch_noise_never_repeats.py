"""Issue 37.4 on Keras 3 with the torch backend: tests/step/test_noise_never_repeats.py's checks, the torch front.

A seed passed again (a new optimizer, ``make_private_with_epsilon`` twice) never draws the noise or the lots
of a release already in the model's ledger; a fresh model with the same seed reproduces a run bit for bit.
On torch they run since issue 39 (before it, make_private refused the torch backend).
"""

from tests.step.test_noise_never_repeats import *  # noqa: F403 (its __all__: the checks of every Keras 3 backend)
