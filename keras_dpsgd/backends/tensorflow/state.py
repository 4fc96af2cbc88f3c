"""Variables written from the batch inside a traced train step.

A layer may keep a statistic of the batch in a variable (``self.v.assign(tf.reduce_mean(x, 0))``,
the moving averages of BatchNormalization in training mode). Two things follow, and both are refused:

* read back on the way to the loss (``x - self.v``), the variable carries the batch's statistic into
  every example's loss through an ordering (control) edge, where the row analysis (``_rows``, which
  follows data edges) would see a weight: the loss mixes the examples (:func:`refuse_state_reads`,
  called by ``_graph.analyze``, so by both per-example backends; a read before the write holds an
  earlier batch's statistic and counts too);
* not read back, the variable holds an un-noised statistic of the last batch, outside the ledger,
  saved with the model (:func:`refuse_batch_writes`, called by the front ends' sanitizer, which
  knows the variables that are its own or Keras's metrics').

:func:`scan` follows the batch forward from the step's inputs (``_rows.is_source``) along data
edges (not through ops that read only a shape), and through variables: an op that takes a
captured resource (a variable's handle) and a value that depends on the batch writes the batch
into it (every op but the known reads counts, so an unknown stateful op counts as a write), and
the reads of that resource created after it depend on the batch. Function calls, ``while`` loops
and conditions are followed into their bodies; a body the scan cannot read counts as writing
every resource it is given. Values the sanitizer released (noised, ``mark_released``) no longer
depend on the batch: a step's update of the weights is post-processing of its release.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Optional

import tensorflow as tf

from keras_dpsgd.backends.tensorflow import _calls, _rows
from keras_dpsgd.dp.refusals import refuse

# Ops that take a resource and only read it (variables; lookup tables: StringLookup, IntegerLookup;
# the gradient of a function call, which tf.gradients builds for a call without a registered one).
_READS = frozenset(
    {
        "SymbolicGradient",
        "ReadVariableOp",
        "ResourceGather",
        "ResourceGatherNd",
        "VariableShape",
        "VarIsInitializedOp",
        "LookupTableFindV2",
        "LookupTableSizeV2",
        "LookupTableExportV2",
    }
)
# Ops whose output is metadata (no value of the batch flows through them).
METADATA = frozenset({"Shape", "ShapeN", "Size", "Rank"})  # ops that read only a tensor's shape
_WHILES = frozenset({"While", "StatelessWhile"})
_IFS = frozenset({"If", "StatelessIf"})
_RELEASED_ATTR = "_keras_dpsgd_released"


@dataclasses.dataclass(frozen=True)
class Write:
    """An op of the step's graph (``op``) writing a value of the batch into the resource ``handle``
    (a captured handle of that graph); ``inner`` is the writing op itself (inside a body)."""

    op: Any
    inner: Any
    handle: Any

    def describe(self) -> str:
        where = f"op {self.inner.name!r} ({self.inner.type})"
        if self.inner is not self.op:
            where += f" inside {self.op.type} {self.op.name!r}"
        return f"{where} {_where(self.op)}"


def _where(op) -> str:
    scope = op.name.rpartition("/")[0]
    return f"in layer {scope!r}" if scope else "outside any layer (in the train step itself)"


# Taint of a tensor: _BATCH (a value of the batch, along data edges) or the Write whose variable it
# was read from (a value of the batch through a variable).
_BATCH = "batch"


def mark_released(tensors: Iterable[tf.Tensor]) -> None:
    """Records graph tensors the sanitizer released (noised): what depends on them is post-processing."""
    for t in tensors:
        graph = getattr(t, "graph", None)
        if graph is None or tf.executing_eagerly():
            continue
        if not hasattr(graph, _RELEASED_ATTR):
            setattr(graph, _RELEASED_ATTR, set())
        getattr(graph, _RELEASED_ATTR).add(t.ref())


def _root(t: tf.Tensor) -> tf.Tensor:
    while t.dtype == tf.resource and t.op.type == "Identity":
        t = t.op.inputs[0]
    return t


def _bodies(op) -> Optional[list]:
    """(body graph, index of op's first input that is the body's first input, body outputs) of each
    body of ``op``; [] for an op without a body; None for one whose body cannot be read."""
    if op.type in _calls.CALL_OPS:
        found = _calls.body_graph(op)
        return None if found is None else [(found[0], 0, found[1])]
    if op.type in _WHILES:
        body = getattr(op, "_body_graph", None)
        if body is None or len(body.inputs) != len(op.inputs) or len(body.outputs) != len(op.inputs):
            return None
        return [(body, 0, list(body.outputs))]
    if op.type in _IFS:
        branches = [getattr(op, name, None) for name in ("_true_graph", "_false_graph")]
        if any(b is None or len(b.inputs) != len(op.inputs) - 1 for b in branches):
            return None
        return [(b, 1, list(b.outputs)) for b in branches]
    if any(a.func.name for a in op.node_def.attr.values()) or op.type in ("Case", "StatelessCase"):
        return None  # Another op running a function.
    return []


def _visit_body(op, taint: dict, writes: list) -> Optional[list]:
    """Taints of ``op``'s outputs from its bodies (None: no body to read), recording their writes."""
    bodies = _bodies(op)
    if bodies is None or not bodies:
        return None
    outputs = [None] * len(op.outputs)
    for body, first, body_outputs in bodies:
        inner = {b.ref(): taint[t.ref()] for b, t in zip(body.inputs, op.inputs[first:]) if t.ref() in taint}
        while True:
            inner_taint, inner_writes = dict(inner), []
            _propagate(body.get_operations(), inner_taint, inner_writes, captured=None, released=set())
            got = [inner_taint.get(t.ref()) for t in body_outputs]
            if op.type not in _WHILES:
                break
            # A loop: what an iteration's outputs carry is the next iteration's inputs.
            grown = {b.ref(): g for b, g in zip(body.inputs, got) if g is not None and b.ref() not in inner}
            if not grown:
                break
            inner.update(grown)
        positions = {b.ref(): i for i, b in enumerate(body.inputs)}
        for w in inner_writes:
            i = positions.get(_root(w.handle).ref())
            if i is not None:  # A resource the body was given (else one made inside it: not kept).
                writes.append(Write(op, w.inner, op.inputs[first + i]))
        for i, g in enumerate(got[: len(outputs)]):
            outputs[i] = outputs[i] if g is None else (g if outputs[i] in (None, _BATCH) else outputs[i])
    return outputs


