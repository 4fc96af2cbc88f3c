"""Tiny keras_hub language models on Keras 3 TensorFlow (issue 41): Llama and Mistral causal LMs (± LoRA), Gemma,
BART and T5 seq2seq LMs with their own token-level Keras loss, DeBERTa-v3 (its relative-position table layer-normalized
and repeated over the batch: the weight-region rule, ``_weight_region``, and the tiled copies' rule).

Each trains one step on the documented path (``make_private`` + ``PoissonLots``, σ = 0) and moves the weights by
exactly the clipped per-example gradients of a one-example-at-a-time loop, every variable by a fast rule (no
per-example jacobians).
"""

import logging

import pytest

pytest.importorskip("keras_hub")

from tests._hub_models import MODELS, check  # noqa: E402


@pytest.mark.parametrize("name", sorted(MODELS))
def test_one_private_step_equals_the_loop(name, caplog):
    with caplog.at_level(logging.WARNING, logger="keras_dpsgd"):
        _, opt = check(name)
    assert "fast rules" in str(opt.per_example_report)  # no variable fell back to jacobians
    assert not [r for r in caplog.records if "per-example jacobians" in r.getMessage()]
