"""The public entry: `prepare` a model's sketch, and the `NNXSketch` a train step calls."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding

from logra_jax.nnx_sketch.attach import Attached, Probe, SketchFactor
from logra_jax.nnx_sketch.discovery import (Target, find_targets, param_paths, refuse_explicit_axes,
                                            sketch_sharding)
from logra_jax.optim import (DEFAULT_TARGETS, SketchSpec, exact_kl, make_predict_kl, merge_targets,
                             split_targets)
from logra_jax.optim import update_index as logra_update_index
from logra_jax.optim.logra import sketch_spec_of
from logra_jax.tree_paths import leaves_with_paths, map_with_paths


@dataclasses.dataclass(frozen=True, eq=False)
class NNXSketch:
    """LoGRA's sketch of one NNX model's targets: the ``SketchSpec`` (with the kernel layouts its
    LinearGeneral and Einsum targets need), the targets found, and the functions a train step
    calls. Make it with ``prepare``; it holds no arrays and does not change the model.
    """

    spec: SketchSpec
    targets: dict[str, Target]
    shardings: dict[str, NamedSharding]

    def logra_kwargs(self) -> dict[str, Any]:
        """The sketch arguments of ``logra(...)``, so optimizer and gradients draw the same A."""
        s = self.spec
        return dict(targets=s.targets, rank=s.rank, seed=s.seed, distribution=s.distribution,
                    refresh=s.refresh, layouts=dict(s.layouts))

    # -- probes ---------------------------------------------------------------------------------
    def _found(self, model):
        found = find_targets(model, self.spec)
        infos = {p: t.info for p, (_, t) in found.items()}
        if infos != {p: t.info for p, t in self.targets.items()}:
            raise ValueError(f"this model's targets {sorted(found)} differ from those the sketch "
                             f"was prepared for ({sorted(self.targets)}) or have other shapes")
        return found

    def check(self, tx) -> None:
        """ValueError unless ``tx`` — a transformation, or the ``nnx.Optimizer`` holding it — was
        made by ``logra(...)`` with this sketch's arguments (`logra_kwargs`): another seed, rank,
        distribution, refresh, targets or layouts would reconstruct every update with another A
        than the one the gradients were sketched with, silently."""
        tx = getattr(tx, "tx", tx)
        theirs = sketch_spec_of(tx)
        if theirs is None:
            raise ValueError("this optimizer was not made by logra_jax.optim.logra(...), so it "
                             "cannot reconstruct this sketch's gradients; build it with "
                             "logra(..., **sketch.logra_kwargs())")
        ours = self.spec
        differ = [f"{f.name}={getattr(theirs, f.name)!r} (the sketch's: {getattr(ours, f.name)!r})"
                  for f in dataclasses.fields(SketchSpec)
                  if getattr(theirs, f.name) != getattr(ours, f.name)]
        if differ:
            raise ValueError(f"logra(...) was built with {'; '.join(differ)}: it would "
                             f"reconstruct the updates with another A than the gradients were "
                             f"sketched with; pass **sketch.logra_kwargs() unchanged")

    def keys(self, update_index) -> dict[str, jax.Array]:
        """{target path: key data (*stack, 2) of A_l(k)} for the gradient after ``update_index``
        updates (``update_index(opt_state)``, or the ``nnx.Optimizer`` itself: then its
        transformation is first `check`ed against this sketch)."""
        if isinstance(update_index, nnx.Optimizer):
            self.check(update_index)
            update_index = logra_update_index(update_index.opt_state)
        k = self.spec.projection_index(_index(update_index))
        return {path: self.spec.keys(t.info, k) for path, t in self.targets.items()}

    def zero_factors(self) -> dict[str, jax.Array]:
        """{target path: B = 0 (*stack, out, r)} in fp32, laid out like the kernels on a mesh."""
        factors = {}
        for path, t in self.targets.items():
            b = jnp.zeros(t.info.sketch_shape, jnp.float32)
            if path in self.shardings:
                b = jax.lax.with_sharding_constraint(b, self.shardings[path])
            factors[path] = b
        return factors

    def sketched(self, model, keys: dict[str, jax.Array], factors: dict[str, jax.Array], *,
                 factor_is_zero: bool = True):
        """A context in which ``model``'s target layers compute y = layer(x) + (x·Aᵀ)·Bᵀ with
        B = ``factors`` (zero: gradient sketches; nonzero, ``factor_is_zero=False``: the model at
        W + B·A), restored on exit. For one's own differentiation; ``value_and_grad`` uses it."""
        return Attached(model, self._found(model), factors, keys, self.spec.distribution,
                        factor_is_zero)

    # -- gradients ------------------------------------------------------------------------------
    def value_and_grad(self, loss_fn: Callable, *, has_aux: bool = False,
                       train_others: bool = True) -> Callable:
        """``grad_fn(model, update_index, *args) -> (value, grads)`` for ``loss_fn(model, *args)``.

        ``value`` is what ``nnx.value_and_grad`` gives (``(loss, aux)`` with ``has_aux``);
        ``grads`` an ``nnx.State`` with the paths of ``nnx.state(model, nnx.Param)``: the sketch
        S = G·Aᵀ (*stack, out, r) at each target, the dense gradient elsewhere (zeros, never
        computed, with ``train_others=False``: the KL variant's frozen others). Sketches of
        micro-batches add up like gradients. Feed it to ``nnx.Optimizer(model, tx,
        wrt=nnx.Param).update`` or, as ``nnx.to_pure_dict(grads)``, to ``tx.update``.
        ``update_index`` is ``update_index(opt_state)``, the k of A the next update will use, or
        the ``nnx.Optimizer`` itself, whose LoGRA transformation is then checked to draw the same
        A as this sketch (`check`: another seed or rank in ``logra(...)`` is an error).
        Other state the loss changes (RNG counters, batch statistics) is written back as
        ``nnx.value_and_grad`` does.
        """
        def grad_fn(model, update_index, *args):
            found = self._found(model)
            kernels = set(found)

            def others(path, value):
                return (isinstance(value, nnx.Param) and not isinstance(value, Probe)
                        and "/".join(map(str, path)) not in kernels)
            wrt = nnx.Any(SketchFactor, others) if train_others else SketchFactor
            with Attached(model, found, self.zero_factors(), self.keys(update_index),
                          self.spec.distribution, True):
                value, grads = nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, wrt),
                                                  has_aux=has_aux)(model, *args)
            return value, self._assemble(model, found, grads, train_others)
        return grad_fn

    def _assemble(self, model, found, grads, train_others: bool) -> nnx.State:
        """nnx.State over the model's Param paths: sketches at the kernels, dense (or 0) else."""
        by_owner = {owner: path for path, (owner, _) in found.items()}
        flat, sketches = {}, {}
        for parts, var in nnx.to_flat_state(grads):
            parts = tuple(parts)
            if isinstance(var, SketchFactor):
                path = by_owner[parts[:-1]]
                sketch = var[...]
                if path in self.shardings:   # as its probe, wherever XLA would put the cotangent
                    sketch = jax.lax.with_sharding_constraint(sketch, self.shardings[path])
                sketches[path] = sketch
            elif not isinstance(var, Probe):
                flat[parts] = var
        out = []
        for parts, var in param_paths(model):
            path = "/".join(map(str, parts))
            if path in found:
                out.append((parts, type(var)(sketches[path])))
            elif parts in flat:
                out.append((parts, flat[parts]))
            elif not train_others:
                out.append((parts, var.replace(jnp.zeros_like(var[...]))))
            else:
                raise AssertionError(f"no gradient for {path!r}")
        return nnx.from_flat_state(out)

    # -- predicted-KL control -------------------------------------------------------------------
    def kl_control(self, model, update_index, logits_fn: Callable, *probe_args,
                   response_mask: jax.Array, temperature: float = 1.0,
                   others_frozen: bool = False, safeguard: bool = True) -> dict[str, Callable]:
        """``{"predict_kl": ..., "candidate_kl": ...}`` for ``tx.update(..., **kl)`` of a
        ``logra(..., kl_control=True)`` (docs/algorithm.md §6), on the probe batch
        ``logits_fn(model, *probe_args) -> logits (..., vocab)``.

        predict_kl: one JVP of the probe logits along the candidate (dB = U at the targets, the
        non-target updates elsewhere), ΔW never formed. candidate_kl (``safeguard``): the exact
        KL of the α-scaled candidate, the model run at W + U·A through the probes' nonzero branch.
        Unlike our Decoder's (which forms the head a few positions at a time), it forms the probe
        batch's whole logits, twice. ``others_frozen``: the non-target updates are zero (the KL
        variant); their tangent is skipped. The updates may be keyed like a pure dict or an
        nnx.State (what nnx.Optimizer passes).
        """
        found = self._found(model)
        graphdef, state = nnx.split(model)
        params = _plain(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
        kernels, others = split_targets(params, self.spec)
        keys, zeros = self.keys(update_index), self.zero_factors()

        def logits_at(others_, factors, factor_is_zero):
            copy = nnx.merge(graphdef, jax.tree.map(lambda x: x, state))   # fresh Variables
            nnx.update(copy, merge_targets(others_, kernels))
            with Attached(copy, found, factors, keys, self.spec.distribution, factor_is_zero):
                return logits_fn(copy, *probe_args)

        predict = make_predict_kl(functools.partial(logits_at, factor_is_zero=True), others, zeros,
                                  response_mask, temperature, others_frozen=others_frozen)
        fns = {"predict_kl": lambda updates: predict(_plain(updates))}
        if safeguard:
            logits_old = logits_fn(model, *probe_args)

            def candidate_kl(updates):
                updates = _plain(updates)
                factors = {path: jnp.asarray(getattr(u, "factor", u), jnp.float32)
                           for path, u in leaves_with_paths(updates) if path in found}
                if others_frozen:
                    others_new = others
                else:
                    others_new = map_with_paths(
                        lambda path, p, u: None if p is None else
                        (p.astype(jnp.float32) + u).astype(p.dtype), others,
                        map_with_paths(lambda path, u: None if path in found else u, updates))
                logits_new = logits_at(others_new, factors, False)
                return exact_kl(logits_old, logits_new, response_mask, temperature)
            fns["candidate_kl"] = candidate_kl
        return fns


def prepare(model, *, targets: str = DEFAULT_TARGETS, rank: int = 256, seed: int = 42,
            distribution: str = "rademacher", refresh: bool = True) -> NNXSketch:
    """Finds ``model``'s targets (params whose '/'-joined path matches ``targets``) and checks that
    each is the kernel of an nnx.Linear, nnx.LinearGeneral or nnx.Einsum; returns the `NNXSketch`
    whose ``logra_kwargs()`` build the optimizer and whose ``value_and_grad`` the gradients.

    Nothing in the model changes. The model may be abstract (``nnx.eval_shape``); with sharded
    arrays the probes and sketches are laid out like the kernels (their stack and out entries).
    The same arguments as ``logra(...)``: rank r, seed, distribution and refresh fix A_l(k); r
    must be below every target's input width, as everywhere (`SketchSpec`: an error naming the
    targets, not a rank lowered for the narrow ones).
    """
    spec = SketchSpec(targets=targets, rank=rank, seed=seed, distribution=distribution,
                      refresh=refresh)
    found = find_targets(model, spec)
    spec = dataclasses.replace(spec, layouts={p: t.layout for p, (_, t) in found.items()
                                              if t.layout is not None})
    kernels = {"/".join(map(str, p)): v for p, v in param_paths(model)}
    for path in found:
        refuse_explicit_axes(kernels[path].get_value(), path)
    shardings = {}
    for path, (_, t) in found.items():
        sharding = sketch_sharding(kernels[path].get_value(), t.info)
        if sharding is not None:
            shardings[path] = sharding
    return NNXSketch(spec, {p: t for p, (_, t) in found.items()}, shardings)


def _index(update_index) -> jax.Array:
    if isinstance(update_index, nnx.Variable):   # nnx.Optimizer keeps its state in OptState
        update_index = update_index[...]
    return jnp.asarray(update_index, jnp.int32)


def _plain(tree):
    """A params-shaped tree (nnx.State, dict) as nested plain dicts; other nodes as they are."""
    if isinstance(tree, Mapping):
        return {k: _plain(v) for k, v in tree.items()}
    return tree
