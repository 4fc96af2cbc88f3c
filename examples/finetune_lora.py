"""DP fine-tuning of a keras_hub transformer with LoRA: only the low-rank factors and the head train.

A text classifier: a keras_hub backbone, ``backbone.enable_lora(rank)`` (its attention query and
value kernels become ``W + (α/r)·A·B`` with W frozen), masked mean pooling and a Dense head,
trained with DP-SGD (Keras 3: ``make_private``, ``DPSGDOptimizer``, Poisson lots; σ calibrated so
that the run spends exactly the target ε). The fast per-example backend computes the gradients of
A and B per example from the factorized product (``keras_dpsgd.backends.tensorflow._derived``): no per-example
jacobians.

Offline by default: a generated two-class text set (each class draws most words from its own half
of a word list) and a tiny BertBackbone built from config with random weights, words hashed into
its vocabulary (the hashing does not depend on the data: it costs no privacy). With your data and
a pretrained model on disk:

    python examples/finetune_lora.py                       # generated text, tiny random BERT (~1 min)
    python examples/finetune_lora.py --smoke               # < 30 s
    python examples/finetune_lora.py --data train.tsv      # lines "label<TAB>text", labels 0..K-1
    python examples/finetune_lora.py --data train.tsv --preset-dir ./bert_tiny_en_uncased
        # a keras_hub preset directory (config.json, model.weights.h5, tokenizer assets), read locally:
        # its tokenizer and pretrained backbone (keras_hub.models.Backbone.from_preset)

The held-out split (20%) is not trained on; its accuracy is printed with ε.

Needs keras_hub, the ``hub`` extra: ``pip install "keras-dpsgd[hub]"`` (without it the script says so and
exits with code 2).
"""

import argparse
import zlib

from keras_dpsgd.cli import add_option, exit_unless_installed, import_tensorflow_quietly

import_tensorflow_quietly()  # TF_CPP_MIN_LOG_LEVEL=2 unless set; no start-up log lines


def generated_texts(n: int, seed: int):
    """Two classes of 'sentences' (8-20 words): 80% of the words from the class's half of a list."""
    import numpy as np

    gen = np.random.default_rng(seed)
    words = [f"w{k}" for k in range(200)]
    labels = gen.integers(0, 2, size=n)
    texts = []
    for label in labels:
        length = gen.integers(8, 21)
        own = gen.random(length) < 0.8
        picks = np.where(own, gen.integers(0, 100, length) + 100 * label, gen.integers(0, 200, length))
        texts.append(" ".join(words[k] for k in picks))
    return texts, labels.astype("int32")


def read_tsv(path: str):
    """Lines ``label<TAB>text``; labels are integers 0..K-1."""
    texts, labels = [], []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            label, sep, text = line.rstrip("\n").partition("\t")
            if not sep or not label.strip().isdigit():
                raise ValueError(f"{path}:{number}: expected 'label<TAB>text' with an integer label, got {line[:60]!r}")
            texts.append(text)
            labels.append(int(label))
    if not texts:
        raise ValueError(f"{path} holds no 'label<TAB>text' line")
    import numpy as np

    return texts, np.asarray(labels, "int32")


def hashed_ids(texts, vocabulary: int, length: int):
    """Words hashed into ids 1..vocabulary-1 (0 pads), truncated to `length`."""
    import numpy as np

    ids = np.zeros((len(texts), length), "int32")
    for row, text in enumerate(texts):
        for col, word in enumerate(text.lower().split()[:length]):
            ids[row, col] = 1 + zlib.crc32(word.encode()) % (vocabulary - 1)
    return ids


def tiny_backbone(vocabulary: int, length: int, num_layers: int = 2):
    import keras_hub

    return keras_hub.models.BertBackbone(
        vocabulary_size=vocabulary,
        num_layers=num_layers,
        num_heads=2,
        hidden_dim=64,
        intermediate_dim=128,
        max_sequence_length=length,
    )


def preset_backbone_and_ids(preset_dir: str, texts, length: int):
    """The preset's backbone and its tokenizer's ids [N, length] (padded with its pad id)."""
    import keras_hub
    import numpy as np

    backbone = keras_hub.models.Backbone.from_preset(preset_dir)
    tokenizer = keras_hub.models.Tokenizer.from_preset(preset_dir)
    pad = int(getattr(tokenizer, "pad_token_id", 0) or 0)
    ids = np.full((len(texts), length), pad, "int32")
    for row, tokens in enumerate(tokenizer(texts)):
        tokens = np.asarray(tokens)[:length]
        ids[row, : len(tokens)] = tokens
    return backbone, ids, pad


