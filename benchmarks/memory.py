"""Peak memory of the DP step against the non-private step (issue 41 item 7), one JSON object on stdout.

Usage::

    python benchmarks/memory.py                                  # every case, Keras 3 on TensorFlow, CPU
    python benchmarks/memory.py --cases bert-lora --steps 3
    python benchmarks/memory.py --cases bert-base-lora --configs nonprivate lots_split --steps 2

Each (case, configuration) runs in a fresh process: build the model, compile, train ``--steps`` batches with one
``fit``; measured there: ``peak_mib``, the process's peak resident set size (``VmHWM`` of /proc/self/status: what
issue 41 measured), and ``delta_mib``, that peak minus the RSS just before ``fit`` (what training itself adds:
the traced graph, activations, gradients, per-example buffers; RSS includes the allocator's caches, an upper
bound on the live tensors). Every configuration holds the same training set of N = 16 L examples in memory (numpy),
fed the way it is documented: ``fit(x, y, batch_size=..., steps_per_epoch=...)`` for non-private training,
``PoissonLots(x, y, ...).dataset(...)`` for the lots (each keeps one tensor copy of it: ``data_mib`` each). The configurations, for an expected lot size L:

* ``nonprivate``: Keras 3 ``fit`` (SGD, mean loss) on batches of L rows;
* ``fast``: the DP step (``make_private``, ``DPSGDOptimizer``, fast backend, σ = 1.1) on batches of L rows
  (equal rows);
* ``nonprivate_padded``: non-private on batches of R rows, R = ``PoissonLots(expected_lot_size=L)``'s
  ``physical_batch_size`` (the capacity, about L + 6√L): what the padding rows alone cost;
* ``lots``: the DP step fed ``PoissonLots(expected_lot_size=L)`` (padded to R rows): the documented path;
* ``lots_split``: the same lots split into k = ceil(R / L) physical batches of P = ceil(R / k) <= L rows
  (``PoissonLots(expected_lot_size=L, max_physical_batch_size=L)``, the optimizer's
  ``gradient_accumulation_steps`` = k): a lot's clipped sums accumulated over its batches, released once; the same
  rows (about R) as ``lots`` and fixed shapes, so the timing still reveals nothing, at the memory of a step on at
  most L rows.

Ratios: ``equal_rows`` = fast / nonprivate, ``padded_rows`` = lots / nonprivate_padded, ``lots`` = lots /
nonprivate (issue 41 asks for at most 1.2 on the issue's cases), ``lots_split`` = lots_split / nonprivate, each
of the peak and of the delta.

Issue 41's cases at full size: ``bert-base-lora``: keras_hub ``BertBackbone`` with BERT-base's sizes (12 layers,
hidden 768, 12 heads, intermediate 3072, vocabulary 30522; random weights), T = 128, ``enable_lora(4)``, pooled
output -> Dense(2); ``resnet50-frozen``: ``keras.applications.ResNet50(weights=None)`` on 224x224x3, frozen
(``training=False``), global average pool -> Dense(10); ``llama-4x1024-lora``: keras_hub ``LlamaBackbone`` 4
layers, hidden 1024, 8 query / 4 key-value heads, intermediate 2816, vocabulary 32000, ``enable_lora(4)``, the
tied (frozen) token embedding as the output layer, a token-level causal-LM loss, T = 128.
Reduced versions (for a shared 2-core CPU): ``bert-lora``: keras_hub ``BertBackbone`` 4 layers, hidden 256, 4 heads, intermediate 1024,
T = 128, ``enable_lora(4)``, pooled output -> Dense(2); ``llama-lora``: keras_hub ``LlamaBackbone`` 4 layers,
hidden 256, 4 query / 2 key-value heads, intermediate 512, T = 128, ``enable_lora(4)``, a token-level causal-LM
loss (next-token ids, vocabulary 1000); ``mobilenet-frozen``: ``keras.applications.MobileNetV2(alpha=0.35,
weights=None)`` on 96x96x3, frozen (``training=False``), global average pool -> Dense(10) (stands for ResNet50
frozen + head); ``mlp``: 784-1000-10. L = 32 for every case.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import overhead  # noqa: E402 (benchmarks/ is not a package: the model builders)

CASES = ("bert-lora", "llama-lora", "mobilenet-frozen", "mlp", "bert-base-lora", "resnet50-frozen", "llama-4x1024-lora")
CONFIGS = ("nonprivate", "fast", "nonprivate_padded", "lots", "lots_split")
LOT = 32
LENGTH, VOCABULARY = 128, 1000


def build(case: str):
    """(model, loss for the non-private step, per-example loss for the DP step) of one case (overhead.py's builders)."""
    import keras

    overhead._KERAS["which"] = "3"
    sparse = keras.losses.SparseCategoricalCrossentropy
    if case == "mlp":
        model = overhead.build_model("mlp")
    elif case == "mobilenet-frozen":
        shape = _image_shape(case)
        base = keras.applications.MobileNetV2(alpha=0.35, weights=None, input_shape=shape, include_top=False)
        model = overhead.frozen_classifier(base, shape)
    elif case == "resnet50-frozen":
        shape = _image_shape(case)
        model = overhead.frozen_classifier(
            keras.applications.ResNet50(weights=None, input_shape=shape, include_top=False), shape
        )
    elif case in CASES:
        model = _language_model(case)
    else:
        raise ValueError(f"case must be one of {CASES}, got {case!r}")
    return model, sparse(from_logits=True), sparse(from_logits=True, reduction="none")


def _language_model(case: str):
    """The BERT (pooled output -> Dense(2)) and Llama (token-level LM) cases, T = LENGTH, LoRA(4)."""
    import keras
    import keras_hub

    ids = keras.Input((LENGTH,), dtype="int32")
    sizes = dict(vocabulary_size=VOCABULARY, num_layers=4, hidden_dim=256)
    if case == "bert-base-lora":  # BERT-base's sizes (110M weights), random
        base = dict(vocabulary_size=30522, num_layers=12, num_heads=12, hidden_dim=768, intermediate_dim=3072)
        return overhead.bert_classifier(ids, keras.ops.zeros_like(ids), True, max_sequence_length=LENGTH, **base)
    if case == "bert-lora":
        small = dict(num_heads=4, intermediate_dim=1024, max_sequence_length=LENGTH, **sizes)
        return overhead.bert_classifier(ids, keras.ops.zeros_like(ids), True, **small)
    if case == "llama-4x1024-lora":  # 4 decoder blocks, GQA, SwiGLU, tied (frozen) output embedding
        backbone = keras_hub.models.LlamaBackbone(
            vocabulary_size=32000,
            num_layers=4,
            num_query_heads=8,
            num_key_value_heads=4,
            hidden_dim=1024,
            intermediate_dim=2816,
        )
        backbone.enable_lora(4)
        return keras.Model(ids, backbone.token_embedding(backbone(overhead.hub_inputs(ids)), reverse=True))
    backbone = keras_hub.models.LlamaBackbone(num_query_heads=4, num_key_value_heads=2, intermediate_dim=512, **sizes)
    backbone.enable_lora(4)
    return keras.Model(ids, keras.layers.Dense(VOCABULARY)(backbone(overhead.hub_inputs(ids))))


def _image_shape(case: str) -> tuple:
    return (224, 224, 3) if case == "resnet50-frozen" else (96, 96, 3)


def data(case: str, rows: int):
    import numpy as np

    gen = np.random.default_rng(0)
    if "bert" in case or "llama" in case:
        x = gen.integers(1, VOCABULARY, size=(rows, LENGTH)).astype("int32")
        x[:, -8:] = 0  # padding tokens
        if "llama" in case:  # causal LM: next-token targets [rows, T]
            return x, np.roll(x, -1, axis=1)
        return x, gen.integers(0, 2, size=(rows,)).astype("int32")
    shape = (784,) if case == "mlp" else _image_shape(case)
    return gen.normal(size=(rows, *shape)).astype("float32"), gen.integers(0, 10, size=(rows,)).astype("int32")


def padded_rows(lot: int) -> int:
    """R: the physical rows of ``PoissonLots(expected_lot_size=lot)`` over 16 expected lots of data."""
    import numpy as np

    from keras_dpsgd import PoissonLots

    n = 16 * lot
    return PoissonLots(np.zeros((n, 1), "float32"), np.zeros(n, "int32"), expected_lot_size=lot).physical_batch_size


def child(case: str, config: str, lot: int, steps: int) -> dict:
    """Runs in a fresh process: the peak memory of ``steps`` training batches of one configuration."""
    import keras

    from keras_dpsgd import PoissonLots
    from keras_dpsgd.keras3 import DPSGDOptimizer, make_private

    model, loss, per_example_loss = build(case)
    private = config in ("fast", "lots", "lots_split")
    rows = padded_rows(lot) if config == "nonprivate_padded" else lot
    x, y = data(case, 16 * lot)  # every configuration holds the same training set (N = 16 L rows)
    lots = None
    if config.startswith("lots"):
        split = dict(max_physical_batch_size=lot) if config == "lots_split" else {}
        lots = PoissonLots(x, y, expected_lot_size=lot, seed=0, **split)
    if private:
        model = make_private(model)
        opt = DPSGDOptimizer(
            l2_norm_clip=1.0,
            noise_multiplier=1.1,
            learning_rate=0.01,
            per_example_backend="fast",
            gradient_accumulation_steps=lots.gradient_accumulation_steps if lots else 1,
        )
        model.compile(optimizer=opt, loss=per_example_loss)
    else:
        model.compile(optimizer=keras.optimizers.SGD(learning_rate=0.01), loss=loss)
    out = {"rows": rows, "loadavg_start": list(os.getloadavg()), "data_mib": (x.nbytes + y.nbytes) / 2**20}
    if lots is not None:
        lots.configure(model.optimizer)
        out.update(rows=lots.physical_batch_size, batches_per_lot=lots.gradient_accumulation_steps)
        feed = dict(x=lots.dataset(steps))
    else:
        feed = dict(x=x, y=y, batch_size=rows, steps_per_epoch=steps, shuffle=False)
    before = overhead._status_mib("VmRSS")
    started = time.perf_counter()
    model.fit(epochs=1, verbose=0, **feed)
    out.update(
        peak_mib=overhead._status_mib("VmHWM"),
        rss_before_fit_mib=before,
        delta_mib=overhead._status_mib("VmHWM") - before,
        fit_s=time.perf_counter() - started,
    )
    report = getattr(model.optimizer, "per_example_report", None)
    if report is not None:
        out["fallback_variables"] = [str(f.variable) for f in report.fallback]
    return out


def spawn(case: str, config: str, lot: int, steps: int) -> dict:
    env = dict(os.environ, KERAS_BACKEND="tensorflow")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (os.path.dirname(HERE), env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, os.path.abspath(__file__), "--_child", case, config, str(lot), str(steps)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode:
        return {"failed": True, "stderr_tail": proc.stderr[-1500:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _ratios(res: dict) -> dict:
    pairs = {"equal_rows": ("fast", "nonprivate"), "padded_rows": ("lots", "nonprivate_padded")}
    pairs.update(lots=("lots", "nonprivate"), lots_split=("lots_split", "nonprivate"))
    out = {}
    for name, (num, den) in pairs.items():
        a, b = res.get(num, {}), res.get(den, {})
        if "peak_mib" in a and "peak_mib" in b:
            out[name] = {"peak": a["peak_mib"] / b["peak_mib"], "delta": a["delta_mib"] / b["delta_mib"]}
    return out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--lot", type=int, default=LOT, help="expected lot size L (and the equal-rows batch)")
    parser.add_argument("--steps", type=int, default=3, help="training batches per process")
    args = parser.parse_args(argv)
    report = {
        "what": "issue 41 item 7: peak RSS of the DP step (Keras 3, TensorFlow, CPU) against non-private",
        "lot": args.lot,
        "steps": args.steps,
        "load_average_start": list(os.getloadavg()),
        "cpu_count": os.cpu_count(),
        "cases": {},
    }
    for case in args.cases:
        res = {config: spawn(case, config, args.lot, args.steps) for config in args.configs}
        res["ratio"] = _ratios(res)
        report["cases"][case] = res
        print(f"[memory] {case}: {json.dumps(res['ratio'])}", file=sys.stderr, flush=True)
    report["load_average_end"] = list(os.getloadavg())
    return report


if __name__ == "__main__":
    if sys.argv[1:2] == ["--_child"]:
        _, _, case_name, config_name, lot_s, steps_s = sys.argv
        print(json.dumps(child(case_name, config_name, int(lot_s), int(steps_s))))
    else:
        print(json.dumps(main(), indent=1))
