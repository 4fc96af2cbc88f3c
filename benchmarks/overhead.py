"""DP-SGD overhead over non-private training: step time, peak memory, largest batch (one JSON object).

Usage::

    python benchmarks/overhead.py                      # timing, MLP and small AlexNet, fast + reference
    python benchmarks/overhead.py --memory             # + peak memory, one fresh process per configuration
    python benchmarks/overhead.py --max-batch --max-batch-limit 4096 --memory-budget-mib 8000
    python benchmarks/overhead.py --modes fast fast-clip-only   # how much of the overhead is the noise
    python benchmarks/overhead.py --keras 3            # the same models on Keras 3 (make_private)
    python benchmarks/overhead.py --keras 3 --backend jax --models mlp alexnet transformer --modes fast
    python benchmarks/overhead.py --keras 3 --backend torch --models mlp alexnet bert-lora \
        --modes fast torch opacus-hooks opacus-ghost

What is measured:

* ``step_time``: median wall time of one ``fit`` batch (Keras callback, ``on_train_batch_begin`` to
  ``on_train_batch_end``), after a warm-up ``fit`` that traces the train function. Non-private,
  fast-DP and reference-DP runs use the same model architecture and initial weights, the same batch
  and the same process, and are interleaved in rounds so that load on a shared machine hits them
  alike. Ratio = DP median / non-private median; ``cpu_ratio``: the same of the steps' process CPU
  time (``time.process_time``, all threads), which the load of other jobs on a shared machine disturbs
  less than the wall time (it still counts spinning threads). Non-private: ``keras.optimizers.SGD`` with the mean
  loss; DP: ``DPSGDOptimizer(l2_norm_clip=1, noise_multiplier=1.1)`` with the per-example loss.
  ``--keras tf_keras`` (default): tf_keras models and ``keras_dpsgd.tf_keras.DPSGDOptimizer``;
  ``--keras 3``: the same models built with Keras 3 (``import keras``), made private with
  ``keras_dpsgd.keras3.make_private`` and compiled with ``keras_dpsgd.keras3.DPSGDOptimizer``,
  against a non-private Keras 3 ``fit``. ``--backend jax`` (with ``--keras 3``): Keras 3 on JAX
  (``KERAS_BACKEND=jax``, set before keras is imported), the DP step of ``keras_dpsgd/keras3/_jax_train_step.py`` over ``keras_dpsgd/backends/jax``:
  mode "fast" is ``per_example_backend="auto"`` (norm rules for Dense, EinsumDense, Embedding, Conv,
  LayerNormalization, the rest under ``jax.vmap``), "reference" is ``jax.vmap`` for every variable, and
  "jax-privacy" is JAX Privacy's Keras API (``jax_privacy.keras_api.make_private``, σ = 1.1, C = 1, run
  with jax-privacy installed: a venv of its own, see benchmarks/results/overhead_jax_issue29.json).
  ``--backend torch`` (with ``--keras 3``): Keras 3 on PyTorch (``keras_dpsgd/keras3/_torch_train_step.py`` over
  ``keras_dpsgd/backends/torch``; "fast" is ``per_example_backend="auto"``, "reference" ``torch.func.vmap`` for
  every variable), and in the same rounds the models' torch twins (``_torch_twins.py``, ``mlp``, ``alexnet``,
  ``bert-lora``): "torch" (plain ``torch.optim.SGD``), "opacus-hooks" and "opacus-ghost" (Opacus 1.6's
  ``PrivacyEngine``, σ = 1.1, C = 1; ``pip install keras-dpsgd[bench]``), whose ratios are over "torch";
  ``--threads`` sets torch's intra-op threads (default 1); keras_dpsgd's torch step draws its noise on a second
  Python thread besides them where they leave a core free (fewer threads than cores), else at the release in two
  halves (``ratio`` is wall time, ``cpu_ratio`` counts every thread).
* ``memory`` (``--memory``): on a GPU, ``tf.config.experimental.get_memory_info`` peak bytes; on CPU,
  the peak resident set size (``VmHWM``) of a fresh process that imports TensorFlow, builds the
  model and trains a few steps, and ``delta`` = that peak minus the RSS just before ``fit`` (what
  training itself adds: activations, gradients, per-example buffers, graph). Ratio = DP delta /
  non-private delta. RSS includes allocator caching, so it is an upper bound on live tensors.
* ``max_batch`` (``--max-batch``): the largest batch ``B0·2^k`` (k >= 0, at most
  ``--max-batch-limit``) whose measured peak (as above, delta) stays within ``--memory-budget-mib``.
  A bounded doubling search, one process per probe (each probe's ``peak_mib`` and ``delta_mib``);
  "limit" means it never exceeded the budget. ``peak_ratio_at_b0``: each DP mode's delta at the first
  batch B0 over the non-private one's (the peak-memory ratio, measured in the same probes).

Models (Abadi et al. 2016): MLP 784-1000-10 (ReLU) at B=256; small AlexNet on 32x32x3 at B=128:
conv 5x5x64 (SAME, ReLU), max-pool 3/2, conv 5x5x64 (SAME, ReLU), max-pool 3/2, dense 384, 192, 10.
Issue 18's models, B=64: ``lstm`` / ``gru``: Embedding(5000, 64) -> LSTM(64) / GRU(64) -> Dense(2)
on T=64 ids; ``stacked-lstm``: Embedding(5000, 64) -> LSTM(64, return_sequences) -> LSTM(64) -> Dense(2);
``depthwise`` (MobileNet-style): 32x32x3 -> Conv2D(32, 3) -> DepthwiseConv2D(3) ->
Conv2D(64, 1) -> global average pool -> Dense(10); ``grouped-conv`` (ResNeXt-style): 32x32x3 ->
Conv2D(32, 3) -> Conv2D(64, 3, strides=2, groups=4) -> Conv2D(64, 1) -> Conv2D(64, 3, groups=4) ->
global average pool -> Dense(10); issue 41: ``conv``: 32x32x3 -> Conv2D(32, 3) -> Conv2D(64, 3, strides=2)
-> Flatten -> Dense(10); ``transformer``: Embedding(5000, 64) on T=64 ->
MultiHeadAttention(4 heads x 32) + residual + LayerNormalization -> Dense(128, ReLU) -> Dense(64) +
residual + LayerNormalization -> average pool -> Dense(2). Issue 26: ``frozen-mobilenet``:
``applications.MobileNetV2(weights=None)`` on 32x32x3, frozen (``trainable = False``, called with
``training=False``: BatchNormalization in inference mode) -> global average pool -> Dense(10), B=64.
Issue 26's models (``--keras 3`` only, keras_hub, random weights, hidden 64, 2 layers, T=32, B=64,
a Dense(2) head): ``bert`` (BertBackbone, pooled output; segment ids from the token ids),
``bert-lora`` (the same, ``backbone.enable_lora(4)``), ``gpt2`` (GPT2Backbone, first token),
``gemma`` (GemmaBackbone, 2 query heads, 1 key/value head, head_dim 32, first token); ``mha-lora``:
Embedding(5000, 64) on T=32 -> MultiHeadAttention(2 x 32) + residual + LayerNormalization ->
Dense(64, ReLU) -> average pool -> Dense(2), ``enable_lora(4)`` on the Dense, query and value.
Issue 41's vision models (``--keras 3`` only, 32x32x3, 10 classes, B=64): ``vit`` (keras_hub ViTBackbone, 4x4
patches, 2 layers, hidden 64, MLP 128, 2 heads, the class token's output -> Dense(10)); ``efficientnet``
(``applications.EfficientNetB0(weights=None)``, frozen, called with ``training=False``, average pool -> Dense(10));
``efficientnet-top`` (the same with block7a and the top convolution trainable, every BatchNormalization frozen).
Issue 41's language models (the hub models' sizes, first token): ``llama`` / ``llama-lora`` (LlamaBackbone, 2 query
heads, 1 key/value head; LoRA rank 4), ``mistral`` (MistralBackbone, the same heads), ``bart`` / ``t5`` (BartBackbone / T5Backbone, 2 heads: the first
HUB_LENGTH/2 ids feed the encoder, the rest the decoder, the head reads the decoder's first token), ``deberta``
(DebertaV3Backbone, 2 heads, relative-position buckets HUB_LENGTH/2).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

MODES = ("nonprivate", "fast", "reference", "fast-clip-only", "jax-privacy", "torch", "opacus-hooks", "opacus-ghost")
TORCH_MODES = ("torch", "opacus-hooks", "opacus-ghost")  # torch twins (``_torch_twins``), --backend torch only
DEFAULT_BATCH = {
    "mlp": 256,
    "alexnet": 128,
    "lstm": 64,
    "gru": 64,
    "stacked-lstm": 64,
    "depthwise": 64,
    "grouped-conv": 64,
    "conv": 64,
    "transformer": 64,
    "frozen-mobilenet": 64,
    "bert": 64,
    "bert-lora": 64,
    "mha-lora": 64,
    "gpt2": 64,
    "gemma": 64,
    "vit": 64,
    "efficientnet": 64,
    "efficientnet-top": 64,
    "llama": 64,
    "llama-lora": 64,
    "mistral": 64,
    "bart": 64,
    "t5": 64,
    "deberta": 64,
}
MODEL_NAMES = tuple(DEFAULT_BATCH)
TEXT_MODELS = ("lstm", "gru", "stacked-lstm", "transformer")  # int ids [B, SEQUENCE_LENGTH] of a VOCABULARY, 2 classes
VOCABULARY, SEQUENCE_LENGTH = 5000, 64
# Keras 3 (keras_hub), int ids [B, HUB_LENGTH], 2 classes.
HUB_MODELS = (
    "bert",
    "bert-lora",
    "mha-lora",
    "gpt2",
    "gemma",
    "llama",
    "llama-lora",
    "mistral",
    "bart",
    "t5",
    "deberta",
)
HUB_LENGTH = 32
VISION_MODELS = ("vit", "efficientnet", "efficientnet-top")  # Keras 3 only, 32x32x3 images, 10 classes
KERASES = ("tf_keras", "3")
_KERAS = {"which": "tf_keras"}  # set by --keras (and by the memory child's argv)


def _keras():
    if _KERAS["which"] == "3":
        import keras
    else:
        import tf_keras as keras
    return keras


def build_model(name: str):
    keras = _keras()
    layers = keras.layers
    if name == "mlp":
        return keras.Sequential([keras.Input((784,)), layers.Dense(1000, activation="relu"), layers.Dense(10)])
    if name == "alexnet":
        return keras.Sequential(
            [
                keras.Input((32, 32, 3)),
                layers.Conv2D(64, 5, padding="same", activation="relu"),
                layers.MaxPooling2D(3, 2),
                layers.Conv2D(64, 5, padding="same", activation="relu"),
                layers.MaxPooling2D(3, 2),
                layers.Flatten(),
                layers.Dense(384, activation="relu"),
                layers.Dense(192, activation="relu"),
                layers.Dense(10),
            ]
        )
    if name in ("lstm", "gru"):
        recurrent = layers.LSTM if name == "lstm" else layers.GRU
        return keras.Sequential(
            [
                keras.Input((SEQUENCE_LENGTH,), dtype="int32"),
                layers.Embedding(VOCABULARY, 64),
                recurrent(64),
                layers.Dense(2),
            ]
        )
    if name == "stacked-lstm":
        return keras.Sequential(
            [
                keras.Input((SEQUENCE_LENGTH,), dtype="int32"),
                layers.Embedding(VOCABULARY, 64),
                layers.LSTM(64, return_sequences=True),
                layers.LSTM(64),
                layers.Dense(2),
            ]
        )
    if name == "depthwise":
        return keras.Sequential(
            [
                keras.Input((32, 32, 3)),
                layers.Conv2D(32, 3, padding="same", activation="relu"),
                layers.DepthwiseConv2D(3, padding="same", activation="relu"),
                layers.Conv2D(64, 1, activation="relu"),
                layers.GlobalAveragePooling2D(),
                layers.Dense(10),
            ]
        )
    if name == "grouped-conv":
        return keras.Sequential(
            [
                keras.Input((32, 32, 3)),
                layers.Conv2D(32, 3, padding="same", activation="relu"),
                layers.Conv2D(64, 3, strides=2, groups=4, padding="same", activation="relu"),
                layers.Conv2D(64, 1, activation="relu"),
                layers.Conv2D(64, 3, groups=4, padding="same", activation="relu"),
                layers.GlobalAveragePooling2D(),
                layers.Dense(10),
            ]
        )
    if name == "conv":
        return keras.Sequential(
            [
                keras.Input((32, 32, 3)),
                layers.Conv2D(32, 3, activation="relu"),
                layers.Conv2D(64, 3, strides=2, activation="relu"),
                layers.Flatten(),
                layers.Dense(10),
            ]
        )
    if name == "transformer":
        ids = keras.Input((SEQUENCE_LENGTH,), dtype="int32")
        h = layers.Embedding(VOCABULARY, 64)(ids)
        h = layers.LayerNormalization()(h + layers.MultiHeadAttention(4, 32)(h, h))
        h = layers.LayerNormalization()(h + layers.Dense(64)(layers.Dense(128, activation="relu")(h)))
        return keras.Model(ids, layers.Dense(2)(layers.GlobalAveragePooling1D()(h)))
    if name == "frozen-mobilenet":
        base = keras.applications.MobileNetV2(weights=None, input_shape=(32, 32, 3), include_top=False)
        return frozen_classifier(base, (32, 32, 3))
    if name in HUB_MODELS or name in VISION_MODELS:
        if _KERAS["which"] != "3":
            raise ValueError(f"model {name!r} needs Keras 3 (keras_hub): run with --keras 3")
        return _hub_model(name) if name in HUB_MODELS else _vision_model(name)
    raise ValueError(f"model must be one of {MODEL_NAMES}, got {name!r}")


def frozen_classifier(base, shape: tuple, classes: int = 10):
    """`base` (an image backbone without its top, on images of `shape`) frozen, called with ``training=False``
    (BatchNormalization in inference mode), -> global average pool -> Dense(`classes`): only the head trains."""
    keras = _keras()
    layers = keras.layers
    base.trainable = False
    images = keras.Input(shape)
    return keras.Model(images, layers.Dense(classes)(layers.GlobalAveragePooling2D()(base(images, training=False))))


def hub_inputs(ids) -> dict:
    """A keras_hub backbone's inputs on token ids `ids` (Keras 3; id 0 is padding)."""
    import keras

    return {"token_ids": ids, "padding_mask": keras.ops.not_equal(ids, 0)}


