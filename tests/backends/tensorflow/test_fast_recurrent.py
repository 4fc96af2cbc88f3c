"""Fast per-example clipping of recurrent and depthwise convolution layers (issue 18).

Each case: the fast backend == a one-example-at-a-time loop (and, for the convolutions, == the
reference jacobian path: through a recurrent ``while`` loop that path takes a minute, the loop is
the oracle there), and no variable took the jacobian fallback (``check(..., fallback=())``).
"""

import numpy as np
import pytest
import tensorflow as tf
import tf_keras as keras
from _fast_helpers import check, data, per_layer_factors, sequence_data

from keras_dpsgd.tf_keras._optimizer import DPSGDOptimizer

L = keras.layers


def _model(layer, masked):
    return keras.Sequential(([L.Masking(0.0)] if masked else []) + [layer, L.Dense(2)])


@pytest.mark.parametrize(
    "make,return_sequences,masked,per_layer",
    [
        (L.LSTM, True, True, False),
        (L.LSTM, False, False, True),
        (L.GRU, False, True, True),
        (L.GRU, True, False, False),
    ],
)
def test_lstm_and_gru(make, return_sequences, masked, per_layer):
    x, y = sequence_data(3, 5, 3, (5, 2) if return_sequences else (2,), masked)
    model = _model(make(4, return_sequences=return_sequences), masked)
    factors = per_layer_factors([0.05, 0.02, 0.03, 0.04, 0.1]) if per_layer else None
    check(model, x, y, factors=factors, reference=False, first_rows=(1,))  # and a batch of one


def test_bidirectional_masked():
    """A forward LSTM and a backward GRU (``go_backwards``; Bidirectional reverses its outputs)."""
    x, y = sequence_data(3, 4, 2, (4, 2), masked=True, seed=1)
    layer = L.Bidirectional(
        L.LSTM(3, return_sequences=True), backward_layer=L.GRU(2, return_sequences=True, go_backwards=True)
    )
    check(_model(layer, masked=True), x, y, factors=per_layer_factors([0.05] * 8), reference=False)


def test_depthwise_and_separable_convolutions():
    """Depthwise kernels (multiplier 2, strided) are fast; so is a dilated Conv2D kernel, which
    TensorFlow runs on SpaceToBatchND blocks (each example's blocks are summed)."""
    model = keras.Sequential(
        [
            keras.Input((7, 7, 4)),
            L.DepthwiseConv2D(3, depth_multiplier=2, padding="same"),
            L.DepthwiseConv2D(2, strides=2),
            L.SeparableConv2D(4, 2, padding="same", depth_multiplier=2),
            L.Conv2D(3, 2, dilation_rate=2),
            L.Flatten(),
            L.Dense(2),
        ]
    )
    x, y = data((3, 7, 7, 4), (3, 2), seed=4)
    check(model, x, y, reference=True)
    factors = per_layer_factors([0.05] * len(model.trainable_variables))
    check(model, x, y, factors=factors, reference=False)


def test_fit_takes_the_fast_path_for_a_stacked_lstm_text_model():
    """In Model.fit, an Embedding(mask_zero) -> LSTM -> GRU -> Dense step uses no jacobian fallback
    (and never differentiates the layers' own function calls, which have no gradient there)."""
    ids = np.random.default_rng(5).integers(0, 20, size=(8, 6)).astype("int32")
    ids[:3, 4:] = 0
    labels = np.arange(8) % 2
    model = keras.Sequential(
        [L.Embedding(20, 4, mask_zero=True), L.LSTM(3, return_sequences=True), L.GRU(2), L.Dense(2)]
    )
    opt = DPSGDOptimizer(l2_norm_clip=1.0, noise_multiplier=0.0, learning_rate=0.1)
    model.compile(
        optimizer=opt,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none"),
    )
    model.fit(ids, labels, batch_size=4, epochs=1, verbose=0)
    assert opt._backend.last_fallback == []
    assert all(np.all(np.isfinite(v.numpy())) for v in model.trainable_variables)
    assert tf.executing_eagerly()


def test_simple_rnn_unrolled():
    """SimpleRNN(unroll=True) is plain matmuls per step: fast (the recurrent kernel's first use
    multiplies the initial zeros: no gradient, no use)."""
    x, y = sequence_data(2, 3, 2, (2,), masked=True, seed=6)
    unrolled = _model(L.SimpleRNN(3, unroll=True), masked=True)
    unrolled(x[:1])
    check(unrolled, x, y, fallback=[], reference=False)


@pytest.mark.parametrize(
    "lower,upper,batch,masked,per_layer",
    [(L.LSTM, L.LSTM, 3, True, False), (L.GRU, L.GRU, 3, False, True), (L.LSTM, L.GRU, 1, True, True)],
)
def test_stacked_layers(lower, upper, batch, masked, per_layer):
    """Stacked tf_keras LSTM/GRU calls: the lower layer's per-example deltas come through the upper
    layer's unrolled copy (the chain of copies), no variable takes the jacobian fallback."""
    x, y = sequence_data(batch, 4, 2, (2,), masked=masked, seed=6)
    model = keras.Sequential(
        ([L.Masking(0.0)] if masked else []) + [lower(3, return_sequences=True), upper(2), L.Dense(2)]
    )
    model(x[:1])
    factors = per_layer_factors([0.05, 0.02, 0.03, 0.04, 0.1, 0.02, 0.05, 0.1]) if per_layer else None
    check(model, x, y, factors=factors, fallback=[], reference=False)


def test_a_dense_on_sequences_before_the_lstm_is_fast():
    """Dense -> (LSTM, and a pooled skip around it) -> Dense: the Dense runs tf.tensordot, whose
    reshapes [B, T, D] -> [B·T, D] -> [B, T, units] get their shapes from tf.shape of the input
    (GatherV2, Prod): with T static the analysis proves T rows per example, then one, and the
    LSTM call's rows rule applies. Before, those rows were unknown at trace time and every
    variable took the jacobian fallback."""
    inputs = keras.Input((3, 2))
    h = L.Dense(3)(inputs)
    out = L.Dense(2)(L.Concatenate()([L.LSTM(2)(h), L.GlobalAveragePooling1D()(h)]))
    model = keras.Model(inputs, out)
    x, y = sequence_data(2, 3, 2, (2,), masked=False, seed=7)
    check(model, x, y, fallback=[], reference=False)
