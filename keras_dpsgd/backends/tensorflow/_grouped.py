"""Keras's grouped convolutions: recognizing the XLA-compiled call that runs one.

TensorFlow has no CPU kernel for a grouped convolution outside XLA, so both Kerases run
``Conv1D``/``Conv2D(groups=G)`` as a call of a ``tf.function(jit_compile=True)``: tf_keras's
``BaseConv._jit_compiled_convolution_op(inputs, kernel)`` and Keras 3's ``_conv_xla`` closure
(``keras/src/backend/tensorflow/nn.py``). The traced step shows a ``PartitionedCall`` (or
``StatefulPartitionedCall``, when the body reads the kernel variable itself) whose function body
holds the convolution, whose kernel has ``cin / G`` input channels.

:func:`recognize` reads that body and accepts it only if it is exactly one grouped NHWC
``Conv2D`` and the value-preserving ops TensorFlow puts around it: ``ExpandDims``/``Squeeze``
(a Conv1D), ``SpaceToBatchND``/``BatchToSpaceND`` with one constant block shape (a dilated
convolution), ``Identity`` and ``ReadVariableOp``, and unused constants. Anything else (another
op, a non-constant block or padding, a kernel computed in the body, EXPLICIT padding, NCHW, a
Conv3D) is not recognized. A recognized call is a function of each example alone (row ``i`` of
its output depends on row ``i`` of its input), and the fast backend's rule can compute each
example's kernel gradient from the call's own input and output gradient
(:meth:`GroupedConv.conv_input`, :meth:`GroupedConv.conv_output_grad`: the body's ops replayed,
and the adjoints of those after the convolution).

:func:`grouped_bodies` finds the grouped convolutions inside Keras's calls for the refusal of the
per-example jacobian path (pfor computes them wrong), whether or not the rule recognizes the body.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Optional

import numpy as np
import tensorflow as tf

from keras_dpsgd.backends.tensorflow import _calls

CALL_OPS = _calls.CALL_OPS
# tf_keras's BaseConv._jit_compiled_convolution_op and Keras 3's backend conv's _conv_xla.
_FUNCTION_NAME = re.compile(r"^__inference__(jit_compiled_convolution_op|conv_xla)_\d+$")
_CONVOLUTIONS = ("Conv2D", "Conv3D")


@dataclasses.dataclass(frozen=True)
class _Body:
    """The function a call runs, read from its FunctionDef (what executes): nodes by name, the
    input arguments in the call's input order, the output, and the traced ops of the same names
    (for static shapes)."""

    nodes: dict  # name -> NodeDef
    args: tuple  # input argument names, in the call's input order
    output: str  # the function's only output, as a node input ("node:output:0")
    graph: tf.Graph  # the function's FuncGraph (ops named as the nodes)

    def ref(self, name: str):
        """A node input: ("arg", k), ("node", node_name, index), or None for a control input."""
        if name.startswith("^"):
            return None
        if name in self.args:
            return ("arg", self.args.index(name))
        node, _, index = name.split(":") if name.count(":") == 2 else (name, "", "0")
        return ("node", node, int(index))

    def data_inputs(self, node) -> list:
        return [r for r in (self.ref(i) for i in node.input) if r is not None]

    def op(self, name: str) -> tf.Operation:
        return self.graph.get_operation_by_name(name)


def _body(op) -> Optional[_Body]:
    """The body of a call of one of Keras's convolution functions (one output), or None."""
    found = _calls.definition(op)
    if found is None or not _FUNCTION_NAME.match(found[1].signature.name):
        return None
    fdef = found[1]
    sig, checked = fdef.signature, _calls.body_graph(op)
    if checked is None or len(sig.output_arg) != 1:
        return None
    nodes = {n.name: n for n in fdef.node_def}
    args = tuple(a.name for a in sig.input_arg)
    return _Body(nodes, args, fdef.ret[sig.output_arg[0].name], checked[0])


def is_grouped(conv: tf.Operation) -> bool:
    """Whether a Conv2D/Conv3D op's input has more channels than its kernel (groups > 1)."""
    if conv.type not in _CONVOLUTIONS or len(conv.inputs) < 2:
        return False
    x, w = conv.inputs[0], conv.inputs[1]
    if not x.shape.rank or not w.shape.rank:
        return False
    channels = x.shape[1 if conv.get_attr("data_format").decode().startswith("NC") else -1]
    return channels is not None and w.shape[-2] is not None and channels != w.shape[-2]


def grouped_bodies(op) -> list:
    """The grouped convolution ops in the body of ``op`` if it calls Keras's convolution function."""
    body = _body(op)
    if body is None:
        return []
    return [body.op(n) for n, node in body.nodes.items() if node.op in _CONVOLUTIONS and is_grouped(body.op(n))]


