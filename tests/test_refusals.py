"""The registry of refusals (keras_dpsgd/dp/refusals.py): the ids the checks raise, docs/refusals.md, messages."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from keras_dpsgd.dp import refusals

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "keras_dpsgd"
PAGE = ROOT / "docs" / "refusals.md"


def _raised_ids() -> dict[str, list[str]]:
    """Every id a check of the package raises: ``refuse("id", ...)`` (the id a literal, so that it can be read here)."""
    found: dict[str, list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "refuse"):
                continue
            arg = node.args[0] if node.args else None
            where = f"{path.relative_to(ROOT)}:{node.lineno}"
            if not (isinstance(arg, ast.Constant) and isinstance(arg.value, str)):
                found.setdefault("<not a literal>", []).append(where)
                continue
            found.setdefault(arg.value, []).append(where)
    return found


def test_every_raised_id_is_registered_and_every_registered_id_is_raised():
    registered = {k.id for k in refusals.kinds()}
    raised = _raised_ids()
    unknown = {i: where for i, where in raised.items() if i not in registered}
    assert not unknown, f"checks raise kinds the registry does not hold: {unknown}"
    assert registered <= set(raised), f"registered but raised by no check: {sorted(registered - set(raised))}"


def test_docs_page_lists_exactly_the_registered_ids():
    anchors = re.findall(r'<a id="([^"]+)"></a>', PAGE.read_text())
    assert len(anchors) == len(set(anchors)), "an id is listed twice in docs/refusals.md"
    registered = [k.id for k in refusals.kinds()]
    assert set(anchors) - set(registered) == set(), "docs/refusals.md lists ids the registry does not hold"
    assert set(registered) - set(anchors) == set(), "registered kinds missing from docs/refusals.md"
    assert anchors == registered, "the registry's order is the page's order"


# Entries of docs/refusals.md raised by checks not routed through the registry yet (plain ValueErrors): the
# ledger state's loads (dp/ledger_state.py), σ = ∞, the numeric arguments (_validate), fit without
# steps_per_epoch, the DP layers' adapt checks, the top-level names, the pfor and jit_compile checks.
# And the four entries issue 42's search and user-level lots added (a search in a tf_keras .keras/h5 save,
# record_search beyond a trial, a Poisson search with mu < 1, UserPoissonLots without user ids or over max_).
# TODO(issue 38): lowered as they are routed; never raised.
UNROUTED_ENTRIES = 13


def test_every_refusal_entry_of_the_page_is_registered_or_counted_as_unrouted():
    """An entry (a bullet) names its kind by an anchor, or by ``<!-- refusal: id -->`` when it shares the kind of
    another entry; "Not refused" entries are no refusal."""
    bullets = [line for line in PAGE.read_text().splitlines() if line.startswith("- ")]
    registered = {k.id for k in refusals.kinds()}
    shared = [m for line in bullets for m in re.findall(r"<!-- refusal: ([a-z0-9-]+) -->", line)]
    assert set(shared) <= registered, sorted(set(shared) - registered)
    unrouted = [
        line[:100]
        for line in bullets
        if not line.startswith("- <a id=") and "<!-- refusal: " not in line and not line.startswith("- Not refused")
    ]
    assert len(unrouted) <= UNROUTED_ENTRIES, "a new refusal entry needs a registered kind:\n" + "\n".join(unrouted)


def test_refuse_keeps_the_detail_and_adds_the_kind_and_its_entry():
    err = refusals.refuse("batch-statistics", "Layer 'bn' (BatchNormalization) runs in training mode")
    assert type(err) is ValueError  # TensorFlow re-raises only built-in types from a traced step
    assert refusals.refusal_id(err) == "batch-statistics" and refusals.refusal_id(ValueError("other")) is None
    message = str(err)
    assert message.startswith("Layer 'bn' (BatchNormalization) runs in training mode. [Refused (batch-statistics): ")
    assert refusals.kind("batch-statistics").summary in message
    assert message.endswith("See https://keras-dpsgd.github.io/keras-dpsgd/refusals/#batch-statistics]")
    assert "\n" not in message  # the CLI prints a refusal as one line
    with pytest.raises(KeyError):
        refusals.refuse("no-such-kind", "detail")


def test_register_refuses_a_second_registration_and_bad_ids():
    with pytest.raises(ValueError, match="registered already"):
        refusals.register("batch-statistics", "again")
    for bad in ("", "Batch", "a_b", "-a", "a b"):
        with pytest.raises(ValueError, match="lower-case words"):
            refusals.register(bad, "x")
    assert all(k.summary and "\n" not in k.summary for k in refusals.kinds())


def test_a_routed_check_raises_a_refusal_with_its_former_message():
    """backends/tensorflow/mixing.py: a layer that declares mixes_examples (no TensorFlow graph needed)."""
    from keras_dpsgd.backends.tensorflow import mixing

    class Layer:
        name = "mixer"
        mixes_examples = True

    with pytest.raises(ValueError, match="declares mixes_examples = True") as err:
        mixing.refuse_example_mixing([Layer()], None, lambda layer: False)
    assert refusals.refusal_id(err.value) == "batch-statistics"
