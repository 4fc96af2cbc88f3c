"""Ghost norms on JAX (``keras_dpsgd.backends.jax.ghost``): which layers take them, and exact steps.

Every step is checked against the one-example loop of ``tests._keras3_helpers`` (jax.grad on a batch of one,
clipped in numpy; σ = 0), or against ``per_example_backend="reference"`` (every variable under
jax.vmap). The models are the torch ghost tests' (tests/_ghost_models.py).
"""

import keras
import numpy as np
import pytest

from keras_dpsgd.backends import _layer_forms
from keras_dpsgd.backends.jax import ghost as _ghost
from tests._behaviour import built
from tests._ghost_models import LAYER_NORMS, assert_layer_norm_taps, ghost_model, per_layer_clip
from tests._keras3_helpers import example_grads
from tests._step_checks import FRONT, LR, assert_clipped_step, assert_step, compiled


def _plan(model, x):
    trainable = [v.value for v in model.trainable_variables]
    non_trainable = [v.value for v in model.non_trainable_variables]
    kwargs = {"training": True} if model._call_has_training_arg else {}
    return _ghost.plan(model, trainable, non_trainable, x, kwargs)


def _covered(model, x):
    plan = _plan(model, x)
    return set() if plan is None else {type(layer).__name__ for layer in plan.covered}


def test_plan_covers_the_layers_with_rules_and_leaves_the_rest_to_vmap():
    model, x, _ = built(FRONT, "transformer")
    assert _covered(model, x) == {"EinsumDense", "Dense", "LayerNormalization"}
    assert _plan(model, x).uncovered == []
    model, x, _ = built(FRONT, "lstm")
    plan = _plan(model, x)
    assert {type(layer).__name__ for layer in plan.covered} == {"Dense"}
    assert [model.trainable_variables[j].path.split("/")[-1] for j in plan.uncovered] == [
        "kernel",
        "recurrent_kernel",
        "bias",
    ]


def test_sequence_model_per_layer_clipped_step_matches_loop():
    """Embedding (Gram form, repeated ids), Dense on a sequence (Gram and direct forms), a layer called twice,
    per-variable clip bounds: the loop's clipped mean."""
    model, x, y = ghost_model("sequence")
    plan = _plan(model, x)
    assert {type(layer).__name__ for layer in plan.covered} == {"Embedding", "Conv1D", "Dense"}
    assert plan.uncovered == [] and len(plan.expected) == 6  # the shared Dense twice
    assert_clipped_step(model, x, y, per_layer_clip(model), per_layer=True)


def test_layer_normalization_in_each_form_per_layer_clipped_step_matches_loop():
    """gamma and beta, RMS scaling, no centering, no scale (the normalized rows tapped once in the forward pass), and
    an axis other than the last (the layer's own call): each variable clipped to its own bound, as the loop."""
    model, x, y = ghost_model("layer_norm")
    assert_layer_norm_taps(model, x)
    assert _covered(model, x) == {"Dense", "LayerNormalization"}
    assert_clipped_step(model, x, y, per_layer_clip(model), per_layer=True)


def test_lora_dense_and_einsum_dense_flat_clipped_step_matches_loop():
    model, x, y = ghost_model("lora")
    assert _covered(model, x) == {"Dense", "EinsumDense"}
    assert_clipped_step(model, x, y, 0.3)


def test_variable_read_outside_its_layer_is_not_covered():
    """The tied kernel's gradient has two uses; a rule on the Dense's call alone would miss one: that layer falls
    back to jax.vmap (the step stays exact), the others keep their rules."""
    model, x, y = ghost_model("tied")
    plan = _plan(model, x)
    tied = model.layers[1]
    assert tied not in plan.covered and len(plan.covered) == 1
    assert [model.trainable_variables[j] for j in plan.uncovered] == [tied.kernel]
    assert_clipped_step(model, x, y, 0.3)