def bert_classifier(ids, segment_ids, lora: bool, **backbone_args):
    """keras_hub ``BertBackbone(**backbone_args)`` on token ids `ids` and `segment_ids` (``enable_lora(4)`` if
    `lora`), its pooled output -> Dense(2)."""
    import keras
    import keras_hub

    backbone = keras_hub.models.BertBackbone(**backbone_args)
    if lora:
        backbone.enable_lora(4)
    inputs = dict(hub_inputs(ids), segment_ids=segment_ids)
    return keras.Model(ids, keras.layers.Dense(2)(backbone(inputs)["pooled_output"]))


def _hub_model(name: str):
    """Issue 26's transformer and LoRA models (see the module doc)."""
    import keras

    layers, ops = keras.layers, keras.ops
    ids = keras.Input((HUB_LENGTH,), dtype="int32")
    if name == "mha-lora":
        h = layers.Embedding(VOCABULARY, 64)(ids)
        mha, dense = layers.MultiHeadAttention(2, 32), layers.Dense(64, activation="relu")
        h = dense(layers.LayerNormalization()(h + mha(h, h)))
        for layer in (dense, mha.query_dense, mha.value_dense):
            layer.enable_lora(4)
        return keras.Model(ids, layers.Dense(2)(layers.GlobalAveragePooling1D()(h)))
    import keras_hub

    sizes = dict(vocabulary_size=VOCABULARY, num_layers=2, hidden_dim=64, intermediate_dim=128)
    inputs = hub_inputs(ids)
    if name in ("bert", "bert-lora"):
        segment_ids = ops.cast(ops.greater_equal(ids, VOCABULARY // 2), "int32")
        return bert_classifier(
            ids, segment_ids, name == "bert-lora", num_heads=2, max_sequence_length=HUB_LENGTH, **sizes
        )
    if name in ("bart", "t5"):
        half = HUB_LENGTH // 2
        encoder, decoder = ids[:, :half], ids[:, half:]
        seq2seq = {
            "encoder_token_ids": encoder,
            "encoder_padding_mask": ops.not_equal(encoder, 0),
            "decoder_token_ids": decoder,
            "decoder_padding_mask": ops.not_equal(decoder, 0),
        }
        if name == "bart":
            backbone = keras_hub.models.BartBackbone(num_heads=2, max_sequence_length=HUB_LENGTH, **sizes)
        else:
            backbone = keras_hub.models.T5Backbone(num_heads=2, **sizes)
        return keras.Model(ids, layers.Dense(2)(backbone(seq2seq)["decoder_sequence_output"][:, 0, :]))
    heads = dict(num_query_heads=2, num_key_value_heads=1)
    if name == "gpt2":
        backbone = keras_hub.models.GPT2Backbone(num_heads=2, max_sequence_length=HUB_LENGTH, **sizes)
    elif name in ("llama", "llama-lora"):
        backbone = keras_hub.models.LlamaBackbone(**heads, **sizes)
        if name == "llama-lora":
            backbone.enable_lora(4)
    elif name == "mistral":
        backbone = keras_hub.models.MistralBackbone(**heads, **sizes)
    elif name == "deberta":
        backbone = keras_hub.models.DebertaV3Backbone(
            num_heads=2, max_sequence_length=HUB_LENGTH, bucket_size=HUB_LENGTH // 2, **sizes
        )
    else:
        backbone = keras_hub.models.GemmaBackbone(head_dim=32, **heads, **sizes)
    return keras.Model(ids, layers.Dense(2)(backbone(inputs)[:, 0, :]))


def _vision_model(name: str):
    """Issue 41's vision models on 32x32x3 (see the module doc)."""
    import keras

    layers = keras.layers
    images = keras.Input((32, 32, 3))
    if name == "vit":
        import keras_hub

        backbone = keras_hub.models.ViTBackbone(
            image_shape=(32, 32, 3), patch_size=4, num_layers=2, num_heads=2, hidden_dim=64, mlp_dim=128
        )
        return keras.Model(images, layers.Dense(10)(backbone(images)[:, 0]))
    base = keras.applications.EfficientNetB0(weights=None, input_shape=(32, 32, 3), include_top=False, pooling="avg")
    if name == "efficientnet":
        base.trainable = False  # inference mode; only the head trains
        return keras.Model(images, layers.Dense(10)(base(images, training=False)))
    for layer in base.layers:  # the top block trains, every BatchNormalization frozen (inference mode)
        top = layer.name.startswith(("block7a_", "top_"))
        layer.trainable = top and not isinstance(layer, layers.BatchNormalization)
    return keras.Model(images, layers.Dense(10)(base(images)))


def make_data(name: str, batch: int, batches: int, seed: int = 0):
    import numpy as np

    gen = np.random.default_rng(seed)
    n = batch * batches
    hub = name in HUB_MODELS
    if hub or name in TEXT_MODELS:
        length = HUB_LENGTH if hub else SEQUENCE_LENGTH
        x = gen.integers(1 if hub else 0, VOCABULARY, size=(n, length)).astype("int32")
        if hub:
            x[:, -4:] = 0  # padding
        return x, gen.integers(0, 2, size=(n,)).astype("int32")
    shape = (784,) if name == "mlp" else (32, 32, 3)
    x = gen.normal(size=(n, *shape)).astype("float32")
    y = gen.integers(0, 10, size=(n,)).astype("int32")
    return x, y


def compile_model(model, mode: str, batch: int = 0):
    keras = _keras()
    if mode == "nonprivate":
        opt = keras.optimizers.SGD(learning_rate=0.01)
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    elif mode in ("fast", "reference", "fast-clip-only"):
        if _KERAS["which"] == "3":
            from keras_dpsgd.keras3 import DPSGDOptimizer, make_private

            model = make_private(model)
        else:
            from keras_dpsgd.tf_keras import DPSGDOptimizer

        sigma = 0.0 if mode == "fast-clip-only" else 1.1  # sigma = 0: no noise is drawn
        backend = "reference" if mode == "reference" else "fast"
        if os.environ.get("KERAS_BACKEND") in ("jax", "torch") and _KERAS["which"] == "3" and mode != "reference":
            backend = "auto"  # JAX, torch: norm rules where a layer has one, else vmap ("reference": vmap only)
        opt = DPSGDOptimizer(l2_norm_clip=1.0, noise_multiplier=sigma, learning_rate=0.01, per_example_backend=backend)
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
    elif mode == "jax-privacy":
        opt, loss = _jax_privacy(model, batch)
    else:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    model.compile(optimizer=opt, loss=loss)
    return model


def _jax_privacy(model, batch: int):
    """JAX Privacy's Keras API (``jax_privacy.keras_api.make_private``) on the same model: σ = 1.1, C = 1.

    Per-example gradients under ``jax.vmap`` (``jax_privacy.clipped_grad``), divided by the batch size
    (``rescale_to_unit_norm=False``, as ours); ``train_steps`` enough for every timed fit.
    """
    import keras
    from jax_privacy import keras_api

    config = keras_api.DPKerasConfig(
        epsilon=1e9,  # only checked against σ's ε (σ is given): large enough for any timing run
        delta=1e-5,
        clipping_norm=1.0,
        batch_size=batch,
        gradient_accumulation_steps=1,
        train_steps=10**4,  # its fit counts train_size / batch_size steps per epoch: 1
        train_size=batch,
        noise_multiplier=1.1,
        rescale_to_unit_norm=False,
        seed=0,
    )
    keras_api.make_private(model, config)
    return keras.optimizers.SGD(learning_rate=0.01), keras.losses.SparseCategoricalCrossentropy(from_logits=True)


class _BatchTimer:
    """Keras callback recording the wall time of each training batch."""

    def __new__(cls):
        keras = _keras()

        class Timer(keras.callbacks.Callback):
            def __init__(self):
                super().__init__()
                self.times, self.cpu_times = [], []

            def on_train_batch_begin(self, batch, logs=None):
                self._t, self._c = time.perf_counter(), time.process_time()

            def on_train_batch_end(self, batch, logs=None):
                self.times.append(time.perf_counter() - self._t)
                self.cpu_times.append(time.process_time() - self._c)

        return Timer()


def time_steps(model, x, y, batch: int, steps: int, cpu: list | None = None) -> list[float]:
    """Wall times of `steps` batches of one fit (their process CPU times appended to `cpu` if given); a torch twin
    (``_torch_twins.TorchRun``) times its own steps on the same batches."""
    if hasattr(model, "time_steps"):
        return model.time_steps(x, y, batch, steps, cpu)
    timer = _BatchTimer()
    model.fit(
        x[: batch * steps], y[: batch * steps], batch_size=batch, epochs=1, shuffle=False, verbose=0, callbacks=[timer]
    )
    if cpu is not None:
        cpu += timer.cpu_times
    return timer.times


def _summary(times: dict, cpu: dict) -> dict:
    """Per mode: its step times, and its ratios over its own non-private run (``nonprivate``; Opacus: ``torch``)."""
    out = {}
    for mode, ts in times.items():
        base_mode = "torch" if mode.startswith("opacus") else "nonprivate"
        base = statistics.median(times[base_mode]) if base_mode in times else None
        cpu_base = statistics.median(cpu[base_mode]) if base_mode in cpu else None
        med, cpu_med = statistics.median(ts), statistics.median(cpu[mode])
        out[mode] = {
            "median_step_s": med,
            "min_step_s": min(ts),
            "mean_step_s": statistics.fmean(ts),
            "median_cpu_step_s": cpu_med,
            "steps": len(ts),
        }
        if base and mode not in ("nonprivate", "torch"):
            out[mode]["ratio"] = med / base
            out[mode]["ratio_of_min"] = min(ts) / min(times[base_mode])
            out[mode]["cpu_ratio"] = cpu_med / cpu_base
            out[mode]["ratio_over"] = base_mode
    return out


def run_timing(
    name: str, batch: int, steps: int, reference_steps: int, rounds: int, modes, kerases=("tf_keras",)
) -> dict:
    """Interleaved rounds of (non-private, fast, reference) fits in this process, for each Keras.

    With several Kerases, all their models are interleaved in the same rounds (the same load hits
    them alike) and the result has one entry per Keras.
    """
    x, y = make_data(name, batch, max(steps, reference_steps))
    configs = [(keras_name, mode) for keras_name in kerases for mode in modes]
    weights, models = None, {}
    for keras_name, mode in configs:
        _KERAS["which"] = keras_name
        if mode in TORCH_MODES:
            from _torch_twins import TorchRun

            models[keras_name, mode] = TorchRun(name, mode, batch)
            time_steps(models[keras_name, mode], x, y, batch, 2)  # warm-up
            continue
        model = build_model(name)
        weights = weights or model.get_weights()
        model.set_weights(weights)  # before compile: JAX Privacy's make_private adds weights of its own
        model = compile_model(model, mode, batch)
        time_steps(model, x, y, batch, 2)  # warm-up: traces the train function
        models[keras_name, mode] = model
    times, cpu = {config: [] for config in configs}, {config: [] for config in configs}
    for r in range(rounds):
        for keras_name, mode in configs:
            _KERAS["which"] = keras_name
            n = reference_steps if mode in ("reference", "opacus-hooks") else steps
            times[keras_name, mode] += time_steps(models[keras_name, mode], x, y, batch, n, cpu[keras_name, mode])
            print(
                f"[overhead] {name} round {r} {keras_name} {mode}: median so far "
                f"{statistics.median(times[keras_name, mode]):.4f} s",
                file=sys.stderr,
                flush=True,
            )
    out = {"batch": batch}
    for keras_name in kerases:
        res = _summary(
            {mode: times[keras_name, mode] for mode in modes}, {mode: cpu[keras_name, mode] for mode in modes}
        )
        opt = getattr(models.get((keras_name, "fast")), "optimizer", None)
        # tf_keras's optimizer holds its backend, Keras 3's in its DP state.
        backend = getattr(opt, "_backend", None) or getattr(getattr(opt, "_dp", None), "backend", None)
        if backend is not None:  # the variables the fast backend handed to the reference one
            res["fast"]["fallback_variables"] = list(getattr(backend, "last_fallback", []))
        if len(kerases) == 1:
            out.update(res)
        else:
            out[keras_name] = res
    return out


def _status_mib(field: str) -> float:
    """A memory field of /proc/self/status (VmRSS: now, VmHWM: peak of this process image), MiB.

    ``getrusage().ru_maxrss`` is not used: Linux carries it over from the parent across
    fork/exec, so a child would report the benchmark parent's peak.
    """
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024  # kB
    raise RuntimeError(f"{field} not found in /proc/self/status")


def child_memory(name: str, mode: str, batch: int, steps: int) -> dict:
    """Runs in a fresh process: peak memory of training `steps` batches."""
    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    model = compile_model(build_model(name), mode)
    x, y = make_data(name, batch, steps)
    before = _status_mib("VmRSS")
    if gpus:
        tf.config.experimental.reset_memory_stats("GPU:0")
    time_steps(model, x, y, batch, steps)
    if gpus:
        peak = tf.config.experimental.get_memory_info("GPU:0")["peak"] / 2**20
        return {"what": "GPU peak bytes (MiB)", "peak_mib": peak, "delta_mib": peak}
    peak = _status_mib("VmHWM")
    return {
        "what": "process peak RSS (MiB)",
        "peak_mib": peak,
        "delta_mib": peak - before,
        "rss_before_fit_mib": before,
    }


def spawn_memory(name: str, mode: str, batch: int, steps: int) -> dict:
    cmd = [sys.executable, __file__, "--_child", name, mode, str(batch), str(steps), _KERAS["which"]]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        return {"failed": True, "returncode": proc.returncode, "stderr_tail": proc.stderr[-300:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def max_batch(name: str, mode: str, start: int, limit: int, budget_mib: float, steps: int) -> dict:
    """Bounded doubling search for the largest batch whose training memory stays in budget."""
    best, batch, probes = None, start, []
    while batch <= limit:
        mem = spawn_memory(name, mode, batch, steps)
        ok = not mem.get("failed") and mem["delta_mib"] <= budget_mib
        probes.append({"batch": batch, "ok": ok, "delta_mib": mem.get("delta_mib"), "peak_mib": mem.get("peak_mib")})
        if not ok:
            break
        best, batch = batch, batch * 2
    return {"max_batch": best, "hit_limit": best is not None and best * 2 > limit, "probes": probes}


def _ratio_at_first_probe(searches: dict) -> dict:
    """Each DP mode's training-memory delta at the first batch over the non-private one's."""
    first = {m: s["probes"][0].get("delta_mib") for m, s in searches.items() if s["probes"]}
    base = first.pop("nonprivate", None)
    return {m: d / base for m, d in first.items() if d is not None and base}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["mlp", "alexnet"], choices=list(MODEL_NAMES))
    parser.add_argument(
        "--keras",
        nargs="+",
        default=["tf_keras"],
        choices=list(KERASES),
        help="tf_keras (default) or 3: Keras 3 models made private with keras_dpsgd.keras3; "
        "both (--keras tf_keras 3): interleaved in the same rounds, one result each",
    )
    parser.add_argument(
        "--modes",
        nargs="+",
        default=list(MODES[:3]),
        choices=list(MODES),
        help="fast-clip-only: the fast backend with sigma = 0 (the cost of clipping alone, without the noise draw)",
    )
    parser.add_argument(
        "--backend",
        default="tensorflow",
        choices=["tensorflow", "jax", "torch"],
        help="Keras 3's backend (--keras 3 only): set as KERAS_BACKEND before keras is imported",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="--backend torch: torch's intra-op threads for every run (default 1: on a shared 2-core machine torch's "
        "thread pool waits on the other processes at every kernel)",
    )
    parser.add_argument("--steps", type=int, default=10, help="timed batches per round (fast, non-private)")
    parser.add_argument(
        "--reference-steps", type=int, default=2, help="timed batches per round (reference, opacus-hooks)"
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--memory", action="store_true", help="peak memory, one process per configuration")
    parser.add_argument("--memory-steps", type=int, default=3)
    parser.add_argument("--max-batch", action="store_true", help="bounded doubling search of the largest batch")
    parser.add_argument("--max-batch-limit", type=int, default=4096)
    parser.add_argument("--memory-budget-mib", type=float, default=4096.0)
    args = parser.parse_args(argv)
    for flag in ("steps", "reference_steps", "rounds", "memory_steps", "max_batch_limit"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if "nonprivate" not in args.modes:
        args.modes = ["nonprivate"] + args.modes
    if len(args.keras) > 1 and (args.memory or args.max_batch):
        raise ValueError("--memory and --max-batch measure one Keras at a time: give one --keras")
    keras3_only = set(args.models) & set(HUB_MODELS + VISION_MODELS)
    if "tf_keras" in args.keras and keras3_only:
        parser.error(
            f"--models {' '.join(sorted(keras3_only))} need --keras 3 (keras_hub, Keras 3's BatchNormalization)"
        )
    if args.backend == "jax":
        if args.keras != ["3"]:
            parser.error("--backend jax needs --keras 3 (tf_keras runs on TensorFlow only)")
        if args.memory or args.max_batch:
            parser.error("--backend jax times steps only (no --memory, --max-batch)")
    elif "jax-privacy" in args.modes:
        parser.error("--modes jax-privacy needs --keras 3 --backend jax")
    if args.backend == "torch":
        if args.keras != ["3"]:
            parser.error("--backend torch needs --keras 3 (tf_keras runs on TensorFlow only)")
        if args.memory or args.max_batch:
            parser.error("--backend torch times steps only (no --memory, --max-batch)")
        if args.threads < 1:
            parser.error(f"--threads must be >= 1, got {args.threads}")
    elif set(args.modes) & set(TORCH_MODES):
        parser.error(f"--modes {' '.join(sorted(set(args.modes) & set(TORCH_MODES)))} need --backend torch")
    if "keras" in sys.modules and sys.modules["keras"].backend.backend() != args.backend:
        raise ValueError(f"keras was imported with another backend than --backend {args.backend}")
    os.environ["KERAS_BACKEND"] = args.backend
    _KERAS["which"] = args.keras[0]
    report = {
        "keras": args.keras,
        "backend": args.backend,
        "load_average_start": os.getloadavg(),
        "cpu_count": os.cpu_count(),
        "results": {},
    }
    if args.backend == "torch":
        import torch

        torch.set_num_threads(args.threads)
        report["torch"] = {"version": torch.__version__, "threads": args.threads}
        if set(args.modes) & {"opacus-hooks", "opacus-ghost"}:
            import opacus

            report["torch"]["opacus"] = opacus.__version__
    for name in args.models:
        batch = DEFAULT_BATCH[name]
        res = run_timing(name, batch, args.steps, args.reference_steps, args.rounds, args.modes, args.keras)
        if args.memory:
            mem = {m: spawn_memory(name, m, batch, args.memory_steps) for m in args.modes}
            base = mem["nonprivate"].get("delta_mib")
            for m in args.modes:
                if m != "nonprivate" and base and not mem[m].get("failed"):
                    mem[m]["ratio_delta"] = mem[m]["delta_mib"] / base
            res["memory"] = mem
        if args.max_batch:
            res["max_batch"] = {
                m: max_batch(name, m, batch, args.max_batch_limit, args.memory_budget_mib, 2) for m in args.modes
            }
            res["max_batch"]["peak_ratio_at_b0"] = _ratio_at_first_probe(res["max_batch"])
        report["results"][name] = res
    report["load_average_end"] = os.getloadavg()
    return report


if __name__ == "__main__":
    if len(sys.argv) == 7 and sys.argv[1] == "--_child":
        _, _, model_name, mode_name, batch_s, steps_s, _KERAS["which"] = sys.argv
        print(json.dumps(child_memory(model_name, mode_name, int(batch_s), int(steps_s))))
    else:
        print(json.dumps(main(), indent=1))
