"""Tiny keras_hub language models on Keras 3 JAX (issue 41): Llama and Mistral causal LMs (± LoRA), Gemma, BART and
T5 seq2seq LMs with their own token-level Keras loss, DeBERTa-v3; one private step on the documented path (σ = 0)
equals the one-example loop (``tests/_hub_models.py``)."""

import pytest

pytest.importorskip("keras_hub")

from tests._hub_models import MODELS, check  # noqa: E402


@pytest.mark.parametrize("name", sorted(MODELS))
def test_one_private_step_equals_the_loop(name):
    check(name)


@pytest.mark.parametrize("name", ["llama", "bart"])
def test_reversible_embeddings_take_their_rule(name):
    """keras_hub's token embedding (``ReversibleEmbedding``, a subclass of Keras's that defines nothing) is covered by
    a rule, for its lookups and its reverse (output projection) calls: its tables are not left to the exact
    ``jax.vmap`` path of the uncovered variables (B copies of a [vocabulary, width] gradient)."""
    from keras_dpsgd.backends.jax import ghost

    model, _, x, _ = MODELS[name]()
    trainable = [v.value for v in model.trainable_variables]
    non_trainable = [v.value for v in model.non_trainable_variables]
    plan = ghost.plan(model, trainable, non_trainable, x, {})
    assert "ReversibleEmbedding" in {type(layer).__name__ for layer in plan.covered}
    uncovered = {model.trainable_variables[j].path for j in plan.uncovered}
    assert not [path for path in uncovered if "token_embedding" in path], uncovered
