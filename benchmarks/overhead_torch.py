"""DP-SGD step time over non-private training on PyTorch: keras_dpsgd (Keras 3, KERAS_BACKEND=torch) beside Opacus.

Usage::

    python benchmarks/overhead_torch.py                       # MLP, small AlexNet, BERT-LoRA; prints one JSON object
    python benchmarks/overhead_torch.py --models mlp --rounds 3 --out benchmarks/results/overhead_torch.json

Four runs per model, each on the same shapes and the same fixed batch, in one process, interleaved in rounds so
that load on a shared machine hits them alike; the step time is the median over rounds of each round's median:

* ``keras``: a Keras 3 model on the torch backend, non-private ``fit`` step (``keras.optimizers.SGD``, mean loss);
* ``keras_dpsgd``: the same model, ``keras_dpsgd.keras3.make_private`` and ``DPSGDOptimizer(l2_norm_clip=1,
  noise_multiplier=1.1)`` (``per_example_backend="auto"``: ghost norms and book-keeping for the covered layers);
* ``torch``: the same architecture as a plain ``torch.nn.Module`` with ``torch.optim.SGD``;
* ``opacus_hooks`` / ``opacus_ghost``: that module under Opacus 1.6's ``PrivacyEngine.make_private`` (σ = 1.1,
  C = 1), per-sample gradients from hooks, or ghost clipping (``grad_sample_mode="ghost"``).

Ratios: ``keras_dpsgd / keras`` and ``opacus_* / torch``. The Keras steps are timed on the model's train function
(Keras's ``fit`` step, without the epoch loop), the torch steps as forward, backward and optimizer step.

Models: ``mlp`` 784-1000-10 (ReLU), B 256; ``alexnet`` (the small AlexNet of Abadi et al. 2016 on 32x32x3: conv
5x5x64 SAME ReLU, max-pool 3/2, conv 5x5x64 SAME ReLU, max-pool 3/2, dense 384, 192, 10), B 128; ``bert-lora``:
keras_hub's ``BertBackbone`` (random weights, vocabulary 5000, 2 layers, hidden 64, 2 heads, intermediate 128,
T = 32) with ``enable_lora(4)`` and a Dense(2) head on the pooled output, B 64; its Opacus twin is a torch encoder
of the same sizes (token, position and segment embeddings, post-LayerNorm blocks, GELU feed-forward, a tanh
pooler) whose trainable weights are the same: rank-4 LoRA factors on the query and value projections, and the head.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

SIGMA, CLIP, LR = 1.1, 1.0, 0.05
BATCH = {"mlp": 256, "alexnet": 128, "bert-lora": 64}
VOCAB, LENGTH, HIDDEN, INTER, RANK = 5000, 32, 64, 128, 4


# ------------------------------------------------------------------ Keras models
def keras_model(name: str):
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
    import keras_hub

    ids = keras.Input((LENGTH,), dtype="int32")
    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=VOCAB,
        num_layers=2,
        num_heads=2,
        hidden_dim=HIDDEN,
        intermediate_dim=INTER,
        max_sequence_length=LENGTH,
        dropout=0.0,
    )
    backbone.enable_lora(RANK)
    inputs = {
        "token_ids": ids,
        "padding_mask": keras.ops.not_equal(ids, 0),
        "segment_ids": keras.ops.cast(keras.ops.greater_equal(ids, VOCAB // 2), "int32"),
    }
    return keras.Model(ids, layers.Dense(2)(backbone(inputs)["pooled_output"]))


# ------------------------------------------------------------------ torch twins (for Opacus)
class _LoRALinear(nn.Module):
    """A frozen Linear plus a trainable rank-r update B·A (Hu et al. 2021), as Keras's enable_lora."""

    def __init__(self, d_in, d_out, rank):
        super().__init__()
        self.base = nn.Linear(d_in, d_out).requires_grad_(False)
        self.a = nn.Linear(d_in, rank, bias=False)
        self.b = nn.Linear(rank, d_out, bias=False)
        nn.init.normal_(self.b.weight, std=0.02)

    def forward(self, x):
        return self.base(x) + self.b(self.a(x))


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.v = _LoRALinear(HIDDEN, HIDDEN, RANK), _LoRALinear(HIDDEN, HIDDEN, RANK)
        self.k, self.o = nn.Linear(HIDDEN, HIDDEN), nn.Linear(HIDDEN, HIDDEN)
        self.ln1, self.ln2 = nn.LayerNorm(HIDDEN), nn.LayerNorm(HIDDEN)
        self.ff1, self.ff2 = nn.Linear(HIDDEN, INTER), nn.Linear(INTER, HIDDEN)
        for module in (self.k, self.o, self.ln1, self.ln2, self.ff1, self.ff2):
            module.requires_grad_(False)

    def forward(self, h, mask):
        b, t, _ = h.shape
        heads = lambda z: z.view(b, t, 2, HIDDEN // 2).transpose(1, 2)  # noqa: E731
        scores = heads(self.q(h)) @ heads(self.k(h)).transpose(-1, -2) / (HIDDEN // 2) ** 0.5
        scores = scores.masked_fill(~mask[:, None, None, :], -1e9)
        attended = (scores.softmax(-1) @ heads(self.v(h))).transpose(1, 2).reshape(b, t, HIDDEN)
        h = self.ln1(h + self.o(attended))
        return self.ln2(h + self.ff2(nn.functional.gelu(self.ff1(h))))


class _Bert(nn.Module):
    def __init__(self):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(VOCAB, HIDDEN), nn.Embedding(LENGTH, HIDDEN)
        self.segments, self.ln = nn.Embedding(2, HIDDEN), nn.LayerNorm(HIDDEN)
        self.blocks = nn.ModuleList([_Block(), _Block()])
        self.pooler, self.head = nn.Linear(HIDDEN, HIDDEN), nn.Linear(HIDDEN, 2)
        for module in (self.tokens, self.positions, self.segments, self.ln, self.pooler):
            module.requires_grad_(False)

    def forward(self, ids):
        segments = (ids >= VOCAB // 2).long()
        h = self.tokens(ids) + self.positions(torch.arange(ids.shape[1])) + self.segments(segments)
        h, mask = self.ln(h), ids != 0
        for block in self.blocks:
            h = block(h, mask)
        return self.head(torch.tanh(self.pooler(h[:, 0])))


def torch_model(name: str) -> nn.Module:
    if name == "mlp":
        return nn.Sequential(nn.Linear(784, 1000), nn.ReLU(), nn.Linear(1000, 10))
    if name == "alexnet":
        return nn.Sequential(
            nn.Conv2d(3, 64, 5, padding=2),
            nn.ReLU(),
            nn.MaxPool2d(3, 2),
            nn.Conv2d(64, 64, 5, padding=2),
            nn.ReLU(),
            nn.MaxPool2d(3, 2),
            nn.Flatten(),
            nn.Linear(64 * 7 * 7, 384),
            nn.ReLU(),
            nn.Linear(384, 192),
            nn.ReLU(),
            nn.Linear(192, 10),
        )
    return _Bert()


def data(name: str, seed: int = 0):
    rng = np.random.default_rng(seed)
    batch = BATCH[name]
    y = rng.integers(0, 2 if name == "bert-lora" else 10, size=batch)
    if name == "mlp":
        return rng.normal(size=(batch, 784)).astype("float32"), y
    if name == "alexnet":
        return rng.normal(size=(batch, 32, 32, 3)).astype("float32"), y
    return rng.integers(1, VOCAB, size=(batch, LENGTH)).astype("int32"), y


# ------------------------------------------------------------------ steps
def keras_step(name: str, private: bool):
    import keras_dpsgd.keras3 as k3

    keras.utils.set_random_seed(0)
    model = keras_model(name)
    x, y = data(name)
    if private:
        k3.make_private(model)
        optimizer = k3.DPSGDOptimizer(l2_norm_clip=CLIP, noise_multiplier=SIGMA, learning_rate=LR)
    else:
        optimizer = keras.optimizers.SGD(LR)
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.train_on_batch(x, y)  # builds the model, the optimizer and the train function
    batch = [(keras.ops.convert_to_tensor(x), keras.ops.convert_to_tensor(y))]
    return lambda: model.train_function(batch)


def torch_step(name: str, mode: str):
    torch.manual_seed(0)
    module = torch_model(name)
    x, y = data(name)
    x = torch.from_numpy(x).permute(0, 3, 1, 2).contiguous() if name == "alexnet" else torch.from_numpy(x)
    x = x.long() if name == "bert-lora" else x
    y = torch.from_numpy(y).long()
    params = [p for p in module.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=LR)
    criterion = nn.CrossEntropyLoss()
    if mode != "torch":
        from opacus import PrivacyEngine

        loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=len(x))
        engine = PrivacyEngine(accountant="rdp")
        kwargs = dict(noise_multiplier=SIGMA, max_grad_norm=CLIP, poisson_sampling=False)
        if mode == "opacus_ghost":
            module, optimizer, criterion, _ = engine.make_private(
                module=module,
                optimizer=optimizer,
                data_loader=loader,
                criterion=criterion,
                grad_sample_mode="ghost",
                **kwargs,
            )
        else:
            module, optimizer, _ = engine.make_private(
                module=module, optimizer=optimizer, data_loader=loader, grad_sample_mode="hooks", **kwargs
            )
        optimizer.expected_batch_size = len(x)

    def step():
        optimizer.zero_grad()
        loss = criterion(module(x), y)
        loss.backward()
        optimizer.step()

    step()
    return step


def _median_time(step, steps: int) -> float:
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(name: str, rounds: int, steps: int) -> dict:
    runs = {
        "keras": keras_step(name, private=False),
        "keras_dpsgd": keras_step(name, private=True),
        "torch": torch_step(name, "torch"),
        "opacus_hooks": torch_step(name, "opacus_hooks"),
        "opacus_ghost": torch_step(name, "opacus_ghost"),
    }
    per_round = {run: [] for run in runs}
    for _ in range(rounds):
        for run, step in runs.items():
            per_round[run].append(_median_time(step, steps))
    ms = {run: 1000 * statistics.median(t) for run, t in per_round.items()}
    return {
        "batch": BATCH[name],
        "step_ms": {run: round(v, 2) for run, v in ms.items()},
        "ratio": {
            "keras_dpsgd": round(ms["keras_dpsgd"] / ms["keras"], 3),
            "opacus_hooks": round(ms["opacus_hooks"] / ms["torch"], 3),
            "opacus_ghost": round(ms["opacus_ghost"] / ms["torch"], 3),
        },
    }


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(BATCH), choices=list(BATCH))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5, help="steps per round of each run (their median counts)")
    parser.add_argument("--out", default=None, help="also write the JSON object here")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch's intra-op threads for every run (default 1: on a shared 2-core machine torch's thread pool "
        "waits on the other processes at every kernel)",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    import opacus

    with open("/proc/loadavg") as f:
        load_before = f.read().split()[:3]
    result = {
        "backend": keras.config.backend(),
        "torch": torch.__version__,
        "opacus": opacus.__version__,
        "keras": keras.__version__,
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "loadavg_before": load_before,
        "models": {name: measure(name, args.rounds, args.steps) for name in args.models},
    }
    with open("/proc/loadavg") as f:
        result["loadavg_after"] = f.read().split()[:3]
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return result


if __name__ == "__main__":
    main()