@dataclasses.dataclass(frozen=True)
class GroupedConv:
    """A recognized call: ``y = after(conv(before(x), kernel))`` with ``conv`` a grouped Conv2D."""

    op: tf.Operation  # the call
    x_index: int  # the call's input that is the data x
    kernel_index: int  # the call's input that is the kernel (its value, or the variable's handle)
    kernel: tf.TensorShape  # the body's convolution kernel, [kh, kw, cin / groups, cout]
    strides: tuple  # the body convolution's NHWC strides, dilations and padding
    rates: tuple
    padding: str
    before: tuple  # data-side steps, in order: ("expand", axis) or ("space_to_batch", block, paddings)
    after: tuple  # output-side steps, in order: ("squeeze", axis) or ("batch_to_space", block, crops)
    groups: int

    @property
    def blocks(self) -> int:
        """How many SpaceToBatchND blocks of each example the convolution sees (1: none)."""
        return next((int(np.prod(s[1])) for s in self.before if s[0] == "space_to_batch"), 1)

    def conv_input(self, x: tf.Tensor) -> tf.Tensor:
        """The body's convolution input for the call input ``x`` (the body's ops, replayed)."""
        for step in self.before:
            if step[0] == "expand":
                x = tf.expand_dims(x, step[1])
            else:
                x = tf.space_to_batch_nd(x, step[1], step[2])
        return x

    def conv_output_grad(self, g: tf.Tensor) -> tf.Tensor:
        """∂L/∂(the body's convolution output) from ``g`` = ∂L/∂(the call's output): the adjoints
        of the ops after the convolution, last first (BatchToSpaceND's is SpaceToBatchND with its
        crops as paddings; Squeeze's is ExpandDims)."""
        for step in reversed(self.after):
            if step[0] == "squeeze":
                g = tf.expand_dims(g, step[1])
            else:
                g = tf.space_to_batch_nd(g, step[1], step[2])
        return g


# Node type -> its number of data inputs (the ops a recognized body may hold, besides NoOp).
_ARITY = {
    "Identity": 1,
    "Const": 0,
    "Conv2D": 2,
    "ReadVariableOp": 1,
    "ExpandDims": 2,
    "Squeeze": 1,
    "SpaceToBatchND": 3,
    "BatchToSpaceND": 3,
}


class _Reader:
    """Walks a body's nodes, marking those on the recognized chain as seen."""

    def __init__(self, body: _Body):
        self.body, self.seen = body, set()

    def node(self, ref, op_type: str):
        """The node ``ref`` names, past Identities, if it is an ``op_type`` with its usual arity."""
        ref = self.follow(ref)
        node = self.body.nodes.get(ref[1]) if ref is not None and ref[0] == "node" else None
        if node is None or node.op != op_type or len(self.body.data_inputs(node)) != _ARITY[op_type]:
            return None
        self.seen.add(node.name)
        return node

    def follow(self, ref):
        while ref is not None and ref[0] == "node" and self.body.nodes.get(ref[1]) is not None:
            node = self.body.nodes[ref[1]]
            if node.op != "Identity" or len(self.body.data_inputs(node)) != 1:
                break
            self.seen.add(node.name)
            ref = self.body.data_inputs(node)[0]
        return ref

    def kind(self, ref) -> Optional[str]:
        ref = self.follow(ref)
        if ref is None or ref[0] == "arg":
            return "arg" if ref is not None else None
        node = self.body.nodes.get(ref[1])
        return None if node is None else node.op

    def inputs(self, node) -> list:
        return self.body.data_inputs(node)

    def constant(self, ref) -> Optional[np.ndarray]:
        node = self.node(ref, "Const")
        return None if node is None else tf.make_ndarray(node.attr["value"].tensor)

    def axis(self, node, rank: int) -> Optional[int]:
        """An ExpandDims' (of a rank-``rank`` input) or a one-axis Squeeze's axis, normalized."""
        if node.op == "ExpandDims":
            value = self.constant(self.inputs(node)[1])
            return int(value) % (rank + 1) if value is not None and np.ndim(value) == 0 else None
        dims = list(node.attr["squeeze_dims"].list.i)
        return int(dims[0]) % rank if len(dims) == 1 else None

    def blocks(self, node) -> Optional[tuple]:
        """(block shape, paddings or crops) of a SpaceToBatchND/BatchToSpaceND with constant ones."""
        block, pads = (self.constant(r) for r in self.inputs(node)[1:])
        if block is None or pads is None or block.ndim != 1 or pads.shape != (block.size, 2):
            return None
        return tuple(int(b) for b in block), tuple(tuple(int(p) for p in row) for row in pads)

    def rank(self, node, k: int = 0) -> int:
        return self.body.op(node.name).inputs[k].shape.rank or 0


# The value-preserving ops around the convolution, by side: op type -> step name.
_OUTPUT_SIDE = {"Squeeze": "squeeze", "BatchToSpaceND": "batch_to_space"}
_DATA_SIDE = {"ExpandDims": "expand", "SpaceToBatchND": "space_to_batch"}


def _steps(reader: _Reader, ref, kinds: dict, end: str) -> Optional[tuple]:
    """Walking back from ``ref`` through ops of ``kinds`` to a node of type ``end`` (or a body
    input, ``end="arg"``): (where the walk ended, the steps in forward order), or None."""
    steps = []
    while reader.kind(ref) != end:
        kind = reader.kind(ref)
        node = reader.node(ref, kind) if kind in kinds else None
        step = None if node is None else _step(reader, node, kinds[kind])
        if step is None:
            return None
        steps.append(step)
        ref = reader.inputs(node)[0]
    return reader.follow(ref), tuple(reversed(steps))


