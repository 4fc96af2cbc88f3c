"""Issue 37.5 on Keras 3 with the JAX backend: tests/step/test_held_out_validation.py's checks, the JAX front.

A `val_` decision on validation rows that are training rows (the lots' source arrays, a copy, a slice, a
validation_split of duplicated rows, an EarlyStopping inside a CallbackList) or on a training set whose rows
cannot be read is refused before any weight changes; held-out validation data still trains. The refusals
failed on the code before the fix (the fits trained).
"""

from tests.step.test_held_out_validation import *  # noqa: F403 (the checks, collected here)
