"""Inner optimization of any task's model: by default AdamW with warmup + cosine/constant schedule
and clipping; a jitted train step data-parallel over every JAX device (every process's, in a
multi-process island: island/group.py); a clear stop on NaN/Inf."""

from __future__ import annotations

import jax
import numpy as np
import optax
from flax import nnx, traverse_util
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dloco.island.config import TrainConfig
from dloco.island.task import TaskError, examples_in
from dloco.protocol.errors import DlocoError


class DivergedError(DlocoError):
    """Loss or gradients became NaN/Inf: the island stops and publishes nothing from that state."""


def schedule(config: TrainConfig) -> optax.Schedule:
    """By the island's own steps: warmup, then cosine to 10 % at max_steps (or constant).  With a
    token budget, warmup then constant: the decay over the cluster's tokens multiplies it
    (island/schedule.py, Trainer.set_rate_scale)."""
    if config.schedule == "constant" or config.budget_tokens:
        return (
            optax.linear_schedule(0.0, config.lr, max(1, config.warmup))
            if config.warmup
            else optax.constant_schedule(config.lr)
        )
    return optax.warmup_cosine_decay_schedule(
        0.0,
        config.lr,
        max(1, config.warmup),
        max(config.max_steps, config.warmup + 1),
        config.lr * 0.1,
    )


def inner_optimizer(config: TrainConfig) -> optax.GradientTransformation:
    return optax.chain(
        optax.clip_by_global_norm(config.clip),
        optax.adamw(schedule(config), weight_decay=config.weight_decay),
    )


class Trainer:
    """Model + optimizer + mesh.  Batches (arrays or pytrees of arrays) are split over the devices
    along their leading axis; in a multi-process island every process is handed the same global
    batch and places only its own devices' rows, so the step equals one process's over as many
    devices.  `loss(model, batch)` is the task's; `metrics(model, batch)`,
    optional, gives held-out extras ({name: scalar}) averaged over the eval batches like the loss.
    """

    def __init__(
        self,
        model: nnx.Module,
        loss,
        train_config: TrainConfig,
        optimizer: optax.GradientTransformation | None = None,
        metrics=None,
    ) -> None:
        self.devices = jax.devices()
        if train_config.batch % len(self.devices):
            raise DlocoError(
                f"batch {train_config.batch} must be divisible by the island's {len(self.devices)}"
                " devices"
            )
        self.mesh = Mesh(np.array(self.devices), ("data",))
        self.batch_sharding = NamedSharding(self.mesh, PartitionSpec("data"))
        self.replicated = NamedSharding(self.mesh, PartitionSpec())
        self.model = model
        self.variables = param_variables(model)
        transform = optimizer if optimizer is not None else inner_optimizer(train_config)
        # A run with a token budget: the update is scaled by the cluster's decay (a hyperparameter
        # of the state, so changing it recompiles nothing); a task's own optimizer is scaled too.
        self.budgeted = bool(train_config.budget_tokens)
        if self.budgeted:
            transform = optax.chain(transform, optax.inject_hyperparams(optax.scale)(step_size=1.0))
        self.optimizer = nnx.Optimizer(self.model, transform, wrt=nnx.Param)
        self.rate_scale = 1.0
        # Parameters and optimizer state replicated from the start, as every step returns them: the
        # second step then reuses the first one's compilation instead of compiling again.
        nnx.update(
            self.model,
            jax.tree.map(lambda leaf: place(leaf, self.replicated), nnx.state(self.model)),
        )
        nnx.update(
            self.optimizer,
            jax.tree.map(lambda leaf: place(leaf, self.replicated), nnx.state(self.optimizer)),
        )

        def train_step(model: nnx.Module, optimizer: nnx.Optimizer, batch):
            value, grads = nnx.value_and_grad(loss)(model, batch)
            optimizer.update(model, grads)
            return value, optax.tree.norm(grads)

        def evaluate(model: nnx.Module, batch):
            extra = metrics(model, batch) if metrics is not None else {}
            if "loss" in extra:
                raise TaskError(
                    "a task's metrics may not be named 'loss' (the held-out loss is the task's"
                    " loss)"
                )
            return {"loss": loss(model, batch), **extra}

        # The step updates the parameters and optimizer state in place (donated), so the peak
        # holds one AdamW state, not the new one beside the old (whose memory, once freed, the
        # process would keep).  A buffer that a host view still holds (`params()` on CPU) is
        # copied instead.
        self._step = nnx.jit(train_step, donate_argnums=(0, 1))
        self._eval = nnx.jit(evaluate)
        self._gradient, self._apply = _halves(loss)

    def _put(self, batch):
        return jax.tree.map(lambda leaf: place(leaf, self.batch_sharding), batch)

    def step(self, batch) -> tuple[float, float]:
        """One inner step; returns (loss, gradient norm).  Raises DivergedError on NaN/Inf."""
        loss, grad_norm = self._step(self.model, self.optimizer, self._put(batch))
        loss, grad_norm = float(loss), float(grad_norm)
        if not (np.isfinite(loss) and np.isfinite(grad_norm)):
            raise DivergedError(
                f"inner step produced loss={loss}, grad_norm={grad_norm}: stopping; nothing from"
                " this state is published"
            )
        return loss, grad_norm

    def gradient(self, batch):
        """(loss, gradient) of one batch at the current parameters; nothing is updated."""
        return self._gradient(self.model, self._put(batch))

    def apply(self, gradient) -> float:
        """One optimizer step on `gradient` (a `gradient`'s, or an average of several); returns its
        norm.  Raises DivergedError on NaN/Inf."""
        norm = float(self._apply(self.model, self.optimizer, gradient))
        if not np.isfinite(norm):
            raise DivergedError(f"the gradient's norm is {norm}: stopping")
        return norm

    def set_rate_scale(self, value: float) -> None:
        """Multiply every later update by `value` (a run with a token budget only)."""
        if not self.budgeted:
            raise DlocoError(
                "the rate scale is for a run with a token budget (TrainConfig.budget_tokens)"
            )
        if value != self.rate_scale:
            self.optimizer.opt_state[-1].hyperparams["step_size"][...] = place(
                np.float32(value), self.replicated
            )
            self.rate_scale = value

    def evaluate(self, batches) -> float:
        """The mean held-out loss."""
        return self.evaluate_all(batches)["loss"]

    def evaluate_whole(self, batches) -> float:
        """The mean held-out loss over every example of `batches`, which may differ in size (a
        whole split: the last batch holds the rest)."""
        sizes = [examples_in(batch) for batch in batches]
        losses = [self.evaluate([batch]) for batch in batches]
        return float(np.dot(losses, sizes) / sum(sizes))

    def evaluate_all(self, batches) -> dict[str, float]:
        """The mean held-out loss and the task's metrics, each averaged over the batches."""
        # Dropout off, BatchNorm on its running statistics (modules that have neither ignore it)
        self.model.eval()
        try:
            results = [self._eval(self.model, self._put(b)) for b in batches]
        finally:
            self.model.train()
        return {name: float(np.mean([float(r[name]) for r in results])) for name in results[0]}

    def params(self) -> dict[str, np.ndarray]:
        """Flat {path: float32 array} of the parameters: on CPU views of the live buffers (a step
        taken while one is held copies that buffer instead of updating it in place)."""
        return {
            path: np.asarray(local(variable.get_value()), dtype=np.float32)
            for path, variable in self.variables.items()
        }

    def set_params(self, values: dict[str, np.ndarray]) -> None:
        """Overwrite the named parameters (a subset is fine), keeping the replicated placement; each
        keeps its own dtype (bf16 stays bf16)."""
        for path, value in values.items():
            variable = self.variables[path]
            dtype = variable.get_value().dtype
            variable.set_value(place(np.asarray(value, dtype=dtype), self.replicated))


