"""Policy synchronisation, trainer → rollout engine (docs/algorithm.md §8).

The rollout engine holds the sampler's weights in the sampler dtype (bf16), placed with the rollout
mesh's shardings: on the trainer's own mesh (colocated) or on a disjoint set of devices (e.g. 4 of
the 8 train, 4 roll out). After every update the trainer turns its new weights into one
`SyncMessage`; the transfer is ``jax.device_put`` of that message onto the rollout shardings — the
wire — and its bytes are what the sync reports. Three modes:

- ``full``: every trainable leaf, cast to the sampler dtype (the baseline).
- ``factors``: per target the factor U_l (out × r, exactly the U the trainer merged: bf16 in the KL
  variant, fp32 in the GRPO variant), its weight_scale and the update index k; trainable non-target
  leaves go in full. The receiver regenerates A_l(k) from the shared seed scheme (``SketchSpec.keys``,
  projections.py) and runs the trainer's own merge, ``LowRankUpdate.merge_into``:

      W ← ws·W + U·A        (fp32, one stacked layer at a time, then cast to W's dtype)

  * ``master_copy=True``: it merges into a copy of the targets in the trainer's dtype (fp32) — the
    same values the trainer merges into — and casts that to bf16, so the sampler's weights are
    bit-identical to the trainer's cast to bf16. Costs 4 bytes per target weight on the rollout devices.
  * ``master_copy=False``: it merges into its bf16 weights. A change smaller than half a bf16 ulp
    (≈ 2⁻⁹ relative) is rounded away each step while the trainer's fp32 copy keeps it, so the sampler
    drifts; `weight_drift` and `RolloutEngine.mismatch` measure by how much.
- ``sparse``: per trainable leaf, the entries whose bf16 bits changed, each leaf in the cheapest of
  three encodings (sync_sparse.py): int32 indices + values when few changed, a bitmap + values when
  many did, the whole leaf when nearly all did — exact, and never more bytes than ``full``. The
  sender diffs against a bf16 mirror of what the receiver holds (2 bytes per trainable weight on
  the trainer's devices).

Exactness of ``factors`` holds by construction, on any backend, CPU or GPU kind and pair of meshes:
both sides regenerate the same A (threefry bits: integer arithmetic), and the product U·A is
`order_free_matmul` (optim/order_free.py), whose dots are exact, so no summation order, blocking or
kernel choice of either side's per-device program can change a bit; what remains (ws·W + ΔW, the
casts) is elementwise and written down once, in ``LowRankUpdate.merge_into``. The sender checks that
the trainer's A keys are the ones the receiver will regenerate; tests/test_sync.py checks the
weights bit for bit against the trainer's jitted step (fsdp 4) on receiver meshes (4, 1), (2, 2)
and (1, 4).

Placement. ``rollout_devices = 0`` (colocated) puts the engine on the trainer's devices, where the
trainer's own weights already are: a master copy (factors) or a bf16 mirror (sparse) would only
duplicate them. `placed_mode` therefore runs every colocated sync as ``full`` — a local cast of the
trainer's new weights, exact and with no second copy besides the sampler's bf16 weights. The engine
owns every buffer it holds (``device_put(..., may_alias=False)``): the trainer's update donates its
params, and a shared buffer would be deleted under the sampler.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from logra_jax.config.derived import placed_sync_mode
from logra_jax import sharding as sharding_lib
from logra_jax.optim.low_rank import LowRankUpdate
from logra_jax.optim.targets import SketchSpec
from logra_jax.sharding import sharding_without_in_dim
from logra_jax.tree_paths import leaves_with_paths
from logra_jax.rl import sync_sparse
from logra_jax.rl.policy import Policy, Sequences
from logra_jax.rl.sync_bytes import trainable_paths

MODES: tuple[str, ...] = ("full", "factors", "sparse")


def _check_mode(mode: str, sketch: SketchSpec | None) -> None:
    if mode not in MODES:
        raise ValueError(f"sync mode must be one of {MODES}, got {mode!r}")
    if mode == "factors" and sketch is None:
        raise ValueError("sync mode 'factors' needs the LoGRA optimizer (a SketchSpec): a dense "
                         "optimizer has no low-rank factors to send; use 'full' or 'sparse'")


def _select(params, paths) -> dict[str, jax.Array]:
    flat = dict(leaves_with_paths(params))
    return {path: flat[path] for path in paths}


@functools.partial(jax.jit, static_argnames="dtype")
def _cast_leaves(leaves: dict[str, jax.Array], dtype) -> dict[str, jax.Array]:
    return {path: x.astype(dtype) for path, x in leaves.items()}


@functools.lru_cache(maxsize=None)
def _logprob_fn(policy: Policy, temperature: float):
    """One jitted log-prob function per (policy, temperature), shared by every engine."""
    return jax.jit(lambda params, seqs: policy.completion_logprobs(params, seqs,
                                                                   temperature=temperature)[0])


def _replicated_like(leaf: jax.Array):
    """A replicated placement on the devices ``leaf`` lives on (its mesh, or its single device)."""
    sharding = leaf.sharding
    if isinstance(sharding, NamedSharding):
        return NamedSharding(sharding.mesh, PartitionSpec())
    return sharding


# ---------------------------------------------------------------------------------------------
# Placement
# ---------------------------------------------------------------------------------------------
def placed_mode(mode: str, colocated: bool) -> str:
    """The sync a placement runs: colocated, ``factors`` and ``sparse`` become ``full`` (a local cast).

    Colocated, nothing crosses a wire, and the encodings would only cost memory on the trainer's
    devices: a fp32 master copy of the targets (factors) or a bf16 mirror of the weights (sparse).
    """
    return placed_sync_mode(mode, colocated)   # the config checks need the rule before jax


def split_devices(rollout_devices: int, devices=None) -> tuple[list, list]:
    """(training devices, rollout devices).

    ``rollout_devices = 0`` colocates: both get all devices. ``n > 0`` gives the last n devices to
    the rollout engine and the rest to the trainer (4 + 4 of 8, as the reference's 8-GPU runs).
    """
    devices = list(jax.devices() if devices is None else devices)
    if rollout_devices == 0:
        return devices, devices
    if not 0 < rollout_devices < len(devices):
        raise ValueError(f"rollout_devices={rollout_devices}: must be 0 (colocated) or between 1 and "
                         f"{len(devices) - 1}, leaving the trainer at least one of the "
                         f"{len(devices)} devices")
    return devices[:-rollout_devices], devices[-rollout_devices:]


def rollout_shardings(model: nnx.Module, mesh: Mesh, rules=None) -> dict:
    """Params-shaped NamedShardings on ``mesh`` from the model's logical axes (a pure dict)."""
    return nnx.to_pure_dict(sharding_lib.param_shardings(model, mesh, rules))


# ---------------------------------------------------------------------------------------------
# The message and its sender (trainer side)
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class SyncMessage:
    """One sync on the wire.

    payload: a pytree of arrays, the only thing transferred — the parts of its mode among
      ``dense`` {path: new value, sampler dtype}; ``factors`` {path: U}; ``weight_scale``
      {path: fp32 scalar}; ``update_index`` int32 k; sparse patches ``indices`` or ``bitmaps``
      {path: where}, with ``values`` {path: changed values}. The part a leaf is in names its
      encoding (`encodings`).
    sequence: the sender's count of messages before this one. ``factors`` and ``sparse`` messages
      are deltas: a receiver must apply every one of them, in order, and checks this number.
    num_changed: sparse only, {path: changed entries} (patches are padded to a bucket size).
    rounding: factors only, how a bf16 target receives the merge (``LowRankUpdate.rounding``; the
      stochastic bits come from A's key, so nothing more is sent).
    """

    mode: str
    payload: dict[str, Any]
    sequence: int
    num_changed: dict[str, int] = dataclasses.field(default_factory=dict)
    rounding: str = "nearest"

    @property
    def encodings(self) -> dict[str, str]:
        """{path: "dense" | "indices" | "bitmap"} of every leaf the message carries."""
        parts = {"dense": "dense", "indices": "indices", "bitmaps": "bitmap"}
        return {path: name for part, name in parts.items() for path in self.payload.get(part, {})}

    @property
    def nbytes(self) -> int:
        """Bytes of every array in the payload: what crosses to the rollout devices."""
        return int(sum(x.nbytes for x in jax.tree.leaves(self.payload)))


class SyncSender:
    """Trainer side: builds the `SyncMessage` of each sync from the trainer's new params.

    Args:
      mode: "full" | "factors" | "sparse".
      params: the trainer's params (paths and shapes; the sparse mirror starts as their bf16 cast,
        which is what a freshly built `RolloutEngine` holds).
      sketch: the SketchSpec the LoGRA optimizer was built with; None for a dense optimizer.
      train_others: False when non-target params are frozen (KL variant): they are never sent.
      dtype: the sampler's weight dtype.
    """

    def __init__(self, mode: str, params, *, sketch: SketchSpec | None, train_others: bool = True,
                 dtype=jnp.bfloat16):
        _check_mode(mode, sketch)
        self.mode = mode
        self.sketch = sketch
        self.dtype = jnp.dtype(dtype)
        self.trainable = trainable_paths(params, sketch, train_others)
        self.targets = sketch.find_targets(params) if sketch is not None else {}
        shapes = {path: leaf.shape for path, leaf in leaves_with_paths(params)}
        # What `full` sends, reported every sync as the baseline.
        self.full_bytes = int(sum(np.prod(shapes[p]) for p in self.trainable)) * self.dtype.itemsize
        self.dense_paths = ([p for p in self.trainable if p not in self.targets]
                            if mode == "factors" else list(self.trainable))
        self._sequence = 0
        self._rounding = "nearest"  # of the last factors message
        if mode == "sparse":
            for path in self.trainable:
                sync_sparse.check_indexable(path, int(np.prod(shapes[path])))
            self._mirror = _cast_leaves(_select(params, self.trainable), self.dtype)
        if mode == "factors":
            targets = self.targets
            self._keys = jax.jit(lambda k: {p: sketch.keys(info, k) for p, info in targets.items()})

    def message(self, params, *, updates=None, update_index=None) -> SyncMessage:
        """The message that brings the receiver from the last sync to ``params``.

        ``updates`` (factors only): the targets' LowRankUpdates of this step — a {path:
        LowRankUpdate} dict as ``PolicyUpdate(return_updates=True)`` returns, or a whole updates
        tree. ``update_index``: the k of this update, i.e. ``int(update_index(opt_state))`` read
        before the step (which donates opt_state).
        """
        if self.mode == "full":
            payload = {"dense": self._dense(params)}
        elif self.mode == "factors":
            payload = self._factors_payload(params, updates, update_index)
        else:
            payload, num_changed = self._sparse_payload(params)
        message = SyncMessage(self.mode, payload, self._sequence,
                              num_changed if self.mode == "sparse" else {},
                              rounding=self._rounding if self.mode == "factors" else "nearest")
        self._sequence += 1
        return message

    def _dense(self, params) -> dict[str, jax.Array]:
        """The leaves sent whole, cast to the sampler dtype (on the trainer's devices)."""
        return _cast_leaves(_select(params, self.dense_paths), self.dtype)

    def _factors_payload(self, params, updates, update_index) -> dict[str, Any]:
        if updates is None or update_index is None:
            raise ValueError("sync mode 'factors' needs this step's target updates and its update "
                             "index: message(params, updates=..., update_index=...) with the updates "
                             "from PolicyUpdate(return_updates=True)")
        low_rank = {p: u for p, u in leaves_with_paths(updates) if isinstance(u, LowRankUpdate)}
        missing, extra = set(self.targets) - set(low_rank), set(low_rank) - set(self.targets)
        if missing or extra:
            raise ValueError(f"factors sync: the updates hold LowRankUpdates for {sorted(low_rank)}, "
                             f"the targets are {sorted(self.targets)} (missing {sorted(missing)}, "
                             f"unexpected {sorted(extra)})")
        k = jnp.asarray(update_index, jnp.int32)
        expected = jax.device_get(self._keys(k))
        for path, u in low_rank.items():
            info = self.targets[path]
            if tuple(u.factor.shape) != info.sketch_shape:
                raise ValueError(f"factors sync: U of {path!r} has shape {tuple(u.factor.shape)}, "
                                 f"expected {info.sketch_shape}")
            if u.distribution != self.sketch.distribution or not np.array_equal(
                    np.asarray(jax.device_get(u.key)), expected[path]):
                raise ValueError(
                    f"factors sync: the update of {path!r} used a projection A that update index "
                    f"{int(k)} with seed {self.sketch.seed}/{self.sketch.distribution} does not "
                    f"regenerate (wrong update_index, or a SketchSpec unlike the optimizer's); the "
                    f"receiver would apply a different A")
        payload = {
            "dense": self._dense(params),
            "factors": {p: u.factor for p, u in low_rank.items()},
            "weight_scale": {p: jnp.asarray(u.weight_scale, jnp.float32) for p, u in low_rank.items()},
            "update_index": k,
        }
        self._rounding = next(iter(low_rank.values())).rounding if low_rank else "nearest"
        return payload

    def _sparse_payload(self, params) -> tuple[dict[str, Any], dict[str, int]]:
        """Each changed leaf in its cheapest encoding (`sync_sparse.choose_encoding`)."""
        new = _cast_leaves(_select(params, self.trainable), self.dtype)
        counts = jax.device_get(sync_sparse.count_changes(new, self._mirror))
        dense, indices, bitmaps, values, num_changed = {}, {}, {}, {}, {}
        for path in self.trainable:
            count, size = int(counts[path]), new[path].size
            num_changed[path] = count
            encoding, _ = sync_sparse.choose_encoding(count, size, self.dtype.itemsize)
            slots = sync_sparse.capacity(count, size)
            if encoding == "dense":
                dense[path] = new[path]
            elif encoding == "indices":
                indices[path], values[path] = sync_sparse.encode(
                    new[path], self._mirror[path], capacity=slots)
            elif encoding == "bitmap":
                bitmaps[path], values[path] = sync_sparse.encode_bitmap(
                    new[path], self._mirror[path], capacity=slots)
        self._mirror = new  # what the receiver holds once this message is applied
        return {"dense": dense, "indices": indices, "bitmaps": bitmaps, "values": values}, num_changed


# ---------------------------------------------------------------------------------------------
# The rollout engine (receiver side)
# ---------------------------------------------------------------------------------------------
class RolloutEngine:
    """The sampler's weights, kept in step with the trainer's by `SyncMessage`s.

    Args:
      policy: the model graph (for `mismatch`); sample with any `Sampler` of it and ``.params``.
      params: the trainer's params at the start. They are cast to ``dtype`` and copied onto the
        rollout shardings once (a setup cost, not a sync).
      shardings: params-shaped NamedShardings on the rollout mesh (`rollout_shardings`).
      mode, sketch, train_others: as the sender's.
      master_copy: factors only: keep the targets in the trainer's dtype on the rollout devices so
        the merge is exact (see the module docstring); False measures the drift without it.
      dtype: the sampler's weight dtype.
      temperature: of the log-probs `mismatch` compares (the trainer's).
    """

    def __init__(self, policy: Policy, params, shardings, *, mode: str,
                 sketch: SketchSpec | None = None, train_others: bool = True,
                 master_copy: bool = True, dtype=jnp.bfloat16, temperature: float = 1.0):
        _check_mode(mode, sketch)
        self.policy = policy
        self.mode = mode
        self.sketch = sketch
        self.dtype = jnp.dtype(dtype)
        self.master_copy = master_copy and mode == "factors"
        flat_params = dict(leaves_with_paths(params))
        self._shardings = dict(leaves_with_paths(shardings))
        if set(self._shardings) != set(flat_params):
            raise ValueError(f"rollout shardings and params name different leaves: "
                             f"{sorted(set(self._shardings) ^ set(flat_params))}")
        meshes = {s.mesh for s in self._shardings.values() if isinstance(s, NamedSharding)}
        if len(meshes) != 1 or not all(isinstance(s, NamedSharding) for s in self._shardings.values()):
            raise ValueError("rollout shardings must all be NamedShardings of one mesh (the rollout "
                             "mesh); build them with rollout_shardings(model, mesh)")
        self.mesh = meshes.pop()
        self._replicated = NamedSharding(self.mesh, PartitionSpec())
        self._treedef = jax.tree_util.tree_structure(params)
        self._paths = list(flat_params)
        self.trainable = trainable_paths(params, sketch, train_others)
        self.targets = sketch.find_targets(params) if sketch is not None else {}

        # Own copies (may_alias=False): on the trainer's devices, device_put of a leaf already in
        # place would return the trainer's buffer, which its next update donates.
        self._leaves = jax.device_put(_cast_leaves(flat_params, self.dtype), self._shardings,
                                      may_alias=False)
        self._master = None
        if self.master_copy:
            self._master = jax.device_put({p: flat_params[p] for p in self.targets},
                                          {p: self._shardings[p] for p in self.targets},
                                          may_alias=False)
        self._factor_shardings = {p: sharding_without_in_dim(self._leaves[p], keep_last=True)
                                  for p in self.targets}
        self._patchers: dict[tuple[str, Any], Any] = {}
        self._received = 0  # messages applied so far
        target_shardings = {p: self._shardings[p] for p in self.targets}
        if mode == "factors":
            if self.master_copy:
                self._merge = jax.jit(self._merge_exact_impl, donate_argnums=(0, 1),
                                      static_argnames="rounding",
                                      out_shardings=(target_shardings, target_shardings))
            else:
                self._merge = jax.jit(self._merge_impl, donate_argnums=0, static_argnames="rounding",
                                      out_shardings=target_shardings)
        self._logprobs = _logprob_fn(policy, float(temperature))

    @property
    def master(self) -> dict[str, jax.Array] | None:
        """{target path: weight in the trainer's dtype} with ``master_copy``, else None."""
        return None if self._master is None else dict(self._master)

    @property
    def params(self) -> dict:
        """The sampler's weights as the nested params dict the policy binds (rollout mesh, dtype)."""
        return jax.tree_util.tree_unflatten(self._treedef, [self._leaves[p] for p in self._paths])

    # -- receiving ----------------------------------------------------------------------------
    def receive(self, message: SyncMessage) -> None:
        """Transfers ``message`` onto the rollout devices and applies it."""
        if message.mode != self.mode:
            raise ValueError(f"a {message.mode!r} sync message sent to a rollout engine in mode "
                             f"{self.mode!r}")
        if self.mode != "full" and message.sequence != self._received:
            raise ValueError(f"{self.mode} sync message number {message.sequence} arrived, but "
                             f"{self._received} messages were applied so far: '{self.mode}' sends "
                             f"changes, so every message must arrive, in order; rebuild the sender "
                             f"and the rollout engine from the trainer's params to resynchronise")
        # A copy even where the payload already sits on these devices (a colocated engine): dense
        # leaves sent in the trainer's dtype are the trainer's own buffers.
        payload = jax.device_put(message.payload, self._wire_shardings(message.payload),
                                 may_alias=False)
        for path, value in payload.get("dense", {}).items():
            self._check_leaf(path, value.shape, value.dtype)
            self._leaves[path] = value
        if self.mode == "factors":
            self._apply_factors(payload, message.rounding)
        elif self.mode == "sparse":
            for part, apply in (("indices", sync_sparse.apply_patch),
                                ("bitmaps", sync_sparse.apply_bitmap)):
                for path, where in payload.get(part, {}).items():
                    self._check_leaf(path, None, payload["values"][path].dtype)
                    self._leaves[path] = self._patcher(path, apply)(self._leaves[path], where,
                                                                    payload["values"][path])
        self._received += 1

    def _wire_shardings(self, payload) -> dict:
        """Where each part of a payload lands: dense values and U sharded like the weights they
        update; scalars and sparse patches replicated over the rollout mesh."""
        placement = {"dense": lambda p: self._shardings[p],
                     "factors": lambda p: self._factor_shardings[p]}
        out = {}
        for part, value in payload.items():
            where = placement.get(part, lambda p: self._replicated)
            out[part] = ({p: where(p) for p in value} if isinstance(value, dict) else self._replicated)
        return out

    def _check_leaf(self, path, shape, dtype):
        if path not in self.trainable:
            raise ValueError(f"sync message updates {path!r}, which is not a trainable leaf of this "
                             f"rollout engine")
        leaf = self._leaves[path]
        if (shape is not None and tuple(shape) != leaf.shape) or dtype != leaf.dtype:
            raise ValueError(f"sync message for {path!r}: {tuple(shape) if shape else ''} {dtype} "
                             f"does not fit the sampler's {leaf.shape} {leaf.dtype}")

    def _apply_factors(self, payload, rounding: str) -> None:
        factors = payload["factors"]
        if set(factors) != set(self.targets):
            raise ValueError(f"factors sync message covers {sorted(factors)}, the targets are "
                             f"{sorted(self.targets)}")
        for path, u in factors.items():
            if tuple(u.shape) != self.targets[path].sketch_shape:
                raise ValueError(f"factors sync message: U of {path!r} has shape {tuple(u.shape)}, "
                                 f"expected {self.targets[path].sketch_shape}")
        args = (factors, payload["weight_scale"], payload["update_index"])
        old = {p: self._leaves.pop(p) for p in self.targets}
        if self.master_copy:
            self._master, new = self._merge(self._master, old, *args, rounding=rounding)
        else:
            new = self._merge(old, *args, rounding=rounding)
        self._leaves.update(new)

    def _merge_impl(self, weights, factors, weight_scales, update_index, rounding="nearest"):
        """The trainer's merge per target: W ← ws·W + U·A(k), in fp32, rounded back to W's dtype
        as the trainer rounds it (``rounding``)."""
        out = {}
        for path, w in weights.items():
            update = LowRankUpdate(factor=factors[path],
                                   key=self.sketch.keys(self.targets[path], update_index),
                                   weight_scale=weight_scales[path],
                                   distribution=self.sketch.distribution, rounding=rounding)
            out[path] = update.merge_into(w)
        return out

    def _merge_exact_impl(self, master, old_weights, factors, weight_scales, update_index,
                          rounding="nearest"):
        del old_weights  # donated: their buffers hold the new bf16 weights
        master = self._merge_impl(master, factors, weight_scales, update_index, rounding)
        return master, {p: w.astype(self.dtype) for p, w in master.items()}

    def _patcher(self, path, apply):
        if (path, apply) not in self._patchers:
            self._patchers[path, apply] = jax.jit(apply, donate_argnums=0,
                                                  out_shardings=self._shardings[path])
        return self._patchers[path, apply]

    # -- measuring ----------------------------------------------------------------------------
    def mismatch(self, trainer_params, seqs: Sequences) -> float:
        """mean |log π_sampler − log π_trainer| over the completion tokens of ``seqs``.

        Both log-probs are the same full forward pass (no KV cache) at the engine's temperature,
        so the gap is the weights' alone: bf16 rounding plus any drift of the sync.
        """
        trainer_leaf = jax.tree.leaves(trainer_params)[0]
        logp_trainer = self._logprobs(trainer_params, jax.device_put(seqs, _replicated_like(trainer_leaf)))
        logp_sampler = self._logprobs(self.params, jax.device_put(seqs, self._replicated))
        mask = np.asarray(jax.device_get(seqs.completion_mask), bool)
        gap = np.abs(np.asarray(jax.device_get(logp_sampler), np.float64)
                     - np.asarray(jax.device_get(logp_trainer), np.float64))
        return float(gap[mask].mean()) if mask.any() else 0.0


def sync_step(sender: SyncSender, engine: RolloutEngine, params, *, updates=None,
              update_index=None, probe: Sequences | None = None) -> dict[str, float]:
    """One sync after an update: message → wire → apply. Returns the step's sync metrics.

    logra/sync_bytes: bytes sent; logra/sync_bytes_full: what ``full`` would have sent;
    logra/sync_mismatch (with ``probe``): `RolloutEngine.mismatch` on the probe sequences.
    """
    message = sender.message(params, updates=updates, update_index=update_index)
    engine.receive(message)
    metrics = {"logra/sync_bytes": float(message.nbytes),
               "logra/sync_bytes_full": float(sender.full_bytes)}
    if probe is not None:
        metrics["logra/sync_mismatch"] = engine.mismatch(params, probe)
    return metrics


def weight_drift(sampler_params, trainer_params, paths=None, dtype=jnp.bfloat16) -> dict[str, float]:
    """How far the sampler's weights are from the trainer's cast to the sampler dtype.

    Over ``paths`` (default: all leaves): max |ΔW|, the fraction and number of entries whose bits
    differ. Pulls both copies to the host: a diagnostic for tests and benchmarks, not a per-step metric.
    """
    sampler = dict(leaves_with_paths(sampler_params))
    trainer = dict(leaves_with_paths(trainer_params))
    paths = list(sampler) if paths is None else list(paths)
    max_abs, differing, entries = 0.0, 0, 0
    for path in paths:
        s = np.asarray(jax.device_get(sampler[path]))
        t = np.asarray(jax.device_get(jnp.asarray(trainer[path]).astype(dtype)))
        if s.dtype != t.dtype:
            raise ValueError(f"weight_drift: sampler leaf {path!r} is {s.dtype}, expected {t.dtype}")
        bits = {2: np.uint16, 4: np.uint32}[s.dtype.itemsize]
        differing += int(np.sum(s.view(bits) != t.view(bits)))
        entries += s.size
        if s.size:
            max_abs = max(max_abs, float(np.max(np.abs(s.astype(np.float64) - t.astype(np.float64)))))
    return {"max_abs": max_abs, "frac_differing": differing / max(entries, 1),
            "num_differing": float(differing), "entries": float(entries)}