def test_normalization_and_a_nonfinite_example_on_a_convolution():
    """clipping='normalize' (g/(||g|| + γ)) with one example holding Inf: that example contributes exactly 0.
    The convolution (SAME, stride 2) takes its kernel's norm from the input's patches."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((6, 6, 2)),
            keras.layers.Conv2D(3, 3, strides=2, padding="same", activation="relu"),
            keras.layers.Flatten(),
            keras.layers.Dense(3),
        ]
    )
    rng = np.random.default_rng(2)
    x, y = rng.normal(size=(5, 6, 6, 2)).astype("float32"), rng.integers(0, 3, size=5)
    x[1, 0, 0, 0] = np.inf
    compiled(model, l2_norm_clip=None, clipping="normalize", stability=0.05)
    expected = [np.zeros(v.shape) for v in model.trainable_variables]
    for i, g in enumerate(example_grads(model, x, y, FRONT.loss())):
        if i == 1:
            continue
        norm = np.sqrt(sum(np.sum(a**2) for a in g))
        expected = [e + a / (norm + 0.05) / len(x) for e, a in zip(expected, g)]
    assert_step(model, x, y, expected)
    assert int(model.optimizer.nonfinite_examples.numpy()) == 1


def test_auto_equals_reference_with_accumulation():
    """Two batches accumulated into one lot: 'auto' (rules) and 'reference' (jax.vmap) give the same update."""
    updates = []
    for backend in ("auto", "reference"):
        model, x, y = built(FRONT, "dense")
        compiled(model, l2_norm_clip=0.3, gradient_accumulation_steps=2, per_example_backend=backend)
        before = [np.asarray(v.numpy(), np.float64) for v in model.trainable_variables]
        model.fit(x[:4], y[:4], batch_size=2, epochs=1, shuffle=False, verbose=0)
        after = [np.asarray(v.numpy(), np.float64) for v in model.trainable_variables]
        updates.append([(b - a) / LR for b, a in zip(before, after)])
    for got, want in zip(*updates):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert any(np.abs(u).max() > 1e-4 for u in updates[0])


def _attention_projections():
    """keras_hub's attention projections on T = 6 rows (query "abc,cde->abde", bias "de"; output "abcd,cde->abe",
    bias "e"), an EinsumDense whose bias runs along the rows (no row form: materialized), then a Dense head."""
    rng = np.random.default_rng(3)
    keras.utils.set_random_seed(3)
    ids = keras.Input((6,), dtype="int32")
    h = keras.layers.Embedding(20, 8)(ids)
    h = keras.layers.EinsumDense("abc,cde->abde", (6, 2, 4), bias_axes="de", activation="tanh", name="query")(h)
    h = keras.layers.EinsumDense("abcd,cde->abe", (6, 8), bias_axes="e", name="output")(h)
    h = keras.layers.EinsumDense("abc,cd->abd", (6, 4), bias_axes="bd", activation="tanh", name="rows_bias")(h)
    model = keras.Model(ids, keras.layers.Dense(3)(keras.layers.Flatten()(h)))
    return model, rng.integers(0, 20, size=(5, 6)).astype("int32"), rng.integers(0, 3, size=5)


@pytest.mark.parametrize("gram", [True, False], ids=["gram", "materialized"])
def test_einsum_dense_on_a_sequence_matches_the_loop_in_either_form(gram, monkeypatch):
    """Each EinsumDense kernel's norm by the Gram form of its rows (forced) or from each example's gradient
    materialized (forced: the release sums those): the loop's per-layer clipped step either way."""
    taken = {}
    original = _layer_forms.EinsumDenseForm.sq_norms

    def spy(self, layer, calls, trainable):
        out = original(self, layer, calls, trainable)
        taken[layer.name] = out is not None
        return out

    monkeypatch.setattr(_layer_forms, "gram_cheaper", lambda *_: gram)
    monkeypatch.setattr(_layer_forms.EinsumDenseForm, "sq_norms", spy)
    model, x, y = _attention_projections()
    assert_clipped_step(model, x, y, per_layer_clip(model), per_layer=True)
    assert taken == {"query": gram, "output": gram, "rows_bias": False}


