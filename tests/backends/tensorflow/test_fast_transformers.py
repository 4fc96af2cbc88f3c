"""Fast per-example clipping of the models people fine-tune (Keras 3): LoRA factors, position
embeddings broadcast over the batch, keras_hub BERT, GPT-2 and Gemma backbones (tiny, random weights).

Each case: the fast backend == a one-example-at-a-time loop (flat and per-layer clipping, B = 1 and
B > 1), and no variable took the jacobian fallback (``keras_dpsgd.backends.tensorflow._derived``: the chain rule
through ops on weights alone, such as LoRA's ``W + s·A·B``).
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
from _fast_helpers import (
    TfVariables,
    assert_same,
    flat_factors,
    loop_oracle,
    per_example_loss,
    per_layer_factors,
    run_traced,
    traced_step,
)

from keras_dpsgd.backends.tensorflow import FastBackend

keras_hub = pytest.importorskip("keras_hub")
L = keras.layers
VOCAB, STEPS = 40, 6


def _factors(view, per_layer):
    count = len(view.trainable_variables)
    return per_layer_factors([0.05 + 0.01 * v for v in range(count)]) if per_layer else flat_factors(0.5)


def _fast(view, x, y, factors):
    backend = FastBackend()
    got = run_traced(backend, view, x, y, factors)
    assert backend.last_fallback == []
    return got


def _check(model, x, y, per_layer=False):
    model(x[:1])
    view = TfVariables(model)
    factors = _factors(view, per_layer)
    got = _fast(view, x, y, factors)
    assert_same(got, loop_oracle(view, x, y, factors), rtol=5e-4, atol=5e-5)


def _tokens(batch, seed=0):
    gen = np.random.default_rng(seed)
    ids = gen.integers(1, VOCAB, size=(batch, STEPS)).astype("int32")
    ids[0, -2:] = 0  # padding
    return ids


def _targets(batch, width, seed=1):
    return np.random.default_rng(seed).normal(size=(batch, width)).astype("float32")


def _lora_dense_2d():
    model = keras.Sequential([keras.Input((5,)), L.Dense(7, activation="tanh"), L.Dense(2)])
    model.layers[0].enable_lora(2)
    return model


def _lora_einsum_and_embedding():
    """Embedding LoRA (a looked-up A·B) and EinsumDense LoRA with two output axes."""
    ids = keras.Input((STEPS,), dtype="int32")
    embed, einsum = L.Embedding(VOCAB, 8), L.EinsumDense("btd,dnh->btnh", output_shape=(None, 2, 3))
    h = L.Reshape((STEPS, 6))(einsum(embed(ids)))
    out = L.Dense(2)(L.GlobalAveragePooling1D()(h))
    embed.enable_lora(3)
    einsum.enable_lora(2)
    return keras.Model(ids, out)


def _mha_lora():
    """The issue's block: Embedding, MultiHeadAttention + LayerNorm + Dense, LoRA on Dense/query/value."""
    ids = keras.Input((STEPS,), dtype="int32")
    h = L.Embedding(VOCAB, 8)(ids)
    mha, dense = L.MultiHeadAttention(2, 4), L.Dense(8, activation="relu")
    h = dense(L.LayerNormalization()(h + mha(h, h)))
    out = L.Dense(2)(L.GlobalAveragePooling1D()(h))
    for layer in (dense, mha.query_dense, mha.value_dense):
        layer.enable_lora(2)
    return keras.Model(ids, out)


def _token_and_position():
    """keras_hub's TokenAndPositionEmbedding: a sliced position table broadcast over the batch."""
    ids = keras.Input((STEPS,), dtype="int32")
    h = keras_hub.layers.TokenAndPositionEmbedding(VOCAB, 10, 8)(ids)
    return keras.Model(ids, L.Dense(2)(L.Flatten()(h)))


class _SharedTable(L.Layer):
    """One table looked up with int64 token ids and sliced for positions (added to every example)."""

    def build(self, shape):
        self.table = self.add_weight(shape=(VOCAB, 4))

    def call(self, ids):
        tokens = tf.gather(self.table, tf.cast(ids, tf.int64))
        return tokens + tf.broadcast_to(self.table[:STEPS], tf.shape(tokens))


def _shared_table():
    ids = keras.Input((STEPS,), dtype="int32")
    return keras.Model(ids, L.Dense(2)(L.Flatten()(_SharedTable()(ids))))


_SMALL = {
    "shared-table": (_shared_table, True),
    "lora-dense-2d": (_lora_dense_2d, False),
    "lora-einsum-embedding": (_lora_einsum_and_embedding, True),
    "mha-lora": (_mha_lora, True),
    "token-and-position": (_token_and_position, True),
}


@pytest.mark.parametrize("per_layer", [False, True], ids=["flat", "per-layer"])
@pytest.mark.parametrize("name", sorted(_SMALL))
def test_rules_match_the_loop(name, per_layer):
    """B = 1 and B = 3 through the one trace (batch size None); example 0 holds padding tokens."""
    make, tokens = _SMALL[name]
    keras.utils.set_random_seed(0)
    x = _tokens(3) if tokens else np.random.default_rng(0).normal(size=(3, 5)).astype("float32")
    y = _targets(3, 2)
    model = make()
    model(x[:1])
    view = TfVariables(model)
    factors, backend = _factors(view, per_layer), FastBackend()
    step = traced_step(backend, view, x, y, factors)
    for batch in (1, 3):
        got = step(x[:batch], y[:batch])
        assert backend.last_fallback == []
        assert_same(got, loop_oracle(view, x[:batch], y[:batch], factors), rtol=5e-4, atol=5e-5)