def _propagate(ops, taint: dict, writes: list, captured: Optional[set], released: set) -> None:
    """Forward taint over ``ops`` (creation order); appends every write of a value of the batch.

    ``captured``: the graph's captured tensors, to find the step's inputs (``_rows.is_source``);
    None in a body, whose inputs are tainted by the caller."""
    for op in ops:
        if captured is not None and _rows.is_source(op, captured):
            for t in op.outputs:
                taint[t.ref()] = _BATCH
            continue
        ins = [taint.get(t.ref()) for t in op.inputs]
        if all(i is None for i in ins) or op.type in METADATA:
            continue
        via = next((i for i in ins if isinstance(i, Write)), _BATCH)
        resources = [t for t in op.inputs if t.dtype == tf.resource]
        outputs = None
        if resources and op.type not in _READS:
            new = []
            outputs = _visit_body(op, taint, new)
            if outputs is None:
                written = any(i is not None for t, i in zip(op.inputs, ins) if t.dtype != tf.resource)
                new = [Write(op, op, r) for r in resources] if written else []
            for w in new:
                writes.append(w)
                taint[_root(w.handle).ref()] = w
        elif not resources and op.type in _calls.CALL_OPS | _WHILES | _IFS:
            outputs = _visit_body(op, taint, writes)
        if outputs is None:
            outputs = [via] * len(op.outputs)
        for t, o in zip(op.outputs, outputs):
            if o is not None and t.ref() not in released:
                taint[t.ref()] = o


@tf.autograph.experimental.do_not_convert
def scan(graph) -> tuple[list, dict]:
    """(writes of a value of the batch into a captured resource, taint of each tensor) in ``graph``.

    A captured resource the step writes the batch into holds a previous step's batch before the
    write: its reads count from the start of the step (a second pass)."""
    captured = {t.ref() for t in getattr(graph, "internal_captures", ())}
    released = getattr(graph, _RELEASED_ATTR, set())
    taint, writes = {}, []
    _propagate(graph.get_operations(), taint, writes, captured, released)
    writes = [w for w in writes if _root(w.handle).ref() in captured]
    if writes:
        taint = {_root(w.handle).ref(): w for w in reversed(writes)}
        _propagate(graph.get_operations(), taint, [], captured, released)
    return writes, taint


_READ_BACK_MESSAGE = (
    "The per-example loss reads {var}, and {write} writes a value computed from the batch into it "
    "(a statistic of the batch kept in a variable, e.g. self.v.assign(tf.reduce_mean(x, 0)) then x - self.v): "
    "through it one example changes every other example's loss, so clipping each example's gradient bounds "
    "nothing. Compute such statistics outside training with keras_dpsgd.DPNormalization (noised, charged to "
    "the ledger) or from public data (keras_dpsgd.mark_public); for BatchNormalization, freeze it "
    "(layer.trainable = False runs it in inference mode) or use LayerNormalization/GroupNormalization."
)
_WRITE_MESSAGE = (
    "The train step writes a value computed from the batch into {var} ({write}): that variable would hold an "
    "un-noised statistic of the private data, outside the privacy ledger, and be saved with the model. "
    "keras_dpsgd refuses it. For BatchNormalization, freeze it (layer.trainable = False runs it in inference "
    "mode, writing nothing) or use LayerNormalization/GroupNormalization; compute a statistic of the data "
    "with keras_dpsgd.DPNormalization (noised, charged to the ledger) or from public data "
    "(keras_dpsgd.mark_public); keep per-example values in the layer's outputs, not in a variable. (In a "
    "custom training loop, a Keras metric updated before the DP optimizer's step is not recognized as one: "
    "update it after the step.)"
)