@pytest.mark.parametrize("kind", ["dense", "einsum"])
def test_a_gram_norm_where_rows_cancel_is_a_certified_upper_bound_and_every_example_still_counts(kind):
    """A Dense on a sequence in the Gram form (T = 2, 8 -> 16: T(i + j) < ij), and an EinsumDense with its output
    in two axes (``"abc,cde->abde"``, the rows as a Dense's). Rows a_2 ≈ a_1 with output gradients
    δ_2 = -δ_1 cancel: the kernel's gradient a_1ᵀδ_1 + a_2ᵀδ_2 is far below the float32 rounding of
    Σ_{t,s}(a_t·a_s)(δ_t·δ_s) (~u·S², S = Σ_t ‖a_t‖‖δ_t‖), which can round it to 0 or below on some machines.
    Whatever the machine, the rule returns an upper bound of the float64 norm, within its certified margin
    (``_rounding.gram_upper``); under clipping="normalize" the factors are finite and the clipped sum is
    Σ_i f_i g_i over every example, within the release's own rounding bound (γ_{BT+2} Σ_i f_i Σ_t |a_it||δ_it|)."""
    import jax.numpy as jnp

    from keras_dpsgd.backends.jax import _rules
    from keras_dpsgd.backends.jax.ops import JAX_OPS
    from keras_dpsgd.dp.clip import clip_factors
    from keras_dpsgd.dp import rounding as _rounding

    rng = np.random.default_rng(0)
    a1, d1 = rng.normal(size=(64, 1, 8)), rng.normal(size=(64, 1, 16))
    a = np.concatenate([a1, a1 + 1e-5 * rng.normal(size=a1.shape)], axis=1).astype("float32")
    d = np.concatenate([d1, -d1], axis=1).astype("float32")
    a64, d64 = a.astype(np.float64), d.astype(np.float64)
    g = np.einsum("bti,btj->bij", a64, d64)  # each example's kernel gradient (the bias's is Σ_t δ_t = 0)
    true_sq = np.sum(g**2, axis=(1, 2))
    lengths = np.sum(np.linalg.norm(a64, axis=2) * np.linalg.norm(d64, axis=2), axis=1)
    terms = np.abs(np.einsum("bti,bsi->bts", a64, a64) * np.einsum("btj,bsj->bts", d64, d64)).sum(axis=(1, 2))
    margin = _rounding.gamma(8 + 16 + 1) * lengths**2 + _rounding.gamma(4) * terms
    assert (true_sq < 1e-3 * margin).all()  # the case is real: the true norm is below float32's rounding

    if kind == "dense":
        layer, out_shape = keras.layers.Dense(16), (64, 1, 2, 16)
    else:
        layer, out_shape = keras.layers.EinsumDense("abc,cde->abde", (None, 4, 4), bias_axes="de"), (64, 1, 2, 4, 4)
    layer.build((None, 2, 8))
    rule = _rules.rule_for(layer)
    calls = [(a[:, None], d.reshape(out_shape))]  # [B, 1, T, ...]: each example a batch of one
    sq = rule.sq_norms(layer, calls, layer.trainable_variables)
    kernel_sq, bias_sq = (np.asarray(sq[id(v)], np.float64) for v in (layer._kernel, layer.bias))
    assert (kernel_sq >= true_sq).all()  # certified
    assert (kernel_sq <= true_sq + 3 * margin).all()  # and no looser than its margin (with the rounding of N̂²)
    d_lengths = np.sum(np.linalg.norm(d64, axis=2), axis=1)
    assert (bias_sq >= 0).all() and (bias_sq <= (2 * _rounding.gamma(8) * d_lengths) ** 2).all()

    gamma = 0.01
    columns = jnp.stack([sq[id(layer._kernel)], sq[id(layer.bias)]], axis=1)
    factors = clip_factors(JAX_OPS, columns, jnp.asarray([1.0, 1.0]), [0, 1], stability=gamma)
    assert np.isfinite(factors).all() and (np.asarray(factors) > 0).all()
    values = {id(v): v.value for v in layer.variables}
    index = {id(layer._kernel): 0, id(layer.bias): 1}
    finite = jnp.ones((64, 1), bool)
    sums = _rules.weighted_sums(layer, rule, calls, values, factors, finite, index, [0, 1])
    f = np.asarray(factors, np.float64)[:, 0]
    expected = np.einsum("b,bij->ij", f, g)
    rounding = _rounding.gamma(64 * 2 + 2) * np.einsum("b,bti,btj->ij", f, np.abs(a64), np.abs(d64))
    kernel_sum = np.asarray(sums[id(layer._kernel)], np.float64).reshape(expected.shape)
    assert (np.abs(kernel_sum - expected) <= rounding).all()
    np.testing.assert_array_equal(np.asarray(sums[id(layer.bias)]), 0.0)


