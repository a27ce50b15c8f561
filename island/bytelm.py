"""The built-in task (``dloco.island.bytelm:task``, the default): a decoder-only Transformer LM on
text.

Options (`--task-option KEY=VALUE`, the cluster file's [model]/[task], or the island's shorthand
flags --model-size, --width, ...):
  size     tiny | small | base | 124m | 350m (island/config.py MODEL_SIZES; default tiny)
  width, depth, heads, context, vocab, tie_embeddings   override the size's values
  corpus   a file or folder of text, read as bytes (default: this Python's standard library sources)
  tokens   a token file from `dloco tokenize` (.bin or .npy of uint16/uint32 ids) instead of text
  eval_batches  held-out batches (fixed windows of the validation split, the same on every island;
default 8).  The validation and test splits (island/data.py) are also evaluated whole at the end
of a run: validation for choosing settings, test for reported figures only.

The vocabulary is the size's (GPT-2's 50,257 for 124m/350m) or else the data's (256 for bytes, a
token file's own); data with an id the model has no embedding for is refused.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Iterator

import jax.numpy as jnp
import numpy as np

from dloco.island import data
from dloco.island.config import MODEL_SIZES, ModelConfig, TrainConfig
from dloco.island.task import Task, TaskContext, TaskError

OPTIONS = frozenset(
    {
        "size",
        "width",
        "depth",
        "heads",
        "context",
        "vocab",
        "tie_embeddings",
        "corpus",
        "tokens",
        "eval_batches",
    }
)


def model_config(options, data_vocab: int = 256) -> ModelConfig:
    """The LM's shape from a size preset and the options that override it."""
    size = options.get("size", "tiny")
    if size not in MODEL_SIZES:
        raise TaskError(f"model size must be one of {sorted(MODEL_SIZES)}, got {size!r}")
    values = {"vocab": data_vocab, **MODEL_SIZES[size]}
    values.update(
        {
            key: options[key]
            for key in ("width", "depth", "heads", "context", "vocab", "tie_embeddings")
            if key in options
        }
    )
    config = ModelConfig(**values)
    if config.vocab < data_vocab:
        raise TaskError(
            f"the data has token ids up to {data_vocab - 1}, the model's vocabulary only"
            f" {config.vocab} ids (set vocab)"
        )
    return config


def load_data(options) -> data.Corpus:
    if "tokens" in options and "corpus" in options:
        raise TaskError(
            "give the built-in LM either a corpus (text) or tokens (a token file), not both"
        )
    for key in ("tokens", "corpus"):
        if key in options and not isinstance(options[key], str):
            raise TaskError(f"the built-in LM's {key} must be a path, got {options[key]!r}")
    if "tokens" in options:
        return data.load_tokens(options["tokens"])
    return data.load(options.get("corpus"))


def task(ctx: TaskContext) -> Task:
    from flax import nnx

    from dloco.island.model import ByteLM, loss_fn

    unknown = set(ctx.options) - OPTIONS
    if unknown:
        raise TaskError(
            f"the built-in LM has no options {sorted(unknown)}; it takes {sorted(OPTIONS)}"
        )
    corpus = load_data(ctx.options)
    config = model_config(ctx.options, corpus.vocab)
    shards, validation, test = data.split(corpus, ctx.islands)
    return Task(
        model=ByteLM(config, nnx.Rngs(ctx.seed)),
        loss=loss_fn,
        batches=data.Batches(
            shards[ctx.island_index], ctx.batch, config.context, ctx.seed, ctx.island_index
        ),
        eval_batches=data.eval_batches(
            validation, ctx.batch, config.context, _count(ctx.options.get("eval_batches", 8))
        ),
        whole_split=functools.partial(
            _whole_split, {"validation": validation, "test": test}, WHOLE_BATCH, config.context
        ),
        count=count_tokens,
        metrics=_metrics,
        name=(
            f"byte LM ({ctx.options.get('size', 'tiny')}, {dataclasses.asdict(config)}) on"
            f" {corpus.root} ({corpus.files} files, {corpus.tokens_N.size:,} tokens, vocabulary"
            f" {corpus.vocab}, listing sha256 {corpus.digest})"
        ),
    )


