"""The torch backend's ArrayOps table (keras_dpsgd.backends.torch.TORCH_OPS): each function against numpy."""

import dataclasses

import numpy as np
import torch

from keras_dpsgd.backends.torch import TORCH_OPS as OPS
from keras_dpsgd.dp.ops import ArrayOps


def test_the_table_fills_every_field_of_the_core_table():
    assert OPS.name == "torch" and all(callable(getattr(OPS, f.name)) for f in dataclasses.fields(ArrayOps)[1:])


def test_elementwise_functions_match_numpy():
    x, y = torch.tensor([[1.0, -2.0, 3.0]]), torch.tensor([[0.5, 4.0, -1.0]])
    np.testing.assert_array_equal(OPS.minimum(x, y).numpy(), np.minimum(x.numpy(), y.numpy()))
    np.testing.assert_array_equal(OPS.maximum(x, y).numpy(), np.maximum(x.numpy(), y.numpy()))
    np.testing.assert_array_equal(OPS.where(x > 0, x, 0.0).numpy(), np.where(x.numpy() > 0, x.numpy(), 0.0))
    np.testing.assert_array_equal(OPS.where(x > 0, 1.0, y).numpy(), np.where(x.numpy() > 0, 1.0, y.numpy()))
    np.testing.assert_allclose(OPS.exp(x).numpy(), np.exp(x.numpy()), rtol=1e-6)
    assert OPS.zeros_like(x).sum() == 0 and OPS.ones_like(x).sum() == 3


def test_shapes_reductions_control_and_randomness():
    x = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    np.testing.assert_array_equal(OPS.group_sum(x, [0, 1, 0, 1], 2).numpy(), [[2, 4], [10, 12], [18, 20]])
    np.testing.assert_array_equal(OPS.gather_columns(x, [1, 1, 0]).numpy(), x.numpy()[:, [1, 1, 0]])
    assert bool(OPS.reduce_all(x >= 0)) and OPS.reduce_all(x > 0, 1, True).shape == (3, 1)
    assert OPS.cond(torch.tensor(True), lambda: 1, lambda: 2) == 1
    assert OPS.cast(torch.tensor([1, 2]), "float32").dtype == torch.float32
    key = OPS.seed_key(7, torch.tensor(3))
    a, b = OPS.random_words(key, (2, 1000), 0), OPS.random_words(key, (2, 1000), 1)
    np.testing.assert_array_equal(a.numpy(), OPS.random_words(key, (2, 1000), 0).numpy())
    assert a.shape == (2, 1000) and int(a.min()) >= 0 and int(a.max()) < 2**32 and not torch.equal(a, b)
    assert len({OPS.fold_in(key, 0), OPS.fold_in(key, 1), OPS.seed_key(7, 4), OPS.seed_key(8, 3), key}) == 5
    circle = OPS.unit_circle(torch.tensor([0.0, 2.0**30, 2.0**31]))
    np.testing.assert_allclose(circle.numpy(), [[1, 0, -1], [0, 1, 0]], atol=1e-6)
