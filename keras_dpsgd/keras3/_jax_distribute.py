"""Several devices on JAX: ``keras.distribution.DataParallel``, the per-example part under ``jax.shard_map``.

Under ``DataParallel`` Keras shards each batch over the devices of a 1-D mesh and replicates the
variables, and its one ``jit`` program is partitioned by GSPMD. GSPMD does not serve the per-example
part: ``jax.vmap`` of ``jax.grad`` of a convolution, with the batch sharded, gave wrong per-example
kernel gradients on 2 CPU devices (JAX 0.10.2; a pure-JAX ``lax.conv_general_dilated`` reproduces it,
no Keras and no keras_dpsgd involved, while the summed non-private gradient is right): an XLA
partitioner bug, most likely in the grouped convolution (``feature_group_count`` = batch) that
batching the kernel's gradient makes. So the DP step runs that part per device, by hand (:func:`per_device`):

1. each device computes its examples' gradients (``vmap``, a batch of one each), their norms and
   clip factors, and its clipped sum (``keras_dpsgd.keras3._jax_train_step.clipped_sum_per_device``);
2. ``psum`` over the batch axis: the clipped sum of the whole batch, on every device;
3. back in the global program: ONE noise draw from the step's key (the same key, one array, not
   one per device), divided by L once, the descent rule, ``noised_steps`` + 1: the ledger counts
   one lot, whatever the number of devices.

Inside ``shard_map`` the trainable values are cast to device-varying (``jax.lax.pcast``) before
they are differentiated: the gradient of a replicated input of ``shard_map`` is, by JAX's rules,
summed over the devices (its cotangent is ``psum``-ed), which would give every example the sum of
its device group's gradients. Padding rows of Poisson lots (sample weight 0) have factor 0 on
whichever device holds them, so a lot size not divisible by the device count changes nothing.

Only ``DataParallel`` on one process is built; ``ModelParallel`` and any other distribution, several
processes, and adaptive clipping under ``DataParallel`` (its norm queries are not split yet) are
refused by name.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import keras

from keras_dpsgd.backends.jax import not_built
from keras_dpsgd.dp.refusals import refuse

__all__ = ["DataParallelMesh", "check_replicated", "data_parallel_mesh", "per_device", "varying"]


class DataParallelMesh(NamedTuple):
    """The JAX mesh of a ``DataParallel`` distribution and the name of its batch axis."""

    mesh: Any
    axis: str


def data_parallel_mesh(model: Any = None) -> DataParallelMesh | None:
    """The mesh of the current ``keras.distribution``, None without one; refuses what is not built.

    Raises:
      ValueError: a distribution other than ``DataParallel`` (e.g. ``ModelParallel``), a ``DataParallel``
        over several processes or on a mesh of several axes, or adaptive clipping (`model`'s optimizer)
        under it, each named.
    """
    distribution = keras.distribution.distribution()
    if distribution is None:
        return None
    name = f"keras.distribution.{type(distribution).__name__}"
    if type(distribution) is not keras.distribution.DataParallel:
        raise refuse(
            "keras-distribution", not_built(f"{name} (only keras.distribution.DataParallel is built for the DP step)")
        )
    if jax.process_count() > 1:
        raise refuse(
            "keras-distribution",
            not_built(f"{name} over {jax.process_count()} processes (one process, several devices is built)"),
        )
    from keras_dpsgd.keras3 import _adaptive_values as _adaptive

    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None and _adaptive.is_adaptive(optimizer):
        raise refuse(
            "adaptive-clipping-backend", not_built(f"adaptive clipping ({type(optimizer).__name__}) under {name}")
        )
    mesh = distribution.device_mesh
    if len(mesh.shape) != 1:
        raise refuse(
            "keras-distribution",
            not_built(f"{name} on a {len(mesh.shape)}-D device mesh (a 1-D mesh, the batch axis, is built)"),
        )
    return DataParallelMesh(mesh.backend_mesh, distribution.batch_dim_name)


def check_replicated(model: Any) -> None:
    """Refuses variables given a layout of their own (sharded) under DataParallel: the step replicates them."""
    for variable in model.variables:
        layout = getattr(variable, "_layout", None)
        if layout is not None and any(axis is not None for axis in layout.axes):
            raise refuse(
                "keras-distribution",
                not_built(f"a sharded variable ({variable.path}, layout {layout.axes}) under DataParallel"),
            )


def per_device(
    fn: Callable,
    where: DataParallelMesh,
    replicated: tuple,
    batched: tuple,
) -> tuple:
    """``fn(*replicated, *batched)`` run per device over the batch axis of `where`, under ``jax.shard_map``.

    `fn` returns ``(summed, per_example, per_device)``: `summed` (a list of arrays) is ``psum``-ed over
    the devices; `per_example` (arrays with the batch axis first) are put back in batch order;
    `per_device` (any arrays) come back stacked over the devices, device 0's first. Every value in
    `replicated` is the same on all devices; trainable values among them must be cast to varying by
    `fn` before they are differentiated (:func:`varying`).
    """
    from jax.sharding import PartitionSpec

    batch = PartitionSpec(where.axis)

    def body(*args):
        summed, per_example, per_dev = fn(*args)
        summed = [jax.lax.psum(s, where.axis) for s in summed]
        per_dev = jax.tree_util.tree_map(lambda a: a[None], per_dev)
        return summed, per_example, per_dev

    in_specs = tuple(PartitionSpec() for _ in replicated) + tuple(batch for _ in batched)
    mapped = jax.shard_map(
        body, mesh=where.mesh, in_specs=in_specs, out_specs=(PartitionSpec(), batch, batch), check_vma=True
    )
    return mapped(*replicated, *batched)


def varying(values: Any, where: DataParallelMesh | None) -> Any:
    """`values` cast to device-varying inside :func:`per_device` (no-op without a mesh): see the module docstring."""
    if where is None:
        return values
    return jax.tree_util.tree_map(lambda v: jax.lax.pcast(v, where.axis, to="varying"), values)
