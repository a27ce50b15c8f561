"""A decoder-only Transformer language model in Flax NNX (pre-norm, learned positions): the built-in
task's."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dloco.island.config import ModelConfig


class Block(nnx.Module):
    def __init__(self, config: ModelConfig, rngs: nnx.Rngs) -> None:
        width = config.width
        self.heads = config.heads
        self.attn_norm = nnx.LayerNorm(width, rngs=rngs)
        self.qkv = nnx.Linear(width, 3 * width, use_bias=False, rngs=rngs)
        self.out = nnx.Linear(width, width, use_bias=False, rngs=rngs)
        self.mlp_norm = nnx.LayerNorm(width, rngs=rngs)
        self.up = nnx.Linear(width, config.mlp_ratio * width, rngs=rngs)
        self.down = nnx.Linear(config.mlp_ratio * width, width, rngs=rngs)

    def __call__(self, x_BxTxD: jax.Array) -> jax.Array:
        b, t, d = x_BxTxD.shape
        qkv = self.qkv(self.attn_norm(x_BxTxD)).reshape(b, t, 3, self.heads, d // self.heads)
        attended = jax.nn.dot_product_attention(
            qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], is_causal=True
        )
        x_BxTxD = x_BxTxD + self.out(attended.reshape(b, t, d))
        return x_BxTxD + self.down(jax.nn.gelu(self.up(self.mlp_norm(x_BxTxD))))


class ByteLM(nnx.Module):
    def __init__(self, config: ModelConfig, rngs: nnx.Rngs) -> None:
        self.embed = nnx.Embed(config.vocab, config.width, rngs=rngs)
        self.position = nnx.Param(
            jax.random.normal(rngs.params(), (config.context, config.width)) * 0.02
        )
        self.blocks = nnx.List([Block(config, rngs) for _ in range(config.depth)])
        self.final_norm = nnx.LayerNorm(config.width, rngs=rngs)
        self.head = (
            None
            if config.tie_embeddings
            else nnx.Linear(config.width, config.vocab, use_bias=False, rngs=rngs)
        )

    def __call__(self, tokens_BxT: jax.Array) -> jax.Array:
        x = self.embed(tokens_BxT) + self.position[: tokens_BxT.shape[1]]
        for block in self.blocks:
            x = block(x)
        x = self.final_norm(x)
        return self.embed.attend(x) if self.head is None else self.head(x)


def loss_fn(model: ByteLM, batch_BxT1: jax.Array) -> jax.Array:
    """Mean next-byte cross-entropy in nats: inputs batch[:, :-1], targets batch[:, 1:]."""
    logits = model(batch_BxT1[:, :-1])
    targets = batch_BxT1[:, 1:]
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32))
    return -jnp.take_along_axis(log_probs, targets[..., None], axis=-1).mean()
