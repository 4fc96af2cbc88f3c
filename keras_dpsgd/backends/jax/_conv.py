"""Convolutions' per-example gradients and norms on JAX from the unfolded input: slices, no products.

A convolution's output at position t reads the input patch ``p_t`` (the entries ``x[t·stride + k·rate]`` over the
kernel's taps k, then the input channels: the kernel's own order), so its kernel's gradient of example i is Dense's
outer-product form over its T output positions, ``g_i = Σ_t p_itᵀ δ_it`` (Rochette et al. 2019, "Efficient
per-example gradient computations in convolutional neural networks"). The patches here are slices of the padded
input (exact copies), not ``lax.conv_general_dilated_patches``, which is a convolution with a one-hot kernel:
(taps·C)² products per position, several times the layer's own cost.

Per layer, by cost (Bu et al. 2023, "mixed ghost clipping"): the Gram (ghost) norm over the patches, ``B·T²·(K +
O)``, where T is small against ``K·O / (K + O)`` (K = taps·C inputs, O outputs; late layers of a deep network), else
the per-example gradients materialized, ``B·T·K·O`` (what the layer's weight gradient costs anyway), whose norms
(``_rounding.positive_upper``) and clipped sum ``Σ_i f_i g_i`` read the same materialized values: no second product
over the batch. A depthwise convolution's gradient has no sum over the input channels (``Σ_t p_itc δ_it(c·m + j)``):
it is always materialized, ``B·T·taps·C·m``.
"""

from __future__ import annotations

import itertools
import jax
import jax.numpy as jnp

__all__ = ["served", "patch_rows", "gram_cheaper", "kernel_grads", "depthwise_grads", "bias_grads"]

_HIGHEST = jax.lax.Precision.HIGHEST
# From this many input channels on, one product per kernel tap; below, a kernel row's taps stacked into one product
# (measured on CPU, benchmarks/overhead.py's shapes: C = 3 -> 2.8 vs 4.8 ms, C = 64 -> 201 vs 273 ms; the whole
# unfolded input at once, 4.5 and 209-387 ms).
_MIN_CHANNELS_PER_TAP = 32


def served(layer) -> bool:
    """Whether the unfolded forms read `layer` as it computes (channels last, one group, no LoRA, valid/same)."""
    return (
        not getattr(layer, "lora_enabled", False)
        and getattr(layer, "groups", 1) == 1
        and layer.data_format == "channels_last"
        and layer.padding in ("valid", "same")  # Conv1D's "causal": the vector-Jacobian product
    )


def _pads(size: int, out: int, k: int, stride: int, rate: int, padding: str) -> tuple[int, int]:
    """(before, after) padding of one spatial axis, as ``lax.padtype_to_pads`` (XLA's SAME: the extra one after)."""
    if padding == "valid":
        return 0, 0
    total = max((out - 1) * stride + (k - 1) * rate + 1 - size, 0)
    return total // 2, total - total // 2


def _windows(layer, x, out_shape) -> list:
    """The input windows [B, *out_shape, C] that each kernel tap reads, taps row-major (the kernel's order).

    Tap ``k`` at output position ``t`` reads ``x[t·stride + k·rate - pad_before]`` (zero in the padding): one
    strided slice of the padded input per tap.
    """
    x = x.astype(jnp.float32)
    geometry = list(zip(x.shape[1:-1], out_shape, layer.kernel_size, layer.strides, layer.dilation_rate))
    x = jnp.pad(x, [(0, 0)] + [_pads(*g, layer.padding) for g in geometry] + [(0, 0)])
    windows = []
    for tap in itertools.product(*(range(k) for k in layer.kernel_size)):
        start = [r * g[4] for r, g in zip(tap, geometry)]
        limit = [s + (g[1] - 1) * g[3] + 1 for s, g in zip(start, geometry)]
        strides = [1] + list(layer.strides) + [1]
        windows.append(jax.lax.slice(x, [0] + start + [0], [x.shape[0]] + limit + [x.shape[-1]], strides))
    return windows