# sequences per batch when a split is evaluated whole (fewer calls than the training batch's)
WHOLE_BATCH = 64


def _whole_split(splits: dict, batch: int, context: int, name: str) -> list[np.ndarray]:
    if name not in splits:
        raise TaskError(f"the built-in LM's splits are {sorted(splits)}, got {name!r}")
    return data.whole_split(splits[name], batch, context)


def _count(value) -> int:
    if type(value) is not int or value < 1:
        raise TaskError(f"the built-in LM's eval_batches must be a positive int, got {value!r}")
    return value


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

    from dloco.island.model import ByteLM, loss_fn
    from dloco.island.train import Trainer

    return Trainer(ByteLM(config, nnx.Rngs(train.seed if seed is None else seed)), loss_fn, train)


def sample(
    model,
    prompt: np.ndarray,
    length: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    seed: int = 0,
) -> np.ndarray:
    """`length` tokens generated after `prompt` (1-D ids), deterministic in `seed` (see
    `generate`)."""
    return np.fromiter(
        itertools.islice(generate(model, prompt, temperature, top_k, seed), length),
        dtype=np.int64,
        count=length,
    )


def generate(
    model, prompt: np.ndarray, temperature: float = 1.0, top_k: int | None = None, seed: int = 0
) -> Iterator[int]:
    """Token after token after `prompt` (1-D ids), endless, deterministic in `seed`: each next token
    from the softmax of the last position's logits at `temperature`, among the `top_k` likeliest
    (None: all; temperature 0: the likeliest).  The window slides once the context is full.  An
    iterator, so that a caller can stop on a clock (a big model on a CPU makes about a token a
    second). The arguments are checked here, before the first token is asked for."""
    context, vocab = model.position[...].shape[0], model.embed.num_embeddings
    tokens = [int(t) for t in prompt]
    if not tokens:
        raise TaskError("sampling needs a prompt of at least one token")
    # an embedding lookup would clamp such an id silently
    if not all(0 <= t < vocab for t in tokens):
        raise TaskError(
            f"the prompt has token id {next(t for t in tokens if not 0 <= t < vocab)}; the model's"
            f" vocabulary is {vocab} ids"
        )
    if not temperature >= 0 or (top_k is not None and top_k < 1):
        raise TaskError(f"temperature must be >= 0 and top_k >= 1, got {temperature} and {top_k}")
    return _tokens(model, tokens, context, temperature, top_k, seed)


@functools.cache
def _next_logits():
    """The logits after position `last` of a fixed-length window (zeros after the tokens: causal
    attention does not look ahead), so that a model compiles once, for every sample of it."""
    from flax import nnx

    return nnx.jit(lambda model, window_T, last: model(window_T[None])[0, last])


def _tokens(
    model, tokens: list[int], context: int, temperature: float, top_k: int | None, seed: int
) -> Iterator[int]:
    next_logits = _next_logits()
    # numpy's, not jax's: no random op to compile in every process that samples
    rng = np.random.default_rng(seed)
    while True:
        window = np.zeros(context, dtype=np.int32)
        recent = tokens[-context:]
        window[: len(recent)] = recent
        # A writable copy: np.asarray of a jax array is a read-only view.
        logits = np.array(
            next_logits(model, jnp.asarray(window), len(recent) - 1), dtype=np.float64
        )
        if not np.isfinite(logits).all():
            raise TaskError(
                f"the model's logits after {len(tokens)} tokens are not finite (NaN or Inf): its"
                " parameters are broken"
            )
        if temperature == 0:
            token = int(np.argmax(logits))
        else:
            if top_k is not None and top_k < logits.size:
                # Exactly top_k kept, ties broken towards the lower id as argmax does: top_k = 1 is
                # greedy.
                logits[np.argsort(-logits, kind="stable")[top_k:]] = -np.inf
            # softmax at temperature; a dropped id weighs 0
            weights = np.exp((logits - logits.max()) / temperature)
            token = int(rng.choice(weights.size, p=weights / weights.sum()))
        tokens.append(token)
        yield token
