"""Per-example Conv2D kernel gradients without im2col patches.

For an NHWC convolution ``y = conv(x, w)`` with a ``[kh, kw, cin, cout]`` kernel, the gradient of
example ``i``'s loss with respect to the kernel tap ``(r, s)`` is

    ∂ℓ_i/∂w[r, s] = Σ_t x_i[t·stride + (r, s)·rate]ᵀ g_i[t]          (a [cin, cout] matrix)

where ``t`` runs over the output positions and ``g_i = ∂ℓ_i/∂y_i``. That is one small matmul per
tap on a slice of the padded input (Rochette et al. 2019, "Efficient per-example gradient
computations in convolutional neural networks", compute the same sums). Slicing avoids the
``[B, T, kh·kw·cin]`` im2col tensor of ``tf.image.extract_patches``, which on CPU is slow and
``kh·kw`` times the size of the input. Two layouts, chosen by shape (both exact):

* many input channels (``cin >= 32``): each tap's window sliced channels last (``[B, Ho, Wo, cin]``: runs of
  ``Wo·cin`` contiguous values, ``cin`` under a stride), one batched matmul ``[B, T, cin]ᵀ @ [B, T, cout]`` per tap
  (the transpose folded into the product: no channels-first copy of the input);
* few input channels whose patches are small (``kh·kw·cin <= 2·cout``: no larger than twice ``g``): the tap
  windows sliced channels first (``[B, cin, Ho, Wo]``: runs of ``Wo`` values, not of ``cin``) and stacked into
  the patches ``[B, kh·kw·cin, T]``, then one batched matmul with ``g`` (measured on CPU, one thread: AlexNet's
  5x5x3x64 on 32x32 inputs at B = 128 28 against 33 ms for the kernel rows below, 3x3x3x32 3.5 against 4.0 ms);
* other few input channels: the ``kw`` column shifts stacked once (``[B, Hp, Wo, kw, cin]``), then one
  einsum per kernel row over ``[B, Ho, Wo, kw, cin]`` and ``g``.

A strided convolution's input is first split into its stride phases (``_phased``, a reshape), so that every
slice is contiguous: TensorFlow's strided slices cost far more than the products on CPU.
"""

from __future__ import annotations

import tensorflow as tf

# Below this many input channels, stacking the column shifts beats one matmul per tap (measured on
# CPU with benchmarks/overhead.py's shapes: cin = 3 -> 39 vs 95 ms, cin = 64 -> 268 vs 127 ms).
_MIN_CHANNELS_PER_TAP = 32


def _pads(size: int, out: int, k: int, stride: int, rate: int, padding: str) -> tuple[int, int]:
    """TensorFlow's (before, after) padding of one spatial axis."""
    if padding == "VALID":
        return 0, 0
    total = max((out - 1) * stride + (k - 1) * rate + 1 - size, 0)
    return total // 2, total - total // 2