def _name(write: Write, named: dict) -> str:
    var = named.get(_root(write.handle).ref())
    if var is not None:
        return f"variable {getattr(var, 'path', None) or var.name!r}"
    scope = write.op.name.rpartition("/")[0]
    return f"a variable of layer {scope!r}" if scope else "a variable"


def _tf_variables(var: Any) -> list:
    """The tf.Variables behind ``var`` (a Keras 3 variable's value, a distributed variable's components)."""
    if not isinstance(var, tf.Variable) and isinstance(getattr(var, "value", None), tf.Variable):
        var = var.value
    return list(getattr(var, "values", None) or [var])


def internal_handles(graph, var) -> list:
    """The placeholders standing for ``var``'s handle in ``graph`` (following nested captures)."""
    handle = var.handle
    if getattr(handle, "graph", None) is graph:
        return [handle]
    outer = getattr(graph, "outer_graph", None)
    externals = [handle]
    if outer is not None and hasattr(outer, "captures"):
        externals += internal_handles(outer, var)
    found = []
    for external, internal in getattr(graph, "captures", ()):
        if any(external is e for e in externals):
            found.append(internal)
    return found


def never_read(graph, var, tape) -> bool:
    """Whether the traced step provably never reads ``var``, so that every example's gradient of it is exactly 0.

    Certified twice: no handle of ``var`` (nor of a component of a distributed variable) is captured by ``graph``,
    the loss's graph, or a graph around it; and ``tape``, the tape that recorded the loss, watched none of them (the
    per-example jacobians of the reference path differentiate that tape: zeros then). False where unsure: no tape,
    a variable or a watched one without a handle (keras_hub's untied ``ReversibleEmbedding`` in a backbone without
    its output projection: its ``reverse_embeddings`` table).
    """
    if tape is None:
        return False
    try:
        mine = [var] + _tf_variables(var)
        handles = [v.handle for v in mine]
        watched = [v.handle for w in tape.watched_variables() for v in [w] + _tf_variables(w)]
        while graph is not None:
            if any(internal_handles(graph, v) for v in mine):
                return False
            graph = getattr(graph, "outer_graph", None)
    except (AttributeError, TypeError, ValueError, RuntimeError):
        return False
    return not any(h is w for h in handles for w in watched)


def handles_of(graph, variables: Iterable[Any]) -> dict:
    """{captured handle ref in ``graph``: variable} for ``variables``."""
    named = {}
    for var in variables:
        for v in _tf_variables(var):
            for h in internal_handles(graph, v) if hasattr(v, "handle") else ():
                named[h.ref()] = var
    return named


def _watched(graph) -> list:
    """The variables ``graph`` and its outer graphs read while they were traced."""
    found = []
    while graph is not None:
        found += list(getattr(graph, "variables", ()))
        graph = getattr(graph, "outer_graph", None)
    return found


@tf.autograph.experimental.do_not_convert
def refuse_state_reads(loss: tf.Tensor, taint: Optional[dict] = None, variables: Iterable[Any] = ()) -> None:
    """Raises ValueError if ``loss`` reads a variable the step wrote a value of the batch into
    (``taint``: of ``scan(loss.graph)``, computed if None; ``variables``: to name it by)."""
    write = (scan(loss.graph)[1] if taint is None else taint).get(loss.ref())
    if isinstance(write, Write):
        named = handles_of(loss.graph, _watched(loss.graph) + list(variables))
        raise refuse("batch-statistic-read", _READ_BACK_MESSAGE.format(var=_name(write, named), write=write.describe()))


@tf.autograph.experimental.do_not_convert
def refuse_batch_writes(loss: tf.Tensor, own: Iterable[Any], model: Any = None) -> None:
    """Raises ValueError if the step (traced so far) writes a value of the batch into a variable other
    than ``own`` (the optimizer's, its ledger's, Keras's metrics'): a model variable or an unknown
    resource; or if ``loss`` reads one it wrote (:func:`refuse_state_reads`).

    Raises:
      ValueError: naming the variable (or resource), the op and its layer, and the way out.
    """
    graph = loss.graph
    writes, taint = scan(graph)
    variables = list(getattr(model, "variables", ()) if model is not None else ())
    refuse_state_reads(loss, taint, variables)  # The more precise refusal first.
    if not writes:
        return
    exempt = handles_of(graph, own)
    named = handles_of(graph, _watched(graph) + variables)
    for write in writes:
        if _root(write.handle).ref() not in exempt:
            raise refuse(
                "batch-statistic-stored", _WRITE_MESSAGE.format(var=_name(write, named), write=write.describe())
            )