def _halves(loss):
    """The step in two halves, for data parallelism between Trainers (suites/inprocess.py): each
    computes its batch's gradient, the gradients are averaged (the all-reduce), and every Trainer
    applies the same average, so all hold the same parameters and optimizer state."""

    def gradient(model: nnx.Module, batch):
        return nnx.value_and_grad(loss)(model, batch)

    def apply(model: nnx.Module, optimizer: nnx.Optimizer, gradient):
        optimizer.update(model, gradient)
        return optax.tree.norm(gradient)

    return nnx.jit(gradient), nnx.jit(apply, donate_argnums=(0, 1))


def flat_params(model: nnx.Module) -> dict[str, np.ndarray]:
    """A model's parameters as {"a/b/c": float32 host array}: the names the islands and the merger
    exchange."""
    flat = traverse_util.flatten_dict(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    return {
        "/".join(str(k) for k in key): np.asarray(local(value), dtype=np.float32)
        for key, value in flat.items()
    }


def param_variables(model: nnx.Module) -> dict[str, nnx.Variable]:
    """A model's parameters as {"a/b/c": its Variable}, named and ordered as `flat_params` names
    them.  A Trainer reads and writes parameters through these (a step updates their values in
    place): a traversal of the whole graph per adoption cost more than its arithmetic."""
    found = {
        "/".join(str(k) for k in path): node
        for path, node in nnx.iter_graph(model)
        if isinstance(node, nnx.Param)
    }
    names = list(flat_params(model))
    if set(names) != set(found):
        raise DlocoError(
            "the model's parameters are not where its graph says:"
            f" {sorted(set(names) ^ set(found))[:5]}"
        )
    return {name: found[name] for name in names}


def place(value, sharding):
    """A value every process holds alike, onto `sharding` (None: the default device).  When the
    sharding spans other processes' devices each process builds only its own devices' part."""
    if sharding is None or sharding.is_fully_addressable:
        return jax.device_put(value, sharding)
    if isinstance(value, jax.Array) and jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key):
        return jax.random.wrap_key_data(
            place(jax.random.key_data(value), sharding), impl=jax.random.key_impl(value)
        )
    host = np.asarray(value)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def local(value):
    """A replicated value as this process sees it (its first device's copy when the array spans
    other processes' devices too)."""
    return (
        value
        if not isinstance(value, jax.Array) or value.is_fully_addressable
        else value.addressable_data(0)
    )


def assign(model: nnx.Module, values: dict[str, np.ndarray], placement=None) -> None:
    """Overwrite the named parameters of `model` in place (a subset is fine); `placement`: a
    sharding to put them with (None: the default device).  A Trainer and a model loaded outside one
    share it.
    """
    pure = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    flat = traverse_util.flatten_dict(pure)
    by_path = {"/".join(str(k) for k in key): key for key in flat}
    # float32 on the wire; each parameter keeps its own dtype (bf16 stays bf16)
    for path, value in values.items():
        flat[by_path[path]] = place(np.asarray(value, dtype=flat[by_path[path]].dtype), placement)
    state = nnx.state(model, nnx.Param)
    nnx.replace_by_pure_dict(state, traverse_util.unflatten_dict(flat))
    nnx.update(model, state)
