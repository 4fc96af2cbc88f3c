"""Fast per-example clipping of Keras 3 recurrent layers (``keras.layers.*``, a ``tf.while_loop``)
and of dilated convolutions (both Kerases).

Each case: the fast backend == a one-example-at-a-time loop (through a ``while`` loop the reference
jacobian path takes minutes, the loop is the oracle) and no variable took the jacobian fallback. The loop is unrolled op for op
(``keras_dpsgd.backends.tensorflow._loops``); tf_keras's generic ``backend.rnn`` loop (SimpleRNN without
``unroll``) takes the same path.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
import tf_keras
from _fast_helpers import (
    TfVariables,
    assert_same,
    data,
    flat_factors,
    loop_oracle,
    per_layer_factors,
    run_traced,
    sequence_data,
    traced_step,
)

from keras_dpsgd.backends.tensorflow import FastBackend
from keras_dpsgd.backends.tensorflow._backend import _reference_backend

L = keras.layers


def _check(model, x, y, factors=None, reference=False, first_rows=()):
    """Each n in `first_rows` also runs the batch x[:n] through the same fast trace (batch size None)."""
    model(x[:1])
    view = model if isinstance(model, tf_keras.Model) else TfVariables(model)
    factors = factors or flat_factors(1.0)
    backend = FastBackend()
    step = traced_step(backend, view, x, y, factors)
    got = step(x, y)
    assert backend.last_fallback == []
    assert_same(got, loop_oracle(view, x, y, factors))
    for n in first_rows:
        assert_same(step(x[:n], y[:n]), loop_oracle(view, x[:n], y[:n], factors))
    if reference:
        assert_same(got, run_traced(_reference_backend(), view, x, y, factors))


def _model(layer, steps, features, masked):
    head = [keras.Input((steps, features))] + ([L.Masking(0.0)] if masked else [])
    return keras.Sequential(head + [layer, L.Dense(2)])


_LAYERS = {  # name -> (layer, return_sequences, masked, per-layer clipping)
    "lstm-sequences-masked": (L.LSTM, True, True, False),
    "lstm-last": (L.LSTM, False, False, True),
    "gru-last-masked": (L.GRU, False, True, True),
    "simple-rnn-last-masked": (L.SimpleRNN, False, True, False),
}


@pytest.mark.parametrize("name", sorted(_LAYERS))
def test_keras3_recurrent_layers(name):
    make, return_sequences, masked, per_layer = _LAYERS[name]
    x, y = sequence_data(3, 4, 3, (4, 2) if return_sequences else (2,), masked)
    model = _model(make(3, return_sequences=return_sequences), 4, 3, masked)
    factors = per_layer_factors([0.05, 0.02, 0.03, 0.04, 0.1]) if per_layer else None
    _check(model, x, y, factors=factors, first_rows=(1,))  # and a batch of one


def test_tf_keras_simple_rnn_without_unroll():
    """tf_keras's SimpleRNN runs ``backend.rnn``'s ``while`` loop: the same unrolled copy."""
    x, y = sequence_data(3, 4, 2, (2,), masked=True, seed=4)
    TL = tf_keras.layers
    model = tf_keras.Sequential([TL.Masking(0.0), TL.SimpleRNN(3), TL.Dense(2)])
    _check(model, x, y, factors=per_layer_factors([0.05, 0.02, 0.03, 0.04, 0.1]))


class _NoisyCell(L.Layer):
    """tanh(x K + h + noise): a random op inside the loop's body."""

    state_size = 2

    def build(self, input_shape):
        self.kernel = self.add_weight(shape=(input_shape[-1], 2))

    def call(self, x, states):
        h = tf.tanh(tf.matmul(x, self.kernel) + states[0] + 0.1 * tf.random.uniform(tf.shape(states[0])))
        return h, [h]


def test_a_loop_with_a_random_op_is_refused():
    """A copy of the loop would draw other random numbers: the loop stays opaque to the row
    analysis, which then cannot prove the loss per example, so the step is refused (it used to
    take the jacobians, trusting the loop not to mix the examples)."""
    x, y = sequence_data(2, 3, 2, (2,), masked=False, seed=5)
    model = _model(L.RNN(_NoisyCell()), 3, 2, masked=False)
    model(x[:1])
    view = TfVariables(model)
    with pytest.raises(ValueError, match="cannot prove that the per-example loss"):
        run_traced(FastBackend(), view, x, y, flat_factors(1.0))


