"""The registry of refusals (keras_dpsgd/dp/refusals.py): the ids the checks raise, docs/refusals.md, messages."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from keras_dpsgd.dp import ledger_state, refusals

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "keras_dpsgd"
PAGE = ROOT / "docs" / "refusals.md"


_ROUTES = ("refuse", "refusal_message")  # the registry's two ways out: an exception, a run-time check's message


def _called(node: ast.AST) -> str | None:
    """The name a call calls (``f(...)`` or ``module.f(...)``), None for other nodes."""
    if not isinstance(node, ast.Call):
        return None
    func = node.func
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None


def _raised_ids() -> dict[str, list[str]]:
    """Every id a check of the package raises: ``refuse("id", ...)`` or ``refusal_message("id", ...)`` (the id a
    literal, so that it can be read here)."""
    found: dict[str, list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == PACKAGE / "dp" / "refusals.py":
            continue  # the registry itself (refuse calls refusal_message with its argument)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if _called(node) not in _ROUTES:
                continue
            arg = node.args[0] if node.args else None
            where = f"{path.relative_to(ROOT)}:{node.lineno}"
            if not (isinstance(arg, ast.Constant) and isinstance(arg.value, str)):
                found.setdefault("<not a literal>", []).append(where)
                continue
            found.setdefault(arg.value, []).append(where)
    return found


def test_every_raised_id_is_registered_and_every_registered_id_is_raised():
    """Each kind is reachable: some check of the package raises it (``refuse`` or ``refusal_message`` with its id as
    a literal; a kind whose last check is removed fails here), and no check raises a kind the registry lacks."""
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


def test_every_refusal_entry_of_the_page_names_its_kind():
    """An entry (a bullet) names its kind by an anchor, or by ``<!-- refusal: id -->`` when it shares the kind of
    another entry; "Not refused" entries are no refusal. No entry is left without a kind."""
    bullets = [line for line in PAGE.read_text().splitlines() if line.startswith("- ")]
    registered = {k.id for k in refusals.kinds()}
    shared = [m for line in bullets for m in re.findall(r"<!-- refusal: ([a-z0-9-]+) -->", line)]
    assert set(shared) <= registered, sorted(set(shared) - registered)
    without_kind = [
        line[:100]
        for line in bullets
        if not line.startswith("- <a id=") and "<!-- refusal: " not in line and not line.startswith("- Not refused")
    ]
    assert not without_kind, "a refusal entry needs a registered kind:\n" + "\n".join(without_kind)


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


# No refusal past the registry. ------------------------------------------------------------------------------------

# The exception types a refusal may be, as a check would construct them directly.
_ERRORS = {t.__name__ for t in refusals.ERROR_TYPES}
# What the message of a refusal says (a plain argument error says "must be ..., got ..." instead).
_REFUSAL_WORDS = re.compile(
    r"refus|not supported|unsupported|not built|cannot be proven|under-report|outside the (privacy )?ledger"
    r"|not private|epsilon would|ε would",
    re.IGNORECASE,
)
# A direct raise whose words read as a refusal but is an argument error says so on its line, with the reason.
NOT_A_REFUSAL = "# not a privacy refusal: "


def _texts(node: ast.AST, constants: dict[str, str]) -> str:
    """The literal text a message expression holds: its string constants, f-strings' literal parts, and module
    constants it names (``_MESSAGE``, ``_MESSAGE.format(...)``)."""
    parts = []
    for sub in ast.walk(node):
        if isinstance(sub, ast.Constant) and isinstance(sub.value, str):
            parts.append(sub.value)
        elif isinstance(sub, ast.Name) and sub.id in constants:
            parts.append(constants[sub.id])
    return " ".join(parts)


def direct_refusals(source: str, name: str = "<module>") -> list[str]:
    """The places in `source` (a module of the package) that refuse past the registry.

    * A ``ValueError``/``TypeError``/``NotImplementedError``/``RuntimeError`` built directly (``raise X(...)``, or
      returned by a helper) whose message reads as a refusal (:data:`_REFUSAL_WORDS`), unless its line says
      :data:`NOT_A_REFUSAL` with the reason;
    * a ``NotImplementedError`` with a message (a feature not built: a refusal; a bare one marks an abstract method);
    * a run-time check of a traced step (``_checks.check(ok, message)``) whose message is not a
      ``refusal_message(...)`` (directly, or a name assigned from one).
    """
    tree = ast.parse(source, name)
    lines = source.splitlines()
    constants, routed_names = {}, set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            target = node.targets[0].id
            if _called(node.value) == "refusal_message":
                routed_names.add(target)
            elif node in tree.body:
                constants[target] = _texts(node.value, {})
    found = []
    for node in ast.walk(tree):
        called = _called(node)
        where = f"{name}:{getattr(node, 'lineno', '?')}"
        if called in _ERRORS and isinstance(node.func, ast.Name):
            text = " ".join(_texts(arg, constants) for arg in [*node.args, *(k.value for k in node.keywords)])
            refusal = (called == "NotImplementedError" and bool(node.args)) or bool(_REFUSAL_WORDS.search(text))
            marked = any(NOT_A_REFUSAL in line for line in lines[node.lineno - 1 : node.end_lineno])
            if refusal and not marked:
                found.append(f"{where}: {called}({text[:80]!r})")
        elif called == "check" and isinstance(node.func, ast.Attribute) and len(node.args) == 2:
            if getattr(node.func.value, "id", None) != "_checks":
                continue
            message = node.args[1]
            if not (_called(message) == "refusal_message" or getattr(message, "id", None) in routed_names):
                found.append(f"{where}: a run-time check whose message is no refusal_message")
    return found


def test_no_check_of_the_package_refuses_past_the_registry():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path != PACKAGE / "dp" / "refusals.py":  # the registry's own argument checks
            found += direct_refusals(path.read_text(), str(path.relative_to(ROOT)))
    assert not found, "refusals raised directly, not through keras_dpsgd.dp.refusals.refuse:\n" + "\n".join(found)


def test_the_scan_finds_a_refusal_raised_directly_and_passes_the_routed_ones():
    """The scan of the test above, over a module planted with each way past the registry (and the ways through)."""
    planted = """