def _classifier(backbone, bert=False):
    """A backbone and a Dense head on the first token; token ids are the one input."""
    ids = keras.Input((STEPS,), dtype="int32")
    inputs = {"token_ids": ids, "padding_mask": keras.ops.not_equal(ids, 0)}
    if bert:
        inputs["segment_ids"] = keras.ops.zeros_like(ids)
        return keras.Model(ids, L.Dense(2)(backbone(inputs)["pooled_output"]))
    return keras.Model(ids, L.Dense(2)(backbone(inputs)[:, 0, :]))


def _bert():
    return _classifier(
        keras_hub.models.BertBackbone(
            vocabulary_size=VOCAB, num_layers=1, num_heads=2, hidden_dim=8, intermediate_dim=16, max_sequence_length=8
        ),
        bert=True,
    )


def _gpt2_lm():
    """GPT2CausalLM: token embedding tied to the output projection (ReversibleEmbedding)."""
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=VOCAB, num_layers=1, num_heads=2, hidden_dim=8, intermediate_dim=16, max_sequence_length=8
    )
    lm = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)
    ids = keras.Input((STEPS,), dtype="int32")
    logits = lm({"token_ids": ids, "padding_mask": keras.ops.not_equal(ids, 0)})
    return keras.Model(ids, keras.ops.reshape(logits[:, :, :2], (-1, 2 * STEPS)))


def _gemma():
    """A tiny Gemma-style decoder: RMSNorm, rotary embeddings, grouped-query attention."""
    return _classifier(
        keras_hub.models.GemmaBackbone(
            vocabulary_size=VOCAB,
            num_layers=1,
            num_query_heads=2,
            num_key_value_heads=1,
            hidden_dim=8,
            intermediate_dim=16,
            head_dim=4,
        )
    )


_HUB = {"bert": _bert, "gpt2-lm": _gpt2_lm, "gemma": _gemma}


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("name", sorted(_HUB))
def test_keras_hub_models_match_the_loop(name, lora):
    keras.utils.set_random_seed(0)
    model = _HUB[name]()
    if lora:
        backbone = next(layer for layer in model._flatten_layers() if isinstance(layer, keras_hub.models.Backbone))
        backbone.enable_lora(2)
    width = 2 * STEPS if name == "gpt2-lm" else 2
    _check(model, _tokens(3), _targets(3, width), per_layer=lora)


@pytest.mark.parametrize("per_layer", [False, True], ids=["flat", "per-layer"])
def test_sensitivity_to_one_example_is_bounded(per_layer):
    """σ = 0: removing one example moves the clipped sum by at most C (per layer: C_v each)."""
    keras.utils.set_random_seed(0)
    model = _mha_lora()
    x, y = _tokens(4, seed=3), 50.0 * _targets(4, 2, seed=4)  # Large errors: every example is clipped.
    model(x[:1])
    view = TfVariables(model)
    factors, backend = _factors(view, per_layer), FastBackend()

    @tf.function(
        input_signature=[tf.TensorSpec([None, STEPS], tf.int32), tf.TensorSpec([None, 2], tf.float32)], autograph=False
    )
    def clipped_sum(x, y):  # traced once, for every batch
        with tf.GradientTape() as tape:
            loss = per_example_loss(view, x, y)
        return backend.clipped_sum(loss, view.trainable_variables, tape, factors)[0]

    full = [t.numpy() for t in clipped_sum(x, y)]
    assert backend.last_fallback == []
    for drop in range(len(x)):
        keep = [i for i in range(len(x)) if i != drop]
        part = [t.numpy() for t in clipped_sum(x[keep], y[keep])]
        moves = np.array([np.linalg.norm(a - b) for a, b in zip(full, part)])
        if per_layer:
            bounds = 0.05 + 0.01 * np.arange(len(moves))
            assert np.all(moves <= bounds * (1 + 1e-4)), (moves, bounds)
        else:
            assert np.sqrt(np.sum(moves**2)) <= 0.5 * (1 + 1e-4)
            assert np.sqrt(np.sum(moves**2)) > 0.5 * 0.9  # the bound is reached: the test could fail


def test_weight_only_op_without_pullback_takes_the_weight_region():
    """A LoRA-like product scaled by a non-scalar weight has no factorized pullback: the vector-Jacobian product of
    its weight region (``_weight_region``), exact, no variable on per-example jacobians (they were, before it)."""

    class Scaled(L.Layer):
        def build(self, shape):
            self.a = self.add_weight(shape=(shape[-1], 2))
            self.b = self.add_weight(shape=(2, 3))
            self.s = self.add_weight(shape=(shape[-1], 3), trainable=False)

        def call(self, x):
            return keras.ops.matmul(x, keras.ops.matmul(self.a, self.b) * self.s)

    model = keras.Sequential([keras.Input((4,)), Scaled(), L.Dense(2)])
    x = np.random.default_rng(0).normal(size=(3, 4)).astype("float32")
    view = TfVariables(model)
    backend = FastBackend()
    got = run_traced(backend, view, x, _targets(3, 2), flat_factors(0.5))
    assert backend.last_fallback == []
    assert_same(got, loop_oracle(view, x, _targets(3, 2), flat_factors(0.5)))
