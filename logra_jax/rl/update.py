"""One policy update, jitted: micro-batched gradients → optimizer → merge → realized KL on the probe.

With LoGRA the gradient of every target is its sketch S = G·Aᵀ (docs/algorithm.md §3): the loss is
differentiated with respect to the zero probe factors B, never the target kernels, and the
micro-batch sum lives in sketch space (out × r per target), so no full-size gradient accumulator
exists. Dense AdamW, the baseline, runs the same loop with ordinary gradients.

The predicted-KL controller (§6) sees the candidate update through one JVP on a probe batch (the
first ``probe_size`` rows); after the merge the same rows give the realized KL(π_old ‖ π_new).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding

from logra_jax.optim import (LowRankUpdate, SketchSpec, apply_updates_counting_changes,
                             exact_kl_from_hidden, make_candidate_kl, make_predict_kl, make_probes, merge_targets,
                             probe_factors, split_targets, update_index, with_factors,
                             with_update_factors)
from logra_jax.sharding import mesh_of, sketch_shardings
from logra_jax.tree_paths import leaves_with_paths
from logra_jax.rl.algorithms.base import Loss
from logra_jax.rl.policy import Policy, Sequences


def update_compiler_options(params) -> dict:
    """The jitted update's compiler options for these params (arrays or ShapeDtypeStructs).

    With fp32 weight stacks ([layers, ...] arrays: fp32 master weights under bf16 compute), the TPU
    compiler's bfloat16-propagation pass sees the layer scan read each stack only through bf16
    casts and turns it into a bf16 copy of the whole stack, cast once before the micro-steps and
    held through the update: +2.66 GiB per chip for Qwen2.5-7B's three MLP stacks
    (docs/results/memory.md), to save per-layer casts that are small beside each layer's products.
    The pass is turned off for them. With bf16 weights there is nothing to cast and the pass stays
    on: it saves 0.42 GiB of Llama-3.1-70B's update on v6e-8. Other backends have no such pass.
    """
    fp32_stacks = any(x.dtype == jnp.float32 and x.ndim >= 3 for x in jax.tree.leaves(params))
    return {"xla_disable_hlo_passes": "bfloat16-propagation"} if fp32_stacks else {}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrainBatch:
    """Everything one update needs about a batch of rollouts ([b] or [b, C] arrays)."""

    seqs: Sequences
    advantages: jax.Array      # [b]
    rollout_logp: jax.Array    # [b, C] log-probs the sampler drew the tokens with
    ref_logp: jax.Array        # [b, C] reference-model log-probs (zeros when beta = 0)
    completed: jax.Array       # [b] the row ended with EOS (mismatch is measured on these only)

    @property
    def size(self) -> int:
        return self.advantages.shape[0]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class CompactUpdate:
    """What a factors sync needs of one update (docs/algorithm.md §8): the targets' updates
    {path: LowRankUpdate} (factor U, keys of A, weight_scale) and the update index k their A used."""

    low_rank: dict[str, LowRankUpdate]
    update_index: jax.Array


def _tree_add(a, b):
    return jax.tree.map(jnp.add, a, b)


@dataclasses.dataclass(frozen=True)
class _Gradient:
    """One gradient mode of the update (dense, LoRA's adapters, or LoGRA's sketches): what is
    differentiated (``wrt``, one dict), the objective of one micro-batch as a function of it, and
    how the mean gradient becomes the params-shaped tree ``tx.update`` takes. ``targets``,
    ``others`` and ``probes``: LoGRA's split of the params and its probes (the KL control reads
    them); None otherwise."""

    wrt: dict
    objective: Callable      # (wrt, micro-batch) → (loss, aux)
    to_params: Callable      # mean gradient (wrt's tree) → the gradient tx.update takes
    targets: Any = None
    others: Any = None
    probes: Any = None


class PolicyUpdate:
    """Builds and holds the jitted update for one (policy, optimizer, loss) triple.

    Args:
      policy: the model graph.
      tx: the optimizer (`logra(...)` or any optax transformation for dense gradients).
      loss: the objective of one micro-batch (an algorithm's `Loss`, rl/algorithms/): (log π_θ of
        the completion tokens, the micro-batch) → (loss, metrics).
      temperature: the sampling temperature T the log-probs are taken at (the sampler's).
      micro_batch_size: rows per gradient pass; the batch size must be a multiple of it.
      probe_size: rows (from the start of the batch) for predicted and realized KL.
      sketch: the SketchSpec `tx` was built with, or None for a dense optimizer.
      train_others: whether non-target params get gradients (False: frozen, as in the KL variant;
        their dense gradient is then never computed).
      kl_control: pass ``predict_kl`` and ``mismatch`` to ``tx.update``.
      return_updates: the step also returns a `CompactUpdate` (the targets' LowRankUpdates and
        their update index k), for a rollout engine that syncs by factors (§8).
      subtree: the key of the only params entry the optimizer trains (``"lora"``: the adapters,
        the base frozen and never differentiated); `tx` then sees ``params[subtree]`` alone.
    """

    def __init__(self, policy: Policy, tx: optax.GradientTransformation, loss: Loss, *,
                 temperature: float = 1.0, micro_batch_size: int, probe_size: int,
                 sketch: SketchSpec | None,
                 train_others: bool = True, kl_control: bool = False, return_updates: bool = False,
                 subtree: str | None = None):
        if micro_batch_size <= 0 or probe_size <= 0:
            raise ValueError(f"micro_batch_size and probe_size must be positive, got "
                             f"{micro_batch_size} and {probe_size}")
        if kl_control and sketch is None:
            raise ValueError("kl_control needs the LoGRA optimizer (a SketchSpec)")
        if return_updates and sketch is None:
            raise ValueError("return_updates returns LoGRA's low-rank updates: it needs a SketchSpec")
        self.policy = policy
        self.tx = tx
        self.loss = loss
        self.temperature = temperature
        self.micro_batch_size = micro_batch_size
        self.probe_size = probe_size
        self.sketch = sketch
        self.train_others = train_others
        self.kl_control = kl_control
        self.return_updates = return_updates
        if subtree is not None and sketch is not None:
            raise ValueError("subtree (LoRA) is a dense-gradient mode; it takes no SketchSpec")
        self.subtree = subtree
        self._step = None
        self._sketch_shardings: dict[str, NamedSharding] = {}
        self._mesh = None

    def __call__(self, params, opt_state, batch: TrainBatch):
        if batch.size % self.micro_batch_size:
            raise ValueError(f"batch of {batch.size} rows is not a multiple of micro_batch_size="
                             f"{self.micro_batch_size}")
        if batch.size < self.probe_size:
            raise ValueError(f"probe_size={self.probe_size} exceeds the batch of {batch.size} rows")
        return self.jitted(params, opt_state)(params, opt_state, batch)

    def jitted(self, params, opt_state):
        """The jitted step for params/state laid out like these (arrays or ShapeDtypeStructs).

        Params and optimizer state are donated (the merge then updates weights in place) and come
        back with the shardings they came in with, so the next call — and the sampler, which reads
        the same params — reuse their compiled programs. ``jitted(...).lower(...)`` on abstract
        inputs gives the ahead-of-time memory analysis of one update.
        """
        if self._step is None:
            keep = jax.tree.map(lambda x: x.sharding, (params, opt_state))
            # Inside the jit params are tracers without shardings: fix the sketches' layout now.
            self._sketch_shardings = sketch_shardings(params, self.sketch) if self.sketch else {}
            extra = (None,) if self.return_updates else ()
            self._mesh = mesh_of(params)
            self._step = jax.jit(self._step_impl, donate_argnums=(0, 1),
                                 out_shardings=(keep[0], keep[1], None) + extra,
                                 compiler_options=update_compiler_options(params))
        return self._step

    def _step_impl(self, params, opt_state, batch: TrainBatch):
        """The step traced with the params' mesh in context: the model then splits its activations
        by batch over ``fsdp`` (``sharding.shard_batch``) instead of leaving the layout to XLA."""
        if self._mesh is None:
            return self._step_body(params, opt_state, batch)
        with jax.sharding.use_abstract_mesh(self._mesh.abstract_mesh):
            return self._step_body(params, opt_state, batch)

    # -- the objective on one micro-batch -------------------------------------------------------
    def _objective(self, params, probes, mb: TrainBatch):
        logp, entropy = self.policy.completion_logprobs(params, mb.seqs, probes=probes,
                                                        temperature=self.temperature)
        loss, metrics = self.loss(logp, mb)
        mask = mb.seqs.completion_mask
        maskf = mask.astype(jnp.float32)
        # Sampler-vs-trainer log-prob gap on completed responses: the controller's mismatch term
        # (a token either side gives probability 0 carries no finite gap and is left out).
        gap = jax.lax.stop_gradient(mb.rollout_logp - logp)
        done = maskf * mb.completed[:, None].astype(jnp.float32) * jnp.isfinite(gap)
        gap = jnp.where(done > 0, gap, 0.0)
        aux = dict(metrics, loss=loss,
                   entropy=jnp.sum(entropy * maskf) / jnp.maximum(jnp.sum(maskf), 1.0),
                   mismatch_sum=jnp.sum(gap * done), mismatch_count=jnp.sum(done))
        return loss, aux

    # -- the gradient, one mode at a time -------------------------------------------------------
    def _gradient(self, params, opt_state) -> _Gradient:
        """The gradient mode of this update: LoGRA's sketches when it has a SketchSpec, else a
        dense gradient of the adapters alone (LoRA, ``subtree``) or of every parameter."""
        if self.sketch is not None:
            return self._sketched_gradient(params, opt_state)
        if self.subtree is not None:
            return self._adapter_gradient(params)
        return self._dense_gradient(params)

    def _dense_gradient(self, params) -> _Gradient:
        """Dense (AdamW and the other optax optimizers): the gradient of every parameter."""
        def objective(wrt, mb):
            return self._objective(wrt["params"], None, mb)
        return _Gradient(wrt={"params": params}, objective=objective,
                         to_params=lambda mean: mean["params"])

    def _adapter_gradient(self, params) -> _Gradient:
        """LoRA: the adapters' gradient only (``params[subtree]``); the frozen base is closed over,
        never differentiated."""
        def objective(wrt, mb):
            return self._objective(dict(params, **{self.subtree: wrt["params"]}), None, mb)
        return _Gradient(wrt={"params": params[self.subtree]}, objective=objective,
                         to_params=lambda mean: mean["params"])

    def _sketched_gradient(self, params, opt_state) -> _Gradient:
        """LoGRA: the gradient of the probes' zero factors B (each one a target's sketch G·Aᵀ, laid
        out like its factor) and, unless frozen, of the non-targets; params-shaped, it holds the
        sketches at the targets and the dense (or zero, frozen) gradient elsewhere."""
        targets, others = split_targets(params, self.sketch)
        probes = make_probes(params, update_index(opt_state), self.sketch)
        probes = {path: dataclasses.replace(probe, factor=jax.lax.with_sharding_constraint(
                      probe.factor, self._sketch_shardings[path]))
                  if path in self._sketch_shardings else probe for path, probe in probes.items()}
        wrt = {"factors": probe_factors(probes)}
        if self.train_others:
            wrt["others"] = others

        def objective(wrt, mb):
            params_ = merge_targets(wrt.get("others", others), targets)
            return self._objective(params_, with_factors(probes, wrt["factors"]), mb)

        def to_params(mean):
            return merge_targets(mean.get("others", jax.tree.map(jnp.zeros_like, others)),
                                 mean["factors"])
        return _Gradient(wrt=wrt, objective=objective, to_params=to_params,
                         targets=targets, others=others, probes=probes)

    def _keep_sketch_layout(self, tree):
        """Accumulated sketches stay sharded like their factors (else XLA may gather them)."""
        if "factors" not in tree:
            return tree
        factors_ = {path: jax.lax.with_sharding_constraint(f, self._sketch_shardings[path])
                    if path in self._sketch_shardings else f for path, f in tree["factors"].items()}
        return dict(tree, factors=factors_)

    def _mean_gradient(self, gradient: _Gradient, micro: TrainBatch, n_micro: int):
        """(the mean over the micro-batches of ``gradient``'s gradient, in the tree of its ``wrt``;
        each micro-batch's objective aux, stacked): one scan, the sum held in ``wrt``'s shape."""
        grad_fn = jax.grad(gradient.objective, has_aux=True)

        def accumulate(total, mb):
            grads, aux = grad_fn(gradient.wrt, mb)
            return self._keep_sketch_layout(_tree_add(total, grads)), aux

        zeros = self._keep_sketch_layout(jax.tree.map(jnp.zeros_like, gradient.wrt))
        total, aux = jax.lax.scan(accumulate, zeros, micro)
        return jax.tree.map(lambda g: g / n_micro, total), aux

    def _kl_control(self, gradient: _Gradient, probe: TrainBatch, hidden_old, head_old, mismatch,
                    mismatch_count) -> dict:
        """``tx.update``'s KL-control inputs (LoGRA only): the predicted KL of a candidate update
        (one JVP through the probes), the candidate's KL from the old weights' hidden states, and
        this step's sampler-vs-trainer mismatch."""
        targets, others, probes = gradient.targets, gradient.others, gradient.probes

        def probe_logits(others_, factors_):
            p = merge_targets(others_, targets)
            return self.policy.completion_logits(p, probe.seqs, probes=with_factors(probes, factors_))

        def probe_hidden(others_, factors_):  # the model at W + U·A, through the probes
            p = merge_targets(others_, targets)
            return (self.policy.hidden(p, probe.seqs, with_update_factors(probes, factors_)),
                    self.policy.bind(p).head_kernel())
        mask, frozen = probe.seqs.completion_mask, not self.train_others
        return dict(
            predict_kl=make_predict_kl(probe_logits, others, gradient.wrt["factors"], mask,
                                       self.temperature, others_frozen=frozen),
            candidate_kl=make_candidate_kl(probe_hidden, others, gradient.wrt["factors"],
                                           hidden_old, head_old, mask, self.temperature,
                                           others_frozen=frozen),
            # NaN: no completed response this step, nothing observed (the EMA stays).
            mismatch=jnp.where(mismatch_count > 0, mismatch, jnp.nan))

    def _apply(self, params, opt_state, grads, extra: dict):
        """(params, opt_state, updates, changed): the optimizer's step applied; ``changed``: of the
        target entries, how many stored values changed (None for LoRA's adapters)."""
        if self.subtree is not None:
            trained = params[self.subtree]
            updates, opt_state = self.tx.update(grads, opt_state, trained, **extra)
            params = dict(params, **{self.subtree: optax.apply_updates(trained, updates)})
            return params, opt_state, updates, None
        updates, opt_state = self.tx.update(grads, opt_state, params, **extra)
        params, changed = apply_updates_counting_changes(params, updates)
        return params, opt_state, updates, changed

    # -- the jitted step --------------------------------------------------------------------------
    def _step_body(self, params, opt_state, batch: TrainBatch):
        n_micro = batch.size // self.micro_batch_size
        # Micro-batch k takes rows k, k + n_micro, k + 2·n_micro, ...: the batch is sharded in
        # contiguous blocks of rows, so every device holds its share of every micro-batch. (Taking
        # consecutive rows would put each micro-batch on one or two devices, and each device would
        # then run the whole micro-batch.)
        micro = jax.tree.map(
            lambda x: x.reshape((self.micro_batch_size, n_micro) + x.shape[1:]).swapaxes(0, 1), batch)
        probe = jax.tree.map(lambda x: x[:self.probe_size], batch)
        # k of this update's A (a factors sync regenerates A from it), read before the step.
        k = update_index(opt_state) if self.return_updates else None

        gradient = self._gradient(params, opt_state)
        mean_grads, aux = self._mean_gradient(gradient, micro, n_micro)
        grads = gradient.to_params(mean_grads)

        mismatch_count = jnp.sum(aux.pop("mismatch_count"))
        mismatch = jnp.sum(aux.pop("mismatch_sum")) / jnp.maximum(mismatch_count, 1.0)
        # Micro-batch metrics are averaged over the micro-batches; a maximum (``…/max``) is the max.
        metrics = {name: jnp.max(value) if name.endswith("/max") else jnp.mean(value)
                   for name, value in aux.items()}
        metrics["logra/mismatch_now"] = mismatch

        # The realized KL on the probe, from hidden states and heads: full-vocabulary logits exist
        # only a few positions at a time (exact_kl_from_hidden). Its old weights' pass runs after
        # the gradient: left free, a scheduler may run it first and hold its results (the head
        # transposed, in fp32) through the backward pass (XLA:GPU does so for Qwen2.5-1.5B on one
        # H200: 0.75 GiB more temporaries).
        params, grads = jax.lax.optimization_barrier((params, grads))
        hidden_old = self.policy.hidden(params, probe.seqs)
        head_old = self.policy.bind(params).head_kernel()
        # The old weights' pass over the probe runs before the optimizer writes any weight: left
        # free, a scheduler may place it after a merge and must then keep a copy of that weight
        # stack's old values (the TPU compiler does so for Qwen2.5-7B's down_proj: 1.77 GiB per chip).
        hidden_old, head_old, params = jax.lax.optimization_barrier((hidden_old, head_old, params))
        extra = (self._kl_control(gradient, probe, hidden_old, head_old, mismatch, mismatch_count)
                 if self.kl_control else {})
        # Named for profiles (logra_jax/perf/profiling.py): the optimizer's own time, merges included.
        with jax.named_scope("optimizer"):
            params, opt_state, updates, changed = self._apply(params, opt_state, grads, extra)
        if any(isinstance(u, LowRankUpdate) for _, u in leaves_with_paths(updates)):
            # Of the target entries, how many stored values this update changed: with bf16 weights
            # and round-to-nearest, what did not change is the part of the update that was lost.
            metrics["logra/changed_fraction"] = changed
        metrics["logra/realized_kl"] = exact_kl_from_hidden(
            hidden_old, head_old, self.policy.hidden(params, probe.seqs),
            self.policy.bind(params).head_kernel(), probe.seqs.completion_mask, self.temperature)
        metrics["grad_norm"] = optax.tree.norm(grads)
        if self.return_updates:
            low_rank = {path: u for path, u in leaves_with_paths(updates) if isinstance(u, LowRankUpdate)}
            return params, opt_state, metrics, CompactUpdate(low_rank, k)
        return params, opt_state, metrics
