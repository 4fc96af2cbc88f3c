"""Tiny keras_hub language models of issue 41 (random weights, one layer, width 8; nothing downloads), for both
Keras 3 backends: Llama and Mistral causal LMs (grouped-query attention, RMSNorm, SwiGLU, ± LoRA), Gemma, BART and T5
seq2seq LMs with their own token-level Keras loss, and a DeBERTa-v3 classifier (disentangled attention: the
relative-position table, layer-normalized, repeated over the batch and projected by the shared query/key kernels), and
a Llama classifier (the backbone with a Dense head: its untied output table is never read, its gradient exactly 0).

Each model takes one int32 array of token ids (a seq2seq model: the encoder's ids, then the decoder's), so that the
one-example loop slices it like any array; 0 is padding. :func:`check` trains one private step on the documented
path (``make_private`` + ``PoissonLots(...).dataset()``, σ = 0, every example in the lot) and compares it with the
clipped mean of the one-example loop (``tests/_models_2026.check_private_step``).
"""

import keras
import numpy as np

from tests._models_2026 import check_private_step

VOCAB, STEPS, N = 24, 6, 4
_ENCODER = 4  # a seq2seq model's encoder ids come first, then STEPS decoder ids
_TOKEN_LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)  # each example's loss: its token mean


def _ids(length, seed):
    ids = np.random.default_rng(seed).integers(1, VOCAB, size=(N, length)).astype("int32")
    ids[0, -2:] = 0  # padding
    return ids


def _hub():
    import keras_hub

    return keras_hub


def _causal_lm(task, backbone, lora):
    if lora:
        backbone.enable_lora(2)
    lm = task(backbone=backbone, preprocessor=None)
    ids = keras.Input((STEPS,), dtype="int32")
    model = keras.Model(ids, lm({"token_ids": ids, "padding_mask": keras.ops.not_equal(ids, 0)}))
    x = _ids(STEPS, 0)
    y = np.concatenate([x[:, 1:], np.zeros((N, 1), "int32")], axis=1)  # the next token
    return model, _TOKEN_LOSS, x, y


def llama(lora=False):
    hub = _hub()
    sizes = dict(num_query_heads=2, num_key_value_heads=1, hidden_dim=8, intermediate_dim=16)
    backbone = hub.models.LlamaBackbone(vocabulary_size=VOCAB, num_layers=1, **sizes)
    return _causal_lm(hub.models.LlamaCausalLM, backbone, lora)


def llama_classifier():
    """A Llama backbone with a Dense head on its first token (``benchmarks/overhead.py``'s ``llama``): its token
    embedding's untied output table (``ReversibleEmbedding.reverse_embeddings``) is never read, so every example's
    gradient of it is exactly 0."""
    hub = _hub()
    sizes = dict(num_query_heads=2, num_key_value_heads=1, hidden_dim=8, intermediate_dim=16)
    return _first_token_classifier(hub.models.LlamaBackbone(vocabulary_size=VOCAB, num_layers=1, **sizes), seed=5)


def mistral(lora=False):
    hub = _hub()
    sizes = dict(num_query_heads=2, num_key_value_heads=1, hidden_dim=8, intermediate_dim=16, sliding_window=4)
    backbone = hub.models.MistralBackbone(vocabulary_size=VOCAB, num_layers=1, **sizes)
    return _causal_lm(hub.models.MistralCausalLM, backbone, lora)


def gemma():
    hub = _hub()
    sizes = dict(num_query_heads=2, num_key_value_heads=1, hidden_dim=8, intermediate_dim=16, head_dim=4)
    backbone = hub.models.GemmaBackbone(vocabulary_size=VOCAB, num_layers=1, **sizes)
    return _causal_lm(hub.models.GemmaCausalLM, backbone, False)


def _seq2seq(task, backbone):
    lm = task(backbone=backbone, preprocessor=None)
    ids = keras.Input((_ENCODER + STEPS,), dtype="int32")
    encoder, decoder = ids[:, :_ENCODER], ids[:, _ENCODER:]
    inputs = {
        "encoder_token_ids": encoder,
        "encoder_padding_mask": keras.ops.not_equal(encoder, 0),
        "decoder_token_ids": decoder,
        "decoder_padding_mask": keras.ops.not_equal(decoder, 0),
    }
    model = keras.Model(ids, lm(inputs))
    x = np.concatenate([_ids(_ENCODER, 1), _ids(STEPS, 2)], axis=1)
    return model, _TOKEN_LOSS, x, _ids(STEPS, 3)


def bart():
    hub = _hub()
    sizes = dict(num_heads=2, hidden_dim=8, intermediate_dim=16, dropout=0.0, max_sequence_length=8)
    return _seq2seq(hub.models.BartSeq2SeqLM, hub.models.BartBackbone(vocabulary_size=VOCAB, num_layers=1, **sizes))


def t5():
    hub = _hub()
    sizes = dict(num_heads=2, hidden_dim=8, intermediate_dim=16, key_value_dim=4, dropout=0.0)
    return _seq2seq(hub.models.T5Seq2SeqLM, hub.models.T5Backbone(vocabulary_size=VOCAB, num_layers=1, **sizes))


def deberta():
    """A DeBERTa-v3 backbone and a Dense head on the first token (a sequence classifier)."""
    hub = _hub()
    sizes = dict(num_heads=2, hidden_dim=8, intermediate_dim=16, dropout=0.0, max_sequence_length=8, bucket_size=4)
    return _first_token_classifier(hub.models.DebertaV3Backbone(vocabulary_size=VOCAB, num_layers=1, **sizes), seed=4)


def _first_token_classifier(backbone, seed):
    """`backbone` (token ids and padding mask in) with a Dense(3) head on its first token, and 3-class labels."""
    ids = keras.Input((STEPS,), dtype="int32")
    h = backbone({"token_ids": ids, "padding_mask": keras.ops.not_equal(ids, 0)})
    model = keras.Model(ids, keras.layers.Dense(3)(h[:, 0, :]))
    y = np.random.default_rng(seed).integers(0, 3, size=(N,))
    return model, _TOKEN_LOSS, _ids(STEPS, 0), y


MODELS = {
    "llama": llama,
    "llama-lora": lambda: llama(lora=True),
    "llama-classifier": llama_classifier,
    "mistral": mistral,
    "mistral-lora": lambda: mistral(lora=True),
    "gemma": gemma,
    "bart": bart,
    "t5": t5,
    "deberta-v3": deberta,
}


def check(name):
    """One private step of the model `name` == the one-example loop; returns (the model, the optimizer)."""
    keras.utils.set_random_seed(0)
    model, loss, x, y = MODELS[name]()
    return model, check_private_step(model, loss, x, y)
