"""Inner optimization: AdamW with warmup + cosine/constant schedule and clipping; a jitted train
step data-parallel over every local JAX device; a clear stop on NaN/Inf."""

from __future__ import annotations

import jax
import numpy as np
import optax
from flax import nnx
from flax import traverse_util
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from island.config import ModelConfig, TrainConfig
from island.model import ByteLM, loss_fn
from protocol.errors import DlocoError


class DivergedError(DlocoError):
    """Loss or gradients became NaN/Inf: the island stops and publishes nothing from that state."""


def schedule(config: TrainConfig) -> optax.Schedule:
    if config.schedule == "constant":
        return optax.linear_schedule(0.0, config.lr, max(1, config.warmup)) if config.warmup else optax.constant_schedule(config.lr)
    return optax.warmup_cosine_decay_schedule(0.0, config.lr, max(1, config.warmup), max(config.max_steps, config.warmup + 1), config.lr * 0.1)


def inner_optimizer(config: TrainConfig) -> optax.GradientTransformation:
    return optax.chain(optax.clip_by_global_norm(config.clip), optax.adamw(schedule(config), weight_decay=config.weight_decay))


class Trainer:
    """Model + optimizer + mesh.  Batches are split over the local devices along the batch axis."""

    def __init__(self, model_config: ModelConfig, train_config: TrainConfig, seed: int | None = None) -> None:
        self.devices = jax.devices()
        if train_config.batch % len(self.devices):
            raise DlocoError(f"batch {train_config.batch} must be divisible by the {len(self.devices)} local devices")
        self.mesh = Mesh(np.array(self.devices), ("data",))
        self.batch_sharding = NamedSharding(self.mesh, PartitionSpec("data", None))
        self.replicated = NamedSharding(self.mesh, PartitionSpec())
        self.model = ByteLM(model_config, nnx.Rngs(train_config.seed if seed is None else seed))
        self.optimizer = nnx.Optimizer(self.model, inner_optimizer(train_config), wrt=nnx.Param)
        # Parameters and optimizer state replicated from the start, as every step returns them: the
        # second step then reuses the first one's compilation instead of compiling again.
        nnx.update(self.model, jax.device_put(nnx.state(self.model), self.replicated))
        nnx.update(self.optimizer, jax.device_put(nnx.state(self.optimizer), self.replicated))
        self._step = nnx.jit(_train_step)
        self._eval = nnx.jit(loss_fn)

    def step(self, batch_BxT1: np.ndarray) -> tuple[float, float]:
        """One inner step; returns (loss, gradient norm).  Raises DivergedError on NaN/Inf."""
        loss, grad_norm = self._step(self.model, self.optimizer, jax.device_put(batch_BxT1, self.batch_sharding))
        loss, grad_norm = float(loss), float(grad_norm)
        if not (np.isfinite(loss) and np.isfinite(grad_norm)):
            raise DivergedError(f"inner step produced loss={loss}, grad_norm={grad_norm}: stopping; nothing from this state is published")
        return loss, grad_norm

    def evaluate(self, batches: list[np.ndarray]) -> float:
        return float(np.mean([float(self._eval(self.model, jax.device_put(b, self.batch_sharding))) for b in batches]))

    def params(self) -> dict[str, np.ndarray]:
        """Flat {path: float32 array} view of the parameters (a host copy)."""
        flat = traverse_util.flatten_dict(nnx.to_pure_dict(nnx.state(self.model, nnx.Param)))
        return {"/".join(str(k) for k in key): np.asarray(value, dtype=np.float32) for key, value in flat.items()}

    def set_params(self, values: dict[str, np.ndarray]) -> None:
        """Overwrite the named parameters (a subset is fine), keeping the replicated placement."""
        pure = nnx.to_pure_dict(nnx.state(self.model, nnx.Param))
        flat = traverse_util.flatten_dict(pure)
        by_path = {"/".join(str(k) for k in key): key for key in flat}
        for path, value in values.items():
            flat[by_path[path]] = jax.device_put(np.asarray(value, dtype=np.float32), self.replicated)
        state = nnx.state(self.model, nnx.Param)
        nnx.replace_by_pure_dict(state, traverse_util.unflatten_dict(flat))
        nnx.update(self.model, state)


def _train_step(model: ByteLM, optimizer: nnx.Optimizer, batch_BxT1: jax.Array):
    loss, grads = nnx.value_and_grad(loss_fn)(model, batch_BxT1)
    optimizer.update(model, grads)
    return loss, optax.tree.norm(grads)