def _chunk(layer, channels: int) -> int:
    """Taps per product: one where the input has many channels, else a kernel row (the last axis's taps) stacked."""
    return 1 if channels >= _MIN_CHANNELS_PER_TAP else layer.kernel_size[-1]


def _per_call(layer, calls):
    """Per call: (its windows per tap, its output gradient [B, T, O]), from the recorded (input [B, 1, *spatial,
    C], output gradient [B, 1, *out, O])."""
    for a, d in calls:
        a, d = a[:, 0], d[:, 0].astype(jnp.float32)
        yield _windows(layer, a, d.shape[1:-1]), d.reshape(d.shape[0], -1, d.shape[-1])


def patch_rows(layer, calls) -> tuple[jax.Array, jax.Array]:
    """(the patches [B, T, taps·C] of every call, their output gradients [B, T, O]), calls concatenated along T."""
    patches, grads = [], []
    for windows, d in _per_call(layer, calls):
        patches.append(jnp.stack(windows, axis=-2).reshape(d.shape[0], d.shape[1], -1))
        grads.append(d)
    return jnp.concatenate(patches, axis=1), jnp.concatenate(grads, axis=1)


def gram_cheaper(rows: int, inputs: int, outputs: int) -> bool:
    """Whether the Gram norm over `rows` positions, ``T²·(K + O)``, costs less than materializing, ``T·K·O``."""
    return rows * (inputs + outputs) < inputs * outputs


def _stacked(windows, first: int, n: int, rows: int) -> jax.Array:
    """Windows ``first .. first + n - 1`` as [B, T, n, C]."""
    w = jnp.stack(windows[first : first + n], axis=-2)
    return w.reshape(w.shape[0], rows, n, w.shape[-1])


def kernel_grads(layer, calls, shape) -> jax.Array:
    """Each example's kernel gradient [B, *shape] (``shape`` = (*kernel_size, C, O)), summed over the calls: per
    chunk of taps (:func:`_chunk`), ``Σ_t p_tᵀ δ_t`` over its windows, without the whole unfolded input at once."""
    total = None
    for windows, d in _per_call(layer, calls):
        n = _chunk(layer, windows[0].shape[-1])
        pieces = []
        for first in range(0, len(windows), n):
            p = _stacked(windows, first, n, d.shape[1])
            pieces.append(jnp.einsum("bti,btj->bij", p.reshape(p.shape[0], p.shape[1], -1), d, precision=_HIGHEST))
        g = jnp.concatenate(pieces, axis=1)  # [B, taps·C, O]: taps row-major, then the channel
        total = g if total is None else total + g
    return total.reshape((total.shape[0],) + tuple(shape))


def depthwise_grads(layer, calls, shape) -> jax.Array:
    """Each example's depthwise kernel gradient [B, *shape] (``shape`` = (*kernel_size, C, m); output channel
    ``c·m + j`` is input channel c through ``w[..., c, j]``), summed over the calls."""
    total = None
    for windows, d in _per_call(layer, calls):
        channels = windows[0].shape[-1]
        d = d.reshape(d.shape[0], d.shape[1], channels, -1)  # [B, T, C, m]
        n = _chunk(layer, channels)
        pieces = [
            jnp.einsum("btkc,btcm->bkcm", _stacked(windows, first, n, d.shape[1]), d, precision=_HIGHEST)
            for first in range(0, len(windows), n)
        ]
        g = jnp.concatenate(pieces, axis=1)  # [B, taps, C, m]
        total = g if total is None else total + g
    return total.reshape((total.shape[0],) + tuple(shape))


def bias_grads(calls) -> jax.Array:
    """Each example's bias gradient [B, O]: its output gradients summed over the positions and the calls."""
    return sum(jnp.sum(d[:, 0].astype(jnp.float32).reshape(d.shape[0], -1, d.shape[-1]), axis=1) for _, d in calls)