def _assert_each_examples_vjp(layer, rule, calls, got):
    """`got` (the rule's closed-form gradients, [B, *shape] per trainable variable) is each example's vector-Jacobian
    product of the layer alone on a batch of one, summed over the `calls`."""
    import jax
    import jax.numpy as jnp

    variables = layer.trainable_variables
    values = {id(v): v.value for v in layer.variables}

    def one(a, d):
        pre = lambda w: _layer_forms.pre_at(layer, rule, a, _layer_forms.with_values(values, variables, w))  # noqa: E731
        return jax.vjp(pre, [values[id(v)] for v in variables])[1](d)[0]

    want = [sum(jax.vmap(one)(jnp.asarray(a), jnp.asarray(d))[k] for a, d in calls) for k in range(len(variables))]
    for g, w, v in zip(got, want, variables):
        assert g.shape == (len(calls[0][0]),) + tuple(v.shape)
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "equation, shape, bias_axes, in_shape",
    [
        ("abc,cde->abde", (6, 2, 4), "de", (6, 8)),
        ("abcd,cde->abe", (6, 8), "e", (6, 2, 4)),
        ("abc,cd->abd", (6, 4), "bd", (6, 8)),
        ("ab,bc->ac", (4,), "c", (8,)),
    ],
)
def test_einsum_dense_closed_form_gradients_are_each_examples_vector_jacobian_product(
    equation, shape, bias_axes, in_shape
):
    """``EinsumDenseForm.grads`` (``einsum("Zx,Zy->Zw")``, a bias the output gradient summed over its other letters)
    gives each example's gradient, as the vector-Jacobian product of the layer alone on a batch of one does; two
    calls add up."""
    from keras_dpsgd.backends.jax import _rules

    rng = np.random.default_rng(1)
    layer = keras.layers.EinsumDense(equation, shape, bias_axes=bias_axes)
    layer.build((None,) + in_shape)
    rule, variables = _rules.rule_for(layer), layer.trainable_variables
    out_shape = (1,) + tuple(layer.compute_output_shape((1,) + in_shape))[1:]
    calls = [
        (rng.normal(size=(5, 1) + in_shape).astype("float32"), rng.normal(size=(5,) + out_shape).astype("float32"))
        for _ in range(2)
    ]
    got = rule.grads(layer, calls, variables)
    assert got is not None
    _assert_each_examples_vjp(layer, rule, calls, got)


@pytest.mark.parametrize("kwargs", LAYER_NORMS, ids=str)
def test_layer_normalization_closed_form_gradients_are_each_examples_vector_jacobian_product(kwargs):
    """``_LayerNorm.grads`` (sums over an example's rows of δ ⊙ x̂ and δ, from the tapped rows x̂) gives each example's
    gamma and beta gradients, as the vector-Jacobian product of the layer alone on a batch of one does; two calls add
    up. Over axes other than the last alone it has no closed form (None: the vector-Jacobian product)."""
    import jax
    import jax.numpy as jnp

    from keras_dpsgd.backends.jax import _rules

    rng = np.random.default_rng(3)
    layer = keras.layers.LayerNormalization(**kwargs)
    layer.build((None, 4, 6))
    for v in layer.trainable_variables:
        v.assign(rng.normal(size=v.shape).astype("float32"))
    rule, variables = _rules.rule_for(layer), layer.trainable_variables
    raw = [rng.normal(size=(5, 1, 4, 6)).astype("float32") * 3.0 + 1.0 for _ in range(2)]
    calls = [
        (jax.vmap(lambda x: rule.tap(layer, x))(jnp.asarray(x)), rng.normal(size=x.shape).astype("float32"))
        for x in raw
    ]
    got = rule.grads(layer, calls, variables)
    if "axis" in kwargs:
        assert got is None
        return
    assert got is not None
    _assert_each_examples_vjp(layer, rule, calls, got)