def test_keras3_stacked_layers_and_a_path_around_them():
    """Dense -> LSTM(return_sequences) -> GRU, and the Dense's output pooled around both: the
    Dense's gradient flows through both copies and around them, each path once."""
    inputs = keras.Input((3, 2))
    h = L.Dense(3)(inputs)
    top = L.GRU(2)(L.LSTM(2, return_sequences=True)(h))
    model = keras.Model(inputs, L.Dense(2)(L.Concatenate()([top, L.GlobalAveragePooling1D()(h)])))
    x, y = sequence_data(2, 3, 2, (2,), masked=False, seed=6)
    _check(model, x, y, factors=per_layer_factors([0.05] * len(model.trainable_variables)))


@pytest.mark.parametrize("front_end", [keras, tf_keras])
def test_dilated_convolutions(front_end):
    """Dilated Conv2D and Conv1D run on SpaceToBatchND blocks: each example's blocks are summed
    (== the reference path)."""
    layers = front_end.layers
    model = front_end.Sequential(
        [
            front_end.Input((5, 5, 1)),
            layers.Conv2D(2, 2, dilation_rate=2, padding="same"),
            layers.Reshape((25, 2)),
            layers.Conv1D(2, 2, dilation_rate=3),
            layers.Flatten(),
            layers.Dense(2),
        ]
    )
    x, y = data((2, 5, 5, 1), (2, 2), seed=8)
    _check(model, x, y, factors=per_layer_factors([0.05] * 6), reference=True)


def test_keras3_fit_takes_the_fast_path_for_a_gru_text_model():
    """In Model.fit (make_private), Embedding(mask_zero) -> GRU -> Dense uses no jacobian fallback."""
    from keras_dpsgd.keras3 import DPSGDOptimizer, make_private

    ids = np.random.default_rng(5).integers(0, 20, size=(8, 5)).astype("int32")
    ids[:3, 3:] = 0
    model = make_private(
        keras.Sequential([keras.Input((5,), dtype="int32"), L.Embedding(20, 3, mask_zero=True), L.GRU(2), L.Dense(2)])
    )
    opt = DPSGDOptimizer(l2_norm_clip=1.0, noise_multiplier=0.0, learning_rate=0.1, per_example_backend="fast")
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
    model.compile(optimizer=opt, loss=loss)
    model.fit(ids, np.arange(8) % 2, batch_size=4, epochs=1, verbose=0)
    assert opt._dp.backend.last_fallback == []
    assert all(np.all(np.isfinite(v.numpy())) for v in model.trainable_variables)


def test_keras3_grouped_conv2d_on_the_reference_backend_is_refused():
    """Keras 3 runs Conv2D(groups=G) as an XLA-compiled call (CPU has no grouped kernel without
    XLA), and pfor jacobians of grouped convolutions are wrong (tests/backends/tensorflow/test_fast_conv.py): the
    reference backend refuses the model, naming the layer (the fast backend's rule:
    tests/backends/tensorflow/test_fast_grouped_conv.py)."""
    from keras_dpsgd.keras3 import DPSGDOptimizer, make_private

    x, y = data((3, 5, 5, 4), (3, 2), seed=8)
    model = make_private(keras.Sequential([keras.Input((5, 5, 4)), L.Conv2D(4, 3, groups=2), L.Flatten(), L.Dense(2)]))
    opt = DPSGDOptimizer(l2_norm_clip=1.0, noise_multiplier=1.0, learning_rate=0.1, per_example_backend="reference")
    model.compile(optimizer=opt, loss="mse")
    with pytest.raises(ValueError, match=r"groups=2\).*grouped convolution"):
        model.fit(x, y, batch_size=3, epochs=1, verbose=0)


def test_keras3_recurrent_layers_equal_the_reference_path():
    """Tiny shapes (T = 3, B = 3, 2 units), so that the reference jacobian through the loops stays
    cheap: Masking -> Bidirectional(LSTM, backward GRU; return_sequences) -> SimpleRNN -> Dense, per-layer
    clipping: fast == reference == the one-example loop."""
    layer = L.Bidirectional(
        L.LSTM(2, return_sequences=True), backward_layer=L.GRU(2, return_sequences=True, go_backwards=True)
    )
    model = keras.Sequential([keras.Input((3, 2)), L.Masking(0.0), layer, L.SimpleRNN(2), L.Dense(2)])
    x, y = sequence_data(3, 3, 2, (2,), masked=True, seed=9)
    factors = per_layer_factors([0.05, 0.02, 0.03, 0.04, 0.1, 0.02, 0.05, 0.1, 0.03, 0.02, 0.05])
    _check(model, x, y, factors=factors, reference=True)
