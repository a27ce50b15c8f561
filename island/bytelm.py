"""The built-in task (``island.bytelm:task``, the default): a decoder-only Transformer LM on text.

Options (`--task-option KEY=VALUE`, the cluster file's [model]/[task], or the island's shorthand
flags --model-size, --width, ...):
  size     tiny | small | base | 124m | 350m (island/config.py MODEL_SIZES; default tiny)
  width, depth, heads, context, vocab, tie_embeddings   override the size's values
  corpus   a file or folder of text, read as bytes (default: this Python's standard library sources)
  tokens   a token file from `dloco tokenize` (.bin or .npy of uint16/uint32 ids) instead of text
  eval_batches  held-out batches (fixed windows of the eval split, the same on every island; default 8)

The vocabulary is the size's (GPT-2's 50,257 for 124m/350m) or else the data's (256 for bytes, a
token file's own); data with an id the model has no embedding for is refused.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from island import data
from island.config import MODEL_SIZES, ModelConfig, TrainConfig
from island.task import Task, TaskContext, TaskError

OPTIONS = frozenset({"size", "width", "depth", "heads", "context", "vocab", "tie_embeddings", "corpus", "tokens", "eval_batches"})


def model_config(options, data_vocab: int = 256) -> ModelConfig:
    """The LM's shape from a size preset and the options that override it."""
    size = options.get("size", "tiny")
    if size not in MODEL_SIZES:
        raise TaskError(f"model size must be one of {sorted(MODEL_SIZES)}, got {size!r}")
    values = {"vocab": data_vocab, **MODEL_SIZES[size]}
    values.update({key: options[key] for key in ("width", "depth", "heads", "context", "vocab", "tie_embeddings") if key in options})
    config = ModelConfig(**values)
    if config.vocab < data_vocab:
        raise TaskError(f"the data has token ids up to {data_vocab - 1}, the model's vocabulary only {config.vocab} ids (set vocab)")
    return config


def load_data(options) -> data.Corpus:
    if "tokens" in options and "corpus" in options:
        raise TaskError("give the built-in LM either a corpus (text) or tokens (a token file), not both")
    if "tokens" in options:
        return data.load_tokens(options["tokens"])
    return data.load(options.get("corpus"))


def task(ctx: TaskContext) -> Task:
    from flax import nnx

    from island.model import ByteLM, loss_fn

    unknown = set(ctx.options) - OPTIONS
    if unknown:
        raise TaskError(f"the built-in LM has no options {sorted(unknown)}; it takes {sorted(OPTIONS)}")
    corpus = load_data(ctx.options)
    config = model_config(ctx.options, corpus.vocab)
    shards, evaluation = data.split(corpus, ctx.islands)
    return Task(model=ByteLM(config, nnx.Rngs(ctx.seed)), loss=loss_fn,
                batches=data.Batches(shards[ctx.island_index], ctx.batch, config.context, ctx.seed, ctx.island_index),
                eval_batches=data.eval_batches(evaluation, ctx.batch, config.context, int(ctx.options.get("eval_batches", 8))),
                count=count_tokens, metrics=_metrics,
                name=f"byte LM ({ctx.options.get('size', 'tiny')}, {dataclasses.asdict(config)}) on {corpus.root} ({corpus.files} files, {corpus.tokens_N.size:,} tokens, "
                     f"vocabulary {corpus.vocab}, listing sha256 {corpus.digest[:16]})")


def count_tokens(batch_BxT1: np.ndarray) -> int:
    """Tokens a batch trains on: each sequence predicts all but its first token."""
    return batch_BxT1.shape[0] * (batch_BxT1.shape[1] - 1)


def _metrics(model, batch_BxT1):
    """Next-token accuracy, besides the loss."""
    logits = model(batch_BxT1[:, :-1])
    return {"accuracy": (jnp.argmax(logits, axis=-1) == batch_BxT1[:, 1:]).mean()}


def trainer(config: ModelConfig, train: TrainConfig, seed: int | None = None):
    """A Trainer of the LM alone (no data): tests and benchmarks that feed their own batches."""
    from flax import nnx

    from island.model import ByteLM, loss_fn
    from island.train import Trainer

    return Trainer(ByteLM(config, nnx.Rngs(train.seed if seed is None else seed)), loss_fn, train)


def sample(model, prompt: np.ndarray, length: int, temperature: float = 1.0, top_k: int | None = None, seed: int = 0) -> np.ndarray:
    """`length` tokens generated after `prompt` (1-D ids), deterministic in `seed`: each next token
    from the softmax of the last position's logits at `temperature`, among the `top_k` likeliest
    (None: all; temperature 0: the likeliest).  The window slides once the context is full."""
    from flax import nnx

    context = model.position.value.shape[0]
    tokens = [int(t) for t in prompt]
    if not tokens:
        raise TaskError("sampling needs a prompt of at least one token")
    if temperature < 0 or (top_k is not None and top_k < 1):
        raise TaskError(f"temperature must be >= 0 and top_k >= 1, got {temperature} and {top_k}")
    # A fixed-length window (zeros after the tokens: causal attention does not look ahead) compiles once.
    next_logits = nnx.jit(lambda model, window_T, last: model(window_T[None])[0, last])
    key = jax.random.PRNGKey(seed)
    for _ in range(length):
        window = np.zeros(context, dtype=np.int32)
        recent = tokens[-context:]
        window[: len(recent)] = recent
        logits = np.asarray(next_logits(model, jnp.asarray(window), len(recent) - 1), dtype=np.float32)
        if temperature == 0:
            tokens.append(int(np.argmax(logits)))
            continue
        if top_k is not None and top_k < logits.size:
            logits[logits < np.sort(logits)[-top_k]] = -np.inf
        key, sub = jax.random.split(key)
        tokens.append(int(jax.random.categorical(sub, jnp.asarray(logits / temperature))))
    return np.asarray(tokens[len(prompt):], dtype=np.int64)
