"""Torch twins of ``overhead.py``'s models, and their steps under Opacus 1.6 (``overhead.py --backend torch``).

Each twin is a plain ``torch.nn.Module`` with the same shapes as the Keras model of the same name: ``mlp``
784-1000-10 (ReLU), ``alexnet`` (the small AlexNet of Abadi et al. 2016 on 32x32x3: conv 5x5x64 SAME ReLU,
max-pool 3/2, twice, dense 384, 192, 10) and ``bert-lora``: keras_hub's ``BertBackbone`` of ``overhead.py``
(vocabulary 5000, 2 layers, hidden 64, 2 heads, intermediate 128, T = 32, dropout 0.1) with ``enable_lora(4)`` and
a Dense(2) head on the pooled output, as a torch encoder of the same sizes (token, position and segment embeddings,
post-LayerNorm blocks, GELU feed-forward, a tanh pooler) whose trainable weights are the same: rank-4 LoRA factors
on the query and value projections, and the head.

:class:`TorchRun` times a twin's step (forward, mean cross-entropy, backward, ``optimizer.step``) with plain
``torch.optim.SGD`` (mode ``torch``) or under Opacus's ``PrivacyEngine.make_private`` (σ = 1.1, C = 1): per-sample
gradients from hooks (``opacus-hooks``) or ghost clipping (``opacus-ghost``, ``grad_sample_mode="ghost"``).
"""

from __future__ import annotations

import time

import numpy as np
import torch
from torch import nn

SIGMA, CLIP, LR = 1.1, 1.0, 0.01
VOCAB, LENGTH, HIDDEN, INTER, RANK, DROPOUT = 5000, 32, 64, 128, 4, 0.1
MODES = ("torch", "opacus-hooks", "opacus-ghost")


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
        self.drop = nn.Dropout(DROPOUT)
        for module in (self.k, self.o, self.ln1, self.ln2, self.ff1, self.ff2):
            module.requires_grad_(False)

    def forward(self, h, mask):
        b, t, _ = h.shape
        heads = lambda z: z.view(b, t, 2, HIDDEN // 2).transpose(1, 2)  # noqa: E731
        scores = heads(self.q(h)) @ heads(self.k(h)).transpose(-1, -2) / (HIDDEN // 2) ** 0.5
        scores = scores.masked_fill(~mask[:, None, None, :], -1e9)
        attended = (self.drop(scores.softmax(-1)) @ heads(self.v(h))).transpose(1, 2).reshape(b, t, HIDDEN)
        h = self.ln1(h + self.drop(self.o(attended)))
        return self.ln2(h + self.drop(self.ff2(nn.functional.gelu(self.ff1(h)))))


class _Bert(nn.Module):
    def __init__(self):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(VOCAB, HIDDEN), nn.Embedding(LENGTH, HIDDEN)
        self.segments, self.ln = nn.Embedding(2, HIDDEN), nn.LayerNorm(HIDDEN)
        self.drop = nn.Dropout(DROPOUT)
        self.blocks = nn.ModuleList([_Block(), _Block()])
        self.pooler, self.head = nn.Linear(HIDDEN, HIDDEN), nn.Linear(HIDDEN, 2)
        for module in (self.tokens, self.positions, self.segments, self.ln, self.pooler):
            module.requires_grad_(False)

    def forward(self, ids):
        segments = (ids >= VOCAB // 2).long()
        h = self.tokens(ids) + self.positions(torch.arange(ids.shape[1])) + self.segments(segments)
        h, mask = self.drop(self.ln(h)), ids != 0
        for block in self.blocks:
            h = block(h, mask)
        return self.head(torch.tanh(self.pooler(h[:, 0])))


def twin(name: str) -> nn.Module:
    """The torch module of the same shapes as ``overhead.build_model(name)``."""
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
    if name == "bert-lora":
        return _Bert()
    raise ValueError(f"no torch twin of model {name!r}: --backend torch runs mlp, alexnet, bert-lora")


def _tensors(name: str, x: np.ndarray, y: np.ndarray):
    x = torch.from_numpy(x)
    if name == "alexnet":
        x = x.permute(0, 3, 1, 2).contiguous()  # NHWC -> NCHW
    return (x.long() if name == "bert-lora" else x), torch.from_numpy(y).long()


class TorchRun:
    """One twin and its optimizer (plain SGD or Opacus's), timed as ``overhead.time_steps`` times a Keras fit."""

    def __init__(self, name: str, mode: str, batch: int):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        torch.manual_seed(0)
        self.name, self.module = name, twin(name)
        params = [p for p in self.module.parameters() if p.requires_grad]
        self.optimizer, self.criterion = torch.optim.SGD(params, lr=LR), nn.CrossEntropyLoss()
        if mode != "torch":
            from opacus import PrivacyEngine

            shapes = (784,) if name == "mlp" else (3, 32, 32) if name == "alexnet" else (LENGTH,)
            dtype = torch.long if name == "bert-lora" else torch.float32
            fake = torch.utils.data.TensorDataset(torch.zeros((batch, *shapes), dtype=dtype), torch.zeros(batch).long())
            loader = torch.utils.data.DataLoader(fake, batch_size=batch)
            kwargs = dict(noise_multiplier=SIGMA, max_grad_norm=CLIP, poisson_sampling=False)
            engine = PrivacyEngine(accountant="rdp")
            if mode == "opacus-ghost":
                self.module, self.optimizer, self.criterion, _ = engine.make_private(
                    module=self.module,
                    optimizer=self.optimizer,
                    data_loader=loader,
                    criterion=self.criterion,
                    grad_sample_mode="ghost",
                    **kwargs,
                )
            else:
                self.module, self.optimizer, _ = engine.make_private(
                    module=self.module, optimizer=self.optimizer, data_loader=loader, grad_sample_mode="hooks", **kwargs
                )
            self.optimizer.expected_batch_size = batch
        self.module.train()

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.optimizer.zero_grad()
        loss = self.criterion(self.module(x), y)
        loss.backward()
        self.optimizer.step()

    def time_steps(self, x: np.ndarray, y: np.ndarray, batch: int, steps: int, cpu: list | None = None) -> list:
        """Wall times of `steps` batches (each converted from numpy in the step, as Keras's fit converts its own)."""
        times = []
        for i in range(steps):
            start, start_cpu = time.perf_counter(), time.process_time()
            self.step(*_tensors(self.name, x[i * batch : (i + 1) * batch], y[i * batch : (i + 1) * batch]))
            times.append(time.perf_counter() - start)
            if cpu is not None:
                cpu.append(time.process_time() - start_cpu)
        return times