from keras_dpsgd.dp.refusals import refuse, refusal_message

_WHY = "a feature that is not built on JAX"


def direct(x):
    raise ValueError(f"{x} is refused: it would mix the examples")  # found


def helper(feature):
    return ValueError(f"{feature} is not supported on the torch backend yet")  # found


def through_a_constant():
    raise RuntimeError(_WHY.format())  # found


def not_built():
    raise NotImplementedError("per-layer clipping on torch")  # found


def assertion(ok):
    return _checks.check(ok, "keras_dpsgd: the loss is not per example")  # found


def abstract():
    raise NotImplementedError


def routed(x):
    raise refuse("mixing-op", f"{x} is refused: it would mix the examples", RuntimeError)


def routed_check(ok):
    message = refusal_message("loss-entries", "not per example")
    return _checks.check(ok, message) + _checks.check(ok, refusal_message("mixing-op", "rows mixed"))


def argument(x):
    raise ValueError(f"x must be > 0, got {x}")


def marked(x):
    raise ValueError(f"jacobian_fallback='refuse' was asked: {x}")  # not a privacy refusal: the user's choice
"""
    found = direct_refusals(planted, "planted.py")
    planted_lines = [i + 1 for i, line in enumerate(planted.splitlines()) if line.endswith("# found")]
    assert len(planted_lines) == 5 and sorted(int(f.split(":")[1]) for f in found) == planted_lines, found


def test_refuse_keeps_the_type_a_check_raised():
    for error in refusals.ERROR_TYPES:
        err = refusals.refuse("per-example-check", "the layer was called in another order", error)
        assert type(err) is error and refusals.refusal_id(err) == "per-example-check"
    with pytest.raises(TypeError, match="a refusal is one of"):
        refusals.refuse("per-example-check", "detail", KeyError)
    assert refusals.refusal_message("loss-entries", "one entry per example") == str(
        refusals.refuse("loss-entries", "one entry per example")
    )


def _search_under_pld():
    from keras_dpsgd.accounting import PoissonSampledGaussianEvent, TuningEvent, compute_epsilon

    search = TuningEvent("poisson", (PoissonSampledGaussianEvent(0.01, 1.0, count=10),), mu=2.0)
    compute_epsilon(search, 1e-5, accountant="pld")


@pytest.mark.parametrize(
    "check, kind",
    [
        (lambda: ledger_state.loads("[1, 2]"), "foreign-ledger-state"),
        (lambda: ledger_state.loads("{noise"), "foreign-ledger-state"),
        (
            lambda: ledger_state.loads('{"version": 9}'),
            "foreign-ledger-state",
        ),
        (_search_under_pld, "search-without-bound"),
    ],
)
def test_a_routed_check_of_the_core_names_its_kind(check, kind):
    """Checks of the core and the accountant (no Keras needed): a saved ledger state that is no keras_dpsgd state,
    not even JSON (a bare JSONDecodeError before), and a search under an accountant without a bound for it."""
    with pytest.raises(ValueError) as err:
        check()
    assert type(err.value) is ValueError and refusals.refusal_id(err.value) == kind