def _phased(x, g, kernel, strides, rates, padding):
    """The padded input as stride phases, and per kernel row and column the (offset, phase) it reads.

    Tap ``(r, s)`` reads input rows ``r·rate_h + t·stride_h`` (t over the output rows): with the rows
    split into ``stride_h`` phases (``x6[:, q, p] = x[:, q·stride_h + p]``, a reshape of the padded
    input, no copy), those are rows ``offset .. offset + Ho - 1`` of phase ``p``, where
    ``(offset, p) = divmod(r·rate_h, stride_h)``: a contiguous slice. TensorFlow's strided slices
    (``x[:, r::stride]``) are about 10x slower on CPU than the matmuls they feed (measured: a stride-2
    3x3x32x64 kernel on 30x30 inputs, 140 ms of slices against 6 ms of matmuls at B = 64).

    Returns ``x6`` [B, Hq, stride_h, Wq, stride_w, cin] and the lists of (offset, phase) of the kernel
    rows and columns.
    """
    (kh, kw), (_, h, w, c), (_, ho, wo, _) = kernel, x.shape.as_list(), g.shape.as_list()
    sh, sw, rh, rw = strides[1], strides[2], rates[1], rates[2]
    top, bottom = _pads(h, ho, kh, sh, rh, padding)
    left, right = _pads(w, wo, kw, sw, rw, padding)
    hq, wq = -(-(top + h + bottom) // sh), -(-(left + w + right) // sw)  # the phases' lengths
    x = tf.pad(x, [[0, 0], [top, hq * sh - h - top], [left, wq * sw - w - left], [0, 0]])
    x6 = tf.reshape(x, tf.stack([tf.shape(x)[0], hq, sh, wq, sw, c]))
    return x6, [divmod(r * rh, sh) for r in range(kh)], [divmod(s * rw, sw) for s in range(kw)]


def _tap(x6, row, col, ho: int, wo: int) -> tf.Tensor:
    """The input window [B, Ho, Wo, cin] that kernel tap (row, col) reads (``_phased``'s offsets)."""
    (r0, rp), (c0, cp) = row, col
    return x6[:, r0 : r0 + ho, rp, c0 : c0 + wo, cp, :]


def form(kernel: tuple[int, int], cin: int, cout: int) -> str:
    """How :func:`per_example_kernel_grads` materializes (the module docstring): "tap", "patches" or "row"."""
    if cin >= _MIN_CHANNELS_PER_TAP:
        return "tap"
    return "patches" if kernel[0] * kernel[1] * cin <= 2 * cout else "row"


def geometry_known(x: tf.Tensor, y: tf.Tensor) -> bool:
    """Whether the spatial sizes of input and output are static (needed to plan the slices)."""
    return all(t.shape[k] is not None for t in (x, y) for k in (1, 2))


def per_example_kernel_grads(
    x: tf.Tensor, g: tf.Tensor, kernel: tuple[int, int], strides, rates, padding: str
) -> list[tf.Tensor]:
    """Per-example kernel gradients of an NHWC Conv2D, in pieces.

    Returns ``kh·kw`` tensors [B, cin, cout] (one per tap), one tensor [B, kh·kw·cin, cout] (the patches'
    product) or ``kh`` tensors [B, kw, cin, cout] (one per kernel row), as :func:`form` says; per example,
    their flattenings concatenated in order are the row-major flattening of the [kh, kw, cin, cout] gradient.
    They are not stacked: that would copy the whole [B, kh, kw, cin, cout] tensor once more.

    Args:
      x: the convolution's input, [B, H, W, cin] (float32, static H and W).
      g: ∂(Σ_i ℓ_i)/∂y, [B, Ho, Wo, cout] (float32, static Ho and Wo); row i is ∂ℓ_i/∂y_i.
      kernel: (kh, kw).
      strides, rates: the op's 4-element strides and dilations (NHWC).
      padding: "SAME" or "VALID".
    """
    (_, _, _, cin), (_, ho, wo, cout) = x.shape.as_list(), g.shape.as_list()
    x6, rows, cols = _phased(x, g, kernel, strides, rates, padding)
    batch = tf.shape(x)[0]
    how = form(kernel, cin, cout)
    if how == "tap":
        # Channels-last windows, the product transposed (measured on CPU, one thread, B = 64 / 128: a stride-2
        # 3x3x32x64 kernel on 30x30 inputs 8.5 against 12 ms with channels-first windows of a transposed input,
        # AlexNet's 5x5x64x64 on 15x15 77 against 90-109 ms).
        g3 = tf.reshape(g, tf.stack([batch, ho * wo, cout]))
        return _chained(
            lambda row, col: tf.matmul(
                tf.reshape(_tap(x6, row, col, ho, wo), tf.stack([batch, ho * wo, cin])), g3, transpose_a=True
            ),
            [(row, col) for row in rows for col in cols],
        )
    if how == "patches":
        x6 = tf.transpose(x6, [0, 5, 1, 2, 3, 4])  # channels first: [B, cin, Hq, sh, Wq, sw] (a few channels)
        windows = [x6[:, :, r0 : r0 + ho, rp, c0 : c0 + wo, cp] for r0, rp in rows for c0, cp in cols]
        patches = tf.reshape(tf.stack(windows, axis=1), tf.stack([batch, -1, ho * wo]))  # rows in (r, s, c) order
        return [tf.matmul(patches, tf.reshape(g, tf.stack([batch, ho * wo, cout])))]
    # The kw column windows stacked once per row phase ([B, Hq, Wo, kw, cin]), then one einsum per kernel row.
    shifted = {
        p: tf.stack([x6[:, :, p, c0 : c0 + wo, cp, :] for c0, cp in cols], axis=3) for p in sorted({p for _, p in rows})
    }
    return _chained(
        lambda row: tf.einsum("bhwkc,bhwo->bkco", shifted[row[1]][:, row[0] : row[0] + ho], g), [(row,) for row in rows]
    )


def per_example_grouped_kernel_grads(
    x: tf.Tensor, g: tf.Tensor, kernel: tuple[int, int], strides, rates, padding: str, groups: int
) -> list[tf.Tensor]:
    """Per-example kernel gradients of a grouped NHWC Conv2D, in the pieces of
    :func:`per_example_kernel_grads`.

    With ``G = groups``, a ``[kh, kw, cin / G, cout]`` kernel's columns ``[g·cout/G, (g+1)·cout/G)``
    convolve input channels ``[g·cin/G, (g+1)·cin/G)`` only: group ``g``'s gradient is that of a
    plain convolution of those input channels, with ``g``'s output channels of ∂L/∂y. Each piece
    of the kernel is the groups' pieces side by side along the output channels (the last axis).

    Args:
      x: the convolution's input, [B, H, W, cin] (float32, static H, W and cin).
      g: ∂(Σ_i ℓ_i)/∂y, [B, Ho, Wo, cout] (float32, static Ho, Wo and cout).
      kernel, strides, rates, padding: as for :func:`per_example_kernel_grads`.
      groups: G, dividing cin and cout.
    """
    xs, gs = tf.split(x, groups, axis=3), tf.split(g, groups, axis=3)
    per_group = [per_example_kernel_grads(xg, gg, kernel, strides, rates, padding) for xg, gg in zip(xs, gs)]
    return [tf.concat(list(pieces), axis=-1) for pieces in zip(*per_group)]


def per_example_depthwise_grads(
    x: tf.Tensor, g: tf.Tensor, kernel: tuple[int, int], strides, rates, padding: str
) -> list[tf.Tensor]:
    """Per-example kernel gradients of an NHWC depthwise convolution, one piece per kernel row.

    For a ``[kh, kw, cin, m]`` kernel (channel multiplier ``m``; output channel ``c·m + j`` is
    input channel ``c`` convolved with ``w[:, :, c, j]``), example ``i``'s gradient at tap
    ``(r, s)`` is ``Σ_t x_i[t·stride + (r, s)·rate, c] · g_i[t, c·m + j]``: per channel, no sum over
    the input channels. Returns ``kh·kw`` tensors [B, cin, m], one per tap (their per-example
    flattenings, concatenated, are the row-major flattening of the kernel's gradient).

    Args: as :func:`per_example_kernel_grads`; ``g`` is [B, Ho, Wo, cin·m].
    """
    (_, _, _, cin), (_, ho, wo, cout) = x.shape.as_list(), g.shape.as_list()
    x6, rows, cols = _phased(x, g, kernel, strides, rates, padding)
    g5 = tf.reshape(g, tf.stack([tf.shape(g)[0], ho, wo, cin, cout // cin]))
    taps = [(row, col) for row in rows for col in cols]
    # One multiply-and-reduce per tap (an einsum with the channel as a batch axis would transpose
    # the whole input and gradient for every tap: 8x slower on CPU for a 32x32x32 input).
    return _chained(lambda row, col: tf.reduce_sum(_tap(x6, row, col, ho, wo)[..., None] * g5, axis=[1, 2]), taps)


def _chained(piece, args: list) -> list[tf.Tensor]:
    """``[piece(*a) for a in args]``, each started after the previous one finished.

    Without the chain the executor may cut every slice at once (kh·kw copies of the input alive
    together); with it, one at a time. The matmuls themselves still use all intra-op threads.
    """
    out = []
    for a in args:
        with tf.control_dependencies(out[-1:]):
            out.append(piece(*a))
    return out
