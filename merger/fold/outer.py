"""Outer optimizers over a fragment's parameters, as optax transformations.

The pseudo-gradient is the merged delta (anchor - theta), so the outer step descends along it:
with lr 1 and no momentum, one island's delta moves the global model exactly to that island's
parameters.  Default: SGD with Nesterov momentum, lr 0.7, momentum 0.9 (DiLoCo, Douillard et al.
2023) — `optax.sgd(..., nesterov=True)`.

Delayed Nesterov (Liu et al. 2024, "Asynchronous Local-SGD Training for Language Modeling",
arXiv:2401.09135, with their c = 0): asynchronous folds each take a plain step of ``lr * g / N``;
every N-th fold the momentum buffer absorbs the mean of the last N pseudo-gradients,
``m <- beta * m + mean(g)``, and the parameters take the extra momentum step ``lr * beta * m``.
With N = 1 it is exactly Nesterov SGD.

Round Nesterov: Delayed Nesterov whose N is a round rather than a count of folds, for folds scaled
by their share of a round (`merge.share_window`).  Each fold takes the plain step ``lr * g`` (g is
already scaled by its share); when the shares folded since the momentum's last update reach a whole
round (1), the momentum absorbs their sum, ``m <- beta * m + sum(g)``, and the parameters take the
extra step ``lr * beta * m``.  Four folds of a quarter each then move the model as one synchronous
Nesterov step on their mean does, and the momentum decays once per round of shares, as DiLoCo's
does once per round, not once per fold (which, with four one-island folds per round, is
``beta ** 4`` a round).  With unequal speeds a round of shares is not a round of the fastest
island: shares are token weights, so two half-speed islands' deltas count as much as the fast
ones' but come half as often (with two of each, about 4/3 of a fast island's round).  A fold of a
whole round (share 1: the synchronous modes, or share_window 0) is exactly Nesterov SGD.  Every
optimizer's update takes the fold's share (optax extra args); the others ignore it.

`outer.momentum_dtype = "bfloat16"` keeps the momentum (and the Delayed and Round variants' sum of
pseudo-gradients) in 16 bits between folds, half the optimizer state's memory; each step is
computed in float32 from it and only what is kept is rounded.  Such a state is stepped in place
by two programs (`make_step`): the new parameters (reading the state), then the new state, each
written over its own buffers.  One program reads the old state in two of XLA's loops and writes it
in one, so XLA copies it first into fresh memory, every step; two programs copy nothing.  The same
arithmetic, the same bytes (tests/test_outer_split.py); the state's program passes no parameters
to `update` (every optimizer of `outer_optimizer` ignores them).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dloco.merger.config import OuterConfig


def _zeros(params: optax.Params, dtype) -> optax.Params:
    return jax.tree_util.tree_map(lambda p: jnp.zeros_like(p, dtype=dtype), params)


def _kept(tree: optax.Updates, dtype) -> optax.Updates:
    """`tree` cast to the dtype the state is kept in (the arithmetic before is float32)."""
    return jax.tree_util.tree_map(lambda x: x.astype(dtype), tree)


def _float(tree: optax.Updates) -> optax.Updates:
    return jax.tree_util.tree_map(lambda x: x.astype(jnp.float32), tree)


class NesterovState(NamedTuple):
    momentum: optax.Updates


def nesterov(learning_rate: float, momentum: float, dtype) -> optax.GradientTransformation:
    """`optax.sgd(..., nesterov=True)` with its momentum kept in `dtype` and every product taken
    in float32 (optax's own `accumulator_dtype` multiplies by the momentum rounded to it: 0.9 is
    0.8984375 in bfloat16)."""

    def init(params: optax.Params) -> NesterovState:
        return NesterovState(_zeros(params, dtype))

    def update(grads: optax.Updates, state: NesterovState, params: optax.Params | None = None):
        del params
        trace = jax.tree_util.tree_map(lambda g, m: g + momentum * m, grads, _float(state.momentum))
        updates = jax.tree_util.tree_map(
            lambda g, t: -learning_rate * (g + momentum * t), grads, trace
        )
        return updates, NesterovState(_kept(trace, dtype))

    return optax.GradientTransformation(init, update)


class DelayedNesterovState(NamedTuple):
    # folds since the start, int32
    count: jax.Array
    momentum: optax.Updates
    # sum of pseudo-gradients since the last momentum update
    accumulated: optax.Updates


def delayed_nesterov(
    learning_rate: float, momentum: float, delay: int, dtype=jnp.float32
) -> optax.GradientTransformation:
    def init(params: optax.Params) -> DelayedNesterovState:
        # two buffers: a fold's step writes each over itself (donated)
        return DelayedNesterovState(
            jnp.zeros([], jnp.int32), _zeros(params, dtype), _zeros(params, dtype)
        )

    def update(
        grads: optax.Updates, state: DelayedNesterovState, params: optax.Params | None = None
    ):
        del params
        count = state.count + 1
        accumulated = jax.tree_util.tree_map(jnp.add, _float(state.accumulated), grads)
        due = count % delay == 0
        new_momentum = jax.tree_util.tree_map(
            lambda m, a: jnp.where(due, momentum * m + a / delay, m),
            _float(state.momentum),
            accumulated,
        )
        updates = jax.tree_util.tree_map(
            lambda g, m: (
                -learning_rate * (g / delay + jnp.where(due, momentum * m, jnp.zeros_like(m)))
            ),
            grads,
            new_momentum,
        )
        accumulated = jax.tree_util.tree_map(
            lambda a: jnp.where(due, jnp.zeros_like(a), a), accumulated
        )
        return updates, DelayedNesterovState(
            count, _kept(new_momentum, dtype), _kept(accumulated, dtype)
        )

    return optax.GradientTransformation(init, update)


class RoundNesterovState(NamedTuple):
    # share of a round folded since the momentum's last update, float32
    credit: jax.Array
    momentum: optax.Updates
    # sum of pseudo-gradients since the momentum's last update
    accumulated: optax.Updates


def round_nesterov(
    learning_rate: float, momentum: float, dtype=jnp.float32
) -> optax.GradientTransformationExtraArgs:
    def init(params: optax.Params) -> RoundNesterovState:
        return RoundNesterovState(
            jnp.zeros([], jnp.float32), _zeros(params, dtype), _zeros(params, dtype)
        )

    def update(
        grads: optax.Updates,
        state: RoundNesterovState,
        params: optax.Params | None = None,
        *,
        share=1.0,
        **extra,
    ):
        del params, extra
        credit = state.credit + jnp.asarray(share, jnp.float32)
        accumulated = jax.tree_util.tree_map(jnp.add, _float(state.accumulated), grads)
        # a whole round folded (float sums of quarters, thirds)
        due = credit >= 1.0 - 1e-6
        new_momentum = jax.tree_util.tree_map(
            lambda m, a: jnp.where(due, momentum * m + a, m), _float(state.momentum), accumulated
        )
        updates = jax.tree_util.tree_map(
            lambda g, m: -learning_rate * (g + jnp.where(due, momentum * m, jnp.zeros_like(m))),
            grads,
            new_momentum,
        )
        accumulated = jax.tree_util.tree_map(
            lambda a: jnp.where(due, jnp.zeros_like(a), a), accumulated
        )
        return updates, RoundNesterovState(
            jnp.where(due, credit - 1.0, credit),
            _kept(new_momentum, dtype),
            _kept(accumulated, dtype),
        )

    return optax.GradientTransformationExtraArgs(init, update)


# optimizers whose folds from dense int codes take their step in the merge's pass
# (merger/engines/fused.py): id -> (the optimizer, (lr, momentum))
_FUSED: dict[int, tuple[optax.GradientTransformation, tuple[float, float]]] = {}


def fused_terms(optimizer: optax.GradientTransformation) -> tuple[float, float] | None:
    """(lr, momentum) of an `outer_optimizer` of kind "nesterov", whose state is one momentum
    array per parameter (float32 or bfloat16); None for any other optimizer."""
    entry = _FUSED.get(id(optimizer))
    return entry[1] if entry is not None and entry[0] is optimizer else None


@functools.lru_cache(maxsize=32)
def outer_optimizer(config: OuterConfig) -> optax.GradientTransformationExtraArgs:
    """One optimizer object per configuration: compiled fold steps (keyed by it) are shared by every
    core built from the same configuration — a recovered or benchmarked core never recompiles."""
    dtype = jnp.dtype(config.momentum_dtype)
    if config.kind == "nesterov":
        optimizer = optax.with_extra_args_support(
            optax.sgd(config.lr, momentum=config.momentum, nesterov=True)
            if dtype == jnp.float32
            else nesterov(config.lr, config.momentum, dtype)
        )
        _FUSED[id(optimizer)] = (optimizer, (config.lr, config.momentum))
        return optimizer
    if config.kind == "sgd":
        return optax.with_extra_args_support(optax.sgd(config.lr))
    if config.kind == "round_nesterov":
        return round_nesterov(config.lr, config.momentum, dtype)
    return optax.with_extra_args_support(
        delayed_nesterov(config.lr, config.momentum, config.delay, dtype)
    )


@functools.lru_cache(maxsize=64)
def make_step(optimizer: optax.GradientTransformation, *, in_place: bool = False):
    """``(params, opt_state, pseudo_gradient, share=1.0) -> (params, opt_state)`` over path-keyed
    dicts; `share` is the fold's share of a round (a traced argument: one compilation for every
    value).  `in_place`: the parameters and optimizer state passed in are donated (their buffers
    hold the new ones; one a host view still holds is copied instead; keyword-only, as the cache
    would hold a positional call apart).

    In place, a state narrower than float32 is stepped by two programs (module docstring).

    The jitted core sees lists in path order, so fragments whose tensors have the same shapes
    share one compilation whatever their paths.  Cached per optimizer (and `outer_optimizer` per
    configuration), so every core of one configuration shares the compiled step.
    """

    # the same object for one that takes them
    optimizer = optax.with_extra_args_support(optimizer)

    @functools.partial(jax.jit, donate_argnums=(0, 1) if in_place else ())
    def flat_step(params, opt_state, pseudo_gradient, share):
        updates, opt_state = optimizer.update(pseudo_gradient, opt_state, params, share=share)
        return optax.apply_updates(params, updates), opt_state

    @functools.partial(jax.jit, donate_argnums=(0,))
    def params_step(params, opt_state, pseudo_gradient, share):
        updates, _ = optimizer.update(pseudo_gradient, opt_state, params, share=share)
        return optax.apply_updates(params, updates)

    @functools.partial(jax.jit, donate_argnums=(0,))
    def state_step(opt_state, pseudo_gradient, share):
        return optimizer.update(pseudo_gradient, opt_state, None, share=share)[1]

    def programs(opt_state) -> list:
        """(program, which of (params, opt_state, pseudo_gradient, share) it takes) in order."""
        if in_place and _narrow(opt_state):
            return [(params_step, (0, 1, 2, 3)), (state_step, (1, 2, 3))]
        return [(flat_step, (0, 1, 2, 3))]

    def step(params, opt_state, pseudo_gradient, share: float = 1.0):
        paths = sorted(params)
        args = [
            [params[p] for p in paths],
            opt_state,
            [pseudo_gradient[p] for p in paths],
            np.float32(share),
        ]
        if len(programs(opt_state)) == 1:
            new_params, opt_state = flat_step(*args)
        else:
            new_params, opt_state = params_step(*args), state_step(*args[1:])
        return dict(zip(paths, new_params)), opt_state

    # rounds merged from sparse codes take their outer step in merger/engines/sparse_xla.py
    step.optimizer = optimizer
    # for compiling ahead (`compile_step`)
    step.programs = programs
    return step


def compile_step(step, params: list, opt_state) -> None:
    """Compile the programs `step` (`make_step`'s) runs over these (shapes or arrays, params in
    path order)."""
    args = [params, opt_state, params, np.float32(1)]
    for program, taken in step.programs(opt_state):
        program.lower(*[args[i] for i in taken]).compile()


def _narrow(opt_state) -> bool:
    """Whether the optimizer state holds floating arrays narrower than float32."""
    return any(
        jnp.issubdtype(leaf.dtype, jnp.floating) and jnp.dtype(leaf.dtype).itemsize < 4
        for leaf in jax.tree_util.tree_leaves(opt_state)
    )
