"""Issue 37.4 on Keras 3 with the JAX backend: tests/step/test_noise_never_repeats.py's checks, the JAX front.

A seed passed again (a new optimizer, ``make_private_with_epsilon`` twice) never draws the noise or the lots
of a release already in the model's ledger; a fresh model with the same seed reproduces a run bit for bit.
The repeat checks failed on the code before the fix (correlation 1.0; the same lots twice).
"""

from tests.step.test_noise_never_repeats import (  # noqa: F401 (the checks of every Keras 3 backend, collected here)
    front,
    test_a_fresh_model_with_the_same_seed_reproduces_the_run_bit_for_bit,
    test_a_keras3_file_loaded_after_a_second_optimizer_continues_the_ledger_positions,
    test_a_new_optimizer_with_the_same_seed_draws_fresh_noise,
    test_make_private_with_epsilon_twice_with_one_seed_draws_fresh_lots_and_noise,
    test_two_layers_adapted_with_one_seed_are_refused_before_any_step,
)
