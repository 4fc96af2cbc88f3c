"""Per-example gradients on the torch backend: ``torch.func.vmap`` of one example's gradient, and their norms.

Each example's loss is computed on its own (``torch.func.vmap`` over the batch axis of ``torch.func.grad`` of a
function that sees a batch of one), so no layer can mix examples: a layer that reduces over the batch sees one
example. The contract is the other backends' (``keras_dpsgd.backends``):

    summed[v] = Σ_i factors[i, v] · g_i[v],   sq_norms[i, v] = ||g_i[v]||²

with the squared norms certified upper bounds of the float32 sums (``keras_dpsgd.dp.rounding``), and an example
whose factor is 0 contributing exactly 0, even when its gradient holds NaN or Inf (replaced by 0 before the
product). The clip factors themselves are the core's, not this module's.
"""

from __future__ import annotations

import contextlib
import math
from typing import Callable, Sequence

import torch
from keras.src.backend.torch import nn as keras_torch_nn

from keras_dpsgd.dp import rounding as _rounding

__all__ = ["per_example_grads", "perturbation_grads", "sq_norms", "staged_sq_norms", "clipped_sum", "BatchWrite"]


class BatchWrite(ValueError):
    """A value the step would keep (a non-trainable variable's new value) depends on the example."""


@contextlib.contextmanager
def contiguous_layout():
    """Keras's torch convolutions keep their inputs' memory layout (no ``channels_last`` copy) for the duration.

    Keras copies a convolution's input and kernel to the ``channels_last`` memory format, a layout hint with
    the same values, which ``torch.func.vmap`` cannot batch (``Tensor.clone(memory_format)`` is not
    implemented inside vmap); the convolution computes the same values from the contiguous tensors.
    """
    convert = keras_torch_nn._maybe_convert_to_channels_last
    keras_torch_nn._maybe_convert_to_channels_last = lambda tensor: tensor
    try:
        yield
    finally:
        keras_torch_nn._maybe_convert_to_channels_last = convert


def _composite_attention():
    """``scaled_dot_product_attention`` by its composite math (matmuls, softmax) for the duration.

    torch's fused CPU attention kernel has no ``vmap`` batching rule: under ``torch.func.vmap`` it runs once per
    example (torch warns "There is a performance drop"); its composite form is batched like any matmul. Keras asking
    for flash attention by name (``flash_attention=True``) keeps its own choice.
    """
    attention = torch.nn.attention
    return attention.sdpa_kernel([attention.SDPBackend.MATH])


def per_example_grads(loss_of_one: Callable, params: Sequence[torch.Tensor], *batched) -> tuple:
    """(per-example gradients [B, *shape] per parameter, aux) of ``loss_of_one(params, *example) -> (loss, aux)``.

    `aux` is ``(batched, shared)``: ``batched`` is stacked over the examples, ``shared`` must not depend on the
    example (each example's new non-trainable values: a value that does raises :class:`BatchWrite`). Each example
    draws its own randomness (``randomness="different"``: a Dropout mask of its own).
    """
    step = torch.func.vmap(
        torch.func.grad(loss_of_one, has_aux=True),
        in_dims=(None,) + tuple(None if b is None else 0 for b in batched),
        out_dims=(0, (0, None)),
        randomness="different",
    )
    try:
        with contiguous_layout(), _composite_attention():
            return step(list(params), *batched)
    except ValueError as err:
        if "BatchedTensor" not in str(err):  # "can not return a BatchedTensor when out_dim is None"
            raise
        raise BatchWrite(str(err)) from err


def perturbation_grads(loss_of_one: Callable, zeros: Sequence[torch.Tensor], *batched) -> tuple:
    """(∂ℓ_i/∂z_i [B, *shape] per perturbation, aux) of ``loss_of_one(zs, *example) -> (loss, aux)`` at zs = 0.

    The forward pass runs under ``torch.func.vmap`` as in :func:`per_example_grads` (each example on a batch of one,
    its own randomness, `aux` alike), each example reading its own copy z_i of every perturbation; then one backward
    pass of Σ_j ℓ_j by autograd over the batched operations, instead of ``torch.func.grad`` under the vmap: the same
    values without functorch's transform on every operation of the backward pass. Exact per example: the vmapped
    forward computes ℓ_j from example j alone, so ℓ_j does not depend on z_i for j ≠ i and ∂(Σ_j ℓ_j)/∂z_i =
    ∂ℓ_i/∂z_i; nothing else requires a gradient (the weights are detached), so no operation of the backward pass
    sums over the batch. For perturbations only (ghost norms: ``zeros`` of one example's pre-activation shapes): a
    weight would need a copy per example.
    """
    size = next(leaf for leaf in torch.utils._pytree.tree_leaves(batched) if leaf is not None).shape[0]
    copies = [z.detach().unsqueeze(0).expand(size, *z.shape).requires_grad_() for z in zeros]
    step = torch.func.vmap(
        loss_of_one,
        in_dims=(0,) + tuple(None if b is None else 0 for b in batched),
        out_dims=(0, (0, None)),
        randomness="different",
    )
    try:
        with contiguous_layout(), _composite_attention(), torch.enable_grad():
            losses, aux = step(copies, *batched)
    except ValueError as err:
        if "BatchedTensor" not in str(err):  # "can not return a BatchedTensor when out_dim is None"
            raise
        raise BatchWrite(str(err)) from err
    grads = torch.autograd.grad(losses.sum(), copies, allow_unused=True) if copies else []
    grads = [torch.zeros_like(c) if g is None else g for c, g in zip(copies, grads)]
    return grads, torch.utils._pytree.tree_map(lambda a: a.detach() if isinstance(a, torch.Tensor) else a, aux)


def staged_sq_norms(g: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(``||g_i||²`` per row i of g [B, ...] in float32, how many terms each rounded sum adds at most).

    Summed over the last axis, then over the rest: a rounding bound of ``γ_{last + rest}``.
    """
    g = g.to(torch.float32)
    shape = tuple(g.shape[1:])
    if len(shape) < 2:
        return torch.sum(torch.square(g).reshape(g.shape[0], -1), dim=1), max(1, math.prod(shape))
    last, rest = shape[-1], math.prod(shape[:-1])
    rows = torch.sum(torch.square(g).reshape(g.shape[0], rest, last), dim=2)
    return torch.sum(rows, dim=1), last + rest


def sq_norms(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """float32 [B, V]: certified upper bounds of ``||g_i[v]||²`` of per-example gradients (each [B, *shape])."""
    if not grads:
        raise ValueError("no trainable variables: nothing to clip")
    return torch.stack([_rounding.positive_upper(*staged_sq_norms(g)) for g in grads], dim=1)


def clipped_sum(grads: Sequence[torch.Tensor], factors: torch.Tensor) -> list[torch.Tensor]:
    """Σ_i factors[i, v] g_i[v] for each v (float32); a zero factor contributes exactly 0 (NaN or Inf included)."""
    summed = []
    for v, g in enumerate(grads):
        f = factors[:, v]
        if bool(torch.all(f > 0)):  # every row finite (a non-finite row has factor 0): one product, no copy
            rows = g.to(torch.float32).reshape(g.shape[0], math.prod(g.shape[1:]))
            summed.append(torch.mv(rows.t(), f).reshape(g.shape[1:]))
            continue
        f = f.reshape((-1,) + (1,) * (g.dim() - 1))
        g32 = torch.where(f > 0, g.to(torch.float32), torch.zeros((), dtype=torch.float32, device=g.device))
        summed.append(torch.sum(g32 * f, dim=0))
    return summed
