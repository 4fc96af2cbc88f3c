"""Kept for modules that import ``is_real``/``is_integer`` from here: the validators live in
:mod:`keras_dpsgd._validate`."""

from keras_dpsgd._validate import is_integer, is_real

__all__ = ["is_integer", "is_real"]
