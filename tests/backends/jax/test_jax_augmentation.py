"""Augmentation multiplicity is not built on JAX: make_private refuses it by name (plain make_private works)."""

import keras
import pytest

import keras_dpsgd.keras3 as k3


@pytest.mark.parametrize(
    "kwargs", [dict(augmentation_multiplicity=2), dict(augmentation=keras.layers.RandomFlip("horizontal"))]
)
def test_augmentation_multiplicity_is_refused_by_name(kwargs):
    model = keras.Sequential([keras.Input((4, 4, 1)), keras.layers.Flatten(), keras.layers.Dense(3)])
    with pytest.raises(ValueError, match=r"augmentation multiplicity .*KERAS_BACKEND=jax"):
        k3.make_private(model, **kwargs)
    assert not k3.is_private(model)
    k3.make_private(model, augmentation_multiplicity=1)  # K = 1 without augmentation: the plain private step
    assert k3.is_private(model)
