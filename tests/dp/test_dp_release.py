"""The release, the lot state machine and Algorithm 1 of the DP core (keras_dpsgd.dp), once per array table:
closed forms (σ = 0: the clipped mean; the noise's standard deviation σ·C read from the clipped sum), and the
core's import with TensorFlow, JAX, Keras and torch blocked."""

import subprocess
import sys

import numpy as np
import pytest

from keras_dpsgd.dp import lot as L, release, step
from keras_dpsgd.dp.clip import ClippedSum


def test_add_noise_reads_the_sensitivity_from_the_clipped_sum(table):
    calls = []

    def gaussian(x, stddev, index):
        calls.append((index, float(table.numpy(stddev))))
        return x + 1.0

    sums = tuple(table.array(np.zeros(s, np.float32)) for s in [(2,), (3, 1), (1,)])
    clipped = ClippedSum(sums, 5.0, tuple(table.array(np.float32(c)) for c in (0.5, 2.0, 4.0)))
    out = release.add_noise(clipped, [1.5, 0.0, 3.0], release.each(gaussian), scale=0.5)
    np.testing.assert_allclose([c[1] for c in calls], [1.5 * 0.5 * 0.5, 3.0 * 4.0 * 0.5])
    assert [c[0] for c in calls] == [0, 2] and out[1] is sums[1]  # σ = 0: nothing drawn


@pytest.mark.parametrize("expected, want", [(4.0, 4.0), (0.0, 7.0)])
def test_normalize_by_the_expected_lot_size_else_the_count(table, expected, want):
    denominator = release.lot_denominator(table.ops, table.array(np.float32(7.0)), table.array(np.float32(expected)))
    got = release.normalize(table.ops, [table.array(np.float32([want, 2 * want]))], denominator)
    np.testing.assert_allclose(table.numpy(got[0]), [1.0, 2.0])


def test_lot_accumulates_completes_and_resets(table):
    ops = table.ops
    empty = L.Lot((table.array(np.zeros(2, np.float32)),), table.array(np.float32(0.0)), table.array(np.int32(0)))
    batch = ClippedSum((table.array(np.float32([1.0, -2.0])),), table.array(np.float32(3.0)), (1.0,))
    lot = empty
    for k in range(3):
        assert not bool(table.numpy(L.is_complete(lot, 3)))
        lot = L.accumulate(ops, lot, batch)
    assert bool(table.numpy(L.is_complete(lot, 3)))
    released = L.as_clipped_sum(ops, lot, batch.sensitivity)
    np.testing.assert_allclose(table.numpy(released.sums[0]), [3.0, -6.0])
    assert float(table.numpy(released.num_examples)) == 9.0 and released.sensitivity == (1.0,)
    again = L.reset(ops, lot)
    assert table.numpy(again.batches) == 0 and np.all(table.numpy(again.sums[0]) == 0)


class _Front:
    """A front end over plain Python state: the lot in a field, the noise recorded (σ·S per variable)."""

    def __init__(self, table, k, bounds, groups, sigmas, expected_lot_size=0.0):
        self.ops, self.accumulation, self.table = table.ops, k, table
        self._clipping = (table.array(np.float32(bounds)), groups, None)
        self.sigmas, self.expected = sigmas, expected_lot_size
        self.lot = L.Lot(
            (table.array(np.zeros(2, np.float32)), table.array(np.zeros(1, np.float32))),
            table.array(np.float32(0.0)),
            table.array(np.int32(0)),
        )
        self.stddevs, self.counted, self.nonfinite, self.applied = [], [], 0, []

    def clipping(self):
        return self._clipping

    def observe(self, clip):
        self.nonfinite += int((~self.table.numpy(clip.finite)).sum())

    def load_lot(self):
        return self.lot

    def store_lot(self, lot):
        self.lot = lot

    def add_noise(self, clipped):
        def gaussian(x, stddev, index):
            self.stddevs.append(float(self.table.numpy(stddev)))
            return x

        return release.add_noise(clipped, self.sigmas, release.each(gaussian))

    def normalize(self, noised, num_examples):
        return release.normalize(self.ops, noised, release.lot_denominator(self.ops, num_examples, self.expected))

    def count(self, num_examples):
        self.counted.append(float(self.table.numpy(num_examples)))

    def when_complete(self, complete, release_fn, reset):
        if bool(self.table.numpy(complete)):
            self.applied.append([self.table.numpy(g) for g in release_fn()])
            reset()


def _per_example(table, grads):
    """The backend's part over explicit per-example gradients (a list per variable of [B, ...])."""

    def clipped_sum(clip):
        sq = np.stack([(g.reshape(len(g), -1) ** 2).sum(1) for g in grads], axis=1).astype(np.float32)
        factors = table.numpy(clip(table.array(sq)))
        sums = [
            table.array((f[:, None] * np.nan_to_num(g) * (f[:, None] > 0)).sum(0)) for f, g in zip(factors.T, grads)
        ]
        return sums, table.array(np.float32(len(grads[0])))

    return clipped_sum


GRADS = [
    np.array([[3.0, 4.0], [0.3, 0.4], [np.nan, 1.0]], np.float32),
    np.array([[0.0], [0.0], [2.0]], np.float32),
]


def _clipped_mean(grads, bound, count):
    rows = [np.concatenate([g[i] for g in grads]) for i in range(len(grads[0])) if np.all(np.isfinite(grads[0][i]))]
    return sum(r * min(1.0, bound / np.linalg.norm(r)) for r in rows) / count


@pytest.mark.parametrize("k", [1, 3])
def test_private_step_is_the_clipped_mean_at_sigma_zero(table, k):
    front = _Front(table, k, [1.0], [0, 0], [0.0, 0.0])
    for _ in range(k):
        step.private_step(front, _per_example(table, GRADS))
    assert len(front.applied) == 1 and front.counted == [3.0 * k] and front.nonfinite == k
    want = _clipped_mean(GRADS, 1.0, 3.0)  # k equal batches over k·3 examples: the one batch's mean
    np.testing.assert_allclose(np.concatenate(front.applied[0]), want, rtol=1e-6)
    assert front.stddevs == []  # σ = 0 draws nothing
    if k > 1:
        assert int(table.numpy(front.lot.batches)) == 0  # a new lot after the release


def test_private_step_noise_is_sigma_times_each_groups_bound_once_per_lot(table):
    front = _Front(table, 2, [0.5, 2.0], [0, 1], [1.5, 3.0], expected_lot_size=10.0)
    step.private_step(front, _per_example(table, GRADS))
    assert front.stddevs == [] and front.applied == []  # half a lot: nothing released
    step.private_step(front, _per_example(table, GRADS))
    assert front.stddevs == [0.75, 6.0] and len(front.applied) == 1 and front.counted == [6.0]


_BLOCKED = """
import sys
for name in ("tensorflow", "jax", "jaxlib", "keras", "tf_keras", "torch"):
    sys.modules[name] = None
import importlib, pkgutil
import keras_dpsgd.dp as dp
names = [m.name for m in pkgutil.iter_modules(dp.__path__, "keras_dpsgd.dp.")]
for name in names:
    importlib.import_module(name)
print(len(names))
"""


def test_the_core_imports_without_tensorflow_jax_keras_or_torch():
    out = subprocess.run([sys.executable, "-c", _BLOCKED], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.split()[-1]) >= 6