def _step(reader: _Reader, node, name: str) -> Optional[tuple]:
    """("squeeze" or "expand", 1) for the Conv1D axis; (name, block shape, paddings or crops)."""
    if name in ("squeeze", "expand"):
        return (name, 1) if reader.axis(node, reader.rank(node)) == 1 else None
    blocks = reader.blocks(node)
    return None if blocks is None else (name,) + blocks


def _kernel_arg(reader: _Reader, ref, expanded: bool) -> Optional[int]:
    """The body input the kernel comes from (its value, or the variable's handle), or None."""
    if expanded:
        node = reader.node(ref, "ExpandDims")
        if node is None or reader.axis(node, reader.rank(node)) != 0:
            return None
        ref = reader.inputs(node)[0]
    if reader.kind(ref) == "ReadVariableOp":
        ref = reader.inputs(reader.node(ref, "ReadVariableOp"))[0]
    return reader.follow(ref)[1] if reader.kind(ref) == "arg" else None


def _geometry(conv) -> Optional[tuple]:
    """(strides, dilations, padding) of an NHWC Conv2D node, SAME or VALID, with no stride or
    dilation across examples or channels; else None."""
    strides, rates = tuple(conv.attr["strides"].list.i), tuple(conv.attr["dilations"].list.i)
    padding = conv.attr["padding"].s.decode()
    if conv.attr["data_format"].s != b"NHWC" or padding not in ("SAME", "VALID"):
        return None
    if len(strides) != 4 or len(rates) != 4 or strides[0] != 1 or strides[3] != 1 or rates[0] != 1 or rates[3] != 1:
        return None
    return strides, rates, padding


def _consistent(before: tuple, after: tuple) -> bool:
    """ExpandDims with Squeeze, SpaceToBatchND with a BatchToSpaceND of the same block."""
    kinds_before, kinds_after = [s[0] for s in before], [s[0] for s in after]
    if kinds_before.count("expand") != kinds_after.count("squeeze") or len(before) > 2 or len(after) > 2:
        return False
    s2b = [s for s in before if s[0] == "space_to_batch"]
    b2s = [s for s in after if s[0] == "batch_to_space"]
    return len(s2b) == len(b2s) and all(a[1] == b[1] for a, b in zip(s2b, b2s))


def _only_chain(reader: _Reader) -> bool:
    """Every node is on the recognized chain, an unused constant, or a NoOp (control inputs only
    order the body's reads: no node may write)."""
    used = {r[1] for node in reader.body.nodes.values() for r in reader.inputs(node) if r[0] == "node"}
    for name, node in reader.body.nodes.items():
        if name in reader.seen or (node.op == "NoOp" and not reader.inputs(node)):
            continue
        if node.op == "Const" and name not in used:
            continue
        return False
    return True


def recognize(op) -> Optional[GroupedConv]:
    """The grouped convolution that the call ``op`` runs, or None (see the module docstring)."""
    body = _body(op)
    if body is None or len(op.outputs) != 1:
        return None
    reader = _Reader(body)
    found = _steps(reader, body.ref(body.output), _OUTPUT_SIDE, "Conv2D")
    conv = None if found is None else reader.node(found[0], "Conv2D")
    if conv is None:
        return None
    after = found[1]
    geometry = _geometry(conv)
    started = _steps(reader, reader.inputs(conv)[0], _DATA_SIDE, "arg")
    if geometry is None or started is None:
        return None
    (_, x_index), before = started
    kernel_index = _kernel_arg(reader, reader.inputs(conv)[1], expanded=any(s[0] == "expand" for s in before))
    if kernel_index is None or kernel_index == x_index or not _consistent(before, after) or not _only_chain(reader):
        return None
    traced = body.op(conv.name)
    channels, kernel = traced.inputs[0].shape, traced.inputs[1].shape
    if kernel.rank != 4 or not kernel.is_fully_defined() or channels.rank != 4 or channels[3] is None:
        return None
    groups, cout = int(channels[3]) // int(kernel[2]), int(kernel[3])
    if groups < 2 or groups * int(kernel[2]) != int(channels[3]) or cout % groups:
        return None
    return GroupedConv(op, x_index, kernel_index, kernel, *geometry, before, after, groups)


def rows_rule(op, ins, mixed):
    """Rows of a recognized call's output (``_rows``): those of its data input (the convolution
    runs per example); None if ``op`` is not recognized.

    ``mixed(op, what)`` builds the "mixes the examples" status: a kernel computed from the data.
    """
    call = recognize(op)
    if call is None:
        return None
    r = ins[call.x_index]
    if r is None or any(x is not None for k, x in enumerate(ins) if k != call.x_index):
        return mixed(op, "convolves with a filter computed from the batch")
    if r.axis != 0:
        return mixed(op, "convolves over the batch axis")
    return r
