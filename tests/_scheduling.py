"""How pytest-xdist shares the suite among its workers (``python -m pytest -q -n 2``).

Whole modules go to one worker, so that a module-scoped fixture (a training, a subprocess launch)
runs once; the modules that read the one launch of ``tests/_dist_helpers.strategy_runs`` (a cache
in the worker's process) go to one worker together. The modules that take longest start first, so
that no worker is left alone with a long one at the end; the others follow by number of tests
(pytest-xdist's own order).

Loaded by ``tests/conftest.py`` only when pytest-xdist distributes the run with its default
``--dist load``; any other ``--dist`` keeps pytest-xdist's scheduler.
"""

from __future__ import annotations

from xdist.scheduler import LoadScopeScheduling

# The modules whose tests read tests/_dist_helpers.strategy_runs().
SHARED_LAUNCH = frozenset(
    {
        "test_distribute.py",
        "test_keras3_accumulate_distribute.py",
        "test_keras3_distribute.py",
        "test_tf_keras_distribute.py",
    }
)
DISTRIBUTION = "distribution"
# The modules whose every test is a unit of its own: tests/test_backend_suites.py's child suites (JAX, torch), one a
# worker, beside each other.
PER_TEST = frozenset({"test_backend_suites.py"})
# Longest first: a worker takes the longest unit left whenever it is free, so that the two finish together
# (a long module started last leaves the other worker idle). Ranked by the seconds of their slowest tests in
# one `pytest -q -n 2 --durations=80` of the suite (2026-12-06, 1023 s at load 2-4.4 on the 2 cores): the JAX
# suite's one subprocess (204 s), the distribution launch (143 s before its tests), then the modules whose
# subprocesses or trainings take 20-60 s, then the earlier list's modules whose tests are many but short.
LONGEST_FIRST = (
    "test_backend_suites.py::test_backend_suite_passes[jax]",  # the whole JAX suite in one subprocess (~3.5 min)
    DISTRIBUTION,  # the one launch of tf.distribute processes (~2.5 min) and the four modules' tests
    "test_backend_suites.py::test_backend_suite_passes[torch]",  # the whole torch suite in one subprocess (~60 s at load 6-9; 17 s of CPU)
    "test_ledger_resume.py",  # kill-and-resume subprocesses (~55 s)
    "test_examples_frozen_backbone.py",  # example smokes in subprocesses (~75 s)
    "test_fail_closed_resume.py",  # ~45 s
    "test_keras_switch.py",  # subprocesses per environment (~40 s)
    "test_examples_main.py",
    "test_audit_cli.py",
    "test_cancelling_rows.py",  # 32 small trainings on two Kerases
    "test_vocabulary_saving.py",
    "test_keras3_cli.py",
    "test_fast_transformers.py",
    "test_examples_tools.py",
    "test_tools_tuning.py",  # a tiny random search (~45 s)
    "test_examples_user_level.py",  # an example smoke in a subprocess (~30 s)
    "test_tools_memorization.py",
    "test_clip_no_tuning.py",
    "test_behaviour.py",
    "test_keras3_without_tf_keras.py",
    "test_fast_keras3.py",
    "test_data_local.py",
    "test_keras3_step.py",
    "test_keras3_audit.py",
    "test_cli_train.py",
    "test_reference_guard.py",
    "test_audit_canaries.py",
    "test_tf_keras_extra.py",
    "test_fast_recurrent.py",
    "test_keras3_resume.py",
    "test_public_api.py",
    "test_fail_closed_graph.py",
    "test_cli_tabular.py",
    "test_ledger_keras_format.py",
    "test_readme.py",
    "test_keras3_memorization.py",
    "test_pca_training.py",
)


def scope_of(nodeid: str) -> str:
    """The unit of work of a test: its module's path, DISTRIBUTION for the modules that share the distribution
    launch, or the test itself in a PER_TEST module."""
    path = nodeid.split("::", 1)[0]
    name = path.rsplit("/", 1)[-1]
    if name in SHARED_LAUNCH:
        return DISTRIBUTION
    return nodeid if name in PER_TEST else path


def _rank(scope: str, tests: int) -> tuple[int, int]:
    name = scope.rsplit("/", 1)[-1]
    first = LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)
    return first, -tests


class ModuleScheduling(LoadScopeScheduling):
    """pytest-xdist's scope scheduler with the suite's units of work (:func:`scope_of`), longest first."""

    def _split_scope(self, nodeid: str) -> str:
        return scope_of(nodeid)

    def _assign_work_unit(self, node) -> None:
        scope = min(self.workqueue, key=lambda s: _rank(s, len(self.workqueue[s])))
        self.workqueue.move_to_end(scope, last=False)
        super()._assign_work_unit(node)