def classifier(backbone, length: int, classes: int, pad: int):
    """Token ids [B, length] -> backbone (padding mask from the pad id) -> masked mean -> Dense."""
    import keras

    ops = keras.ops
    ids = keras.Input((length,), dtype="int32")
    mask = ops.not_equal(ids, pad)
    inputs = {"token_ids": ids, "padding_mask": mask}
    if "segment_ids" in backbone.input:
        inputs["segment_ids"] = ops.zeros_like(ids)
    out = backbone(inputs)
    hidden = out["sequence_output"] if isinstance(out, dict) else out
    weights = ops.expand_dims(ops.cast(mask, hidden.dtype), -1)
    pooled = ops.sum(hidden * weights, axis=1) / ops.maximum(ops.sum(weights, axis=1), 1.0)
    return keras.Model(ids, keras.layers.Dense(classes)(pooled))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny run (< 30 s)")
    p.add_argument("--data", default=None, metavar="PATH", help="local text set: lines 'label<TAB>text'")
    p.add_argument("--preset-dir", default=None, metavar="DIR", help="a keras_hub preset directory on disk")
    p.add_argument("--examples", type=int, default=2000, help="size of the generated text set")
    p.add_argument("--length", type=int, default=32, help="tokens per example (truncated / padded)")
    p.add_argument("--vocabulary", type=int, default=1000, help="hash buckets of the random tiny BERT")
    p.add_argument("--rank", type=int, default=4, help="LoRA rank")
    p.add_argument("--epochs", type=int, default=None)
    p.add_argument("--lot-size", type=int, default=64)
    p.add_argument("--learning-rate", type=float, default=0.5)
    add_option(p, "--target-epsilon", "--epsilon", type=float, default=3.0)
    add_option(p, "--l2-norm-clip", "--clip", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    for flag in ("examples", "length", "vocabulary", "rank", "lot_size"):
        if getattr(args, flag) < (2 if flag in ("vocabulary", "examples") else 1):
            p.error(f"--{flag.replace('_', '-')} must be >= 1 (vocabulary, examples: >= 2), got {getattr(args, flag)}")
    if args.epochs is not None and args.epochs < 1:
        p.error(f"--epochs must be >= 1, got {args.epochs}")
    exit_unless_installed("keras_hub", "hub", needed_by="examples/finetune_lora.py")

    import keras
    import numpy as np

    from keras_dpsgd import PoissonLots
    from keras_dpsgd.accounting import compute_epsilon, compute_noise_multiplier, default_delta
    from keras_dpsgd.keras3 import DPSGDOptimizer, make_private
    from keras_dpsgd.ledger import model_privacy_ledger

    keras.utils.set_random_seed(args.seed)
    n = 300 if args.smoke else args.examples
    texts, labels = read_tsv(args.data) if args.data else generated_texts(n, args.seed)
    length = 16 if args.smoke else args.length
    if args.preset_dir:
        backbone, ids, pad = preset_backbone_and_ids(args.preset_dir, texts, length)
    else:
        backbone = tiny_backbone(args.vocabulary, length, num_layers=1 if args.smoke else 2)  # --smoke: 1 layer
        ids, pad = hashed_ids(texts, args.vocabulary, length), 0
    backbone.enable_lora(args.rank)
    order = np.random.default_rng(args.seed).permutation(len(ids))
    cut = int(0.8 * len(ids))
    train, test = order[:cut], order[cut:]
    model = classifier(backbone, length, int(labels.max()) + 1, pad)

    epochs = args.epochs or (1 if args.smoke else 3)
    lots = PoissonLots(ids[train], labels[train], expected_lot_size=min(args.lot_size, len(train)), seed=args.seed)
    delta = default_delta(len(train))
    steps = epochs * lots.lots_per_epoch
    sigma = compute_noise_multiplier(
        target_epsilon=args.target_epsilon, target_delta=delta, sampling_rate=lots.sampling_rate, steps=steps
    )
    opt = DPSGDOptimizer(
        l2_norm_clip=args.l2_norm_clip,
        noise_multiplier=sigma,
        learning_rate=args.learning_rate,
        momentum=0.9,
        gradient_accumulation_steps=lots.gradient_accumulation_steps,
        seed=args.seed,
    )
    lots.configure(opt)
    model = make_private(model)
    model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none"))
    trainable = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    print(f"LoRA rank {args.rank}: {trainable} trainable parameters of {model.count_params()}, σ = {sigma:.3f}")
    model.fit(lots.dataset(), steps_per_epoch=lots.steps_per_epoch, epochs=epochs, verbose=0)
    epsilon = compute_epsilon(model_privacy_ledger(model), delta)
    accuracy = float(np.mean(np.argmax(model.predict(ids[test], verbose=0), -1) == labels[test]))
    print(f"test accuracy {accuracy:.4f} at ε = {epsilon:.3f} (δ = {delta:.3g}), {steps} DP-SGD steps")
    return accuracy, epsilon


if __name__ == "__main__":
    main()
