"""GaLore (Zhao et al. 2024) on 2-D gradients, with a choice of how its projector is refreshed.

For a gradient G (m × n) GaLore keeps a projector P: r orthonormal columns spanning G's top-r
singular subspace on its longer side (P: m × r when m ≥ n, "left"; P: n × r otherwise, "right"),
refreshed from the current gradient every ``update_proj_gap`` steps. The base optimizer (Adam)
runs on the projection

    R = Pᵀ·G  (r × n, left)      or      R = G·P  (m × r, right)

and the update returns to full size as scale · P·Adam(R)  (or scale · Adam(R)·Pᵀ): Adam's moments
cost 2·r·max(m, n) numbers instead of 2·m·n. This is optax.contrib.galore's math for 2-D arrays,
its state included (tests check that the two agree); what it adds is the projector's refresh:

  svd         P = G's first r singular vectors (jnp.linalg.svd), as the paper and optax. XLA:CPU
              and GPUs call a LAPACK / cuSOLVER kernel; the TPU compiler has none and compiles
              jnp.linalg.svd as a JAX program (QDWH polar decomposition and spectral
              divide-and-conquer eigh) unrolled by the matrix's size: one 896 × 3584 SVD takes 104 s
              to compile on a 2-core host and a 3584 × 18944 one (a 7B MLP matrix) over 10 minutes.
  randomized  the same subspace by the randomized range finder with subspace iteration (Halko,
              Martinsson & Tropp 2011, Alg. 4.4 and 5.3), for G on its longer side (Gᵀ when right):

                  Ω: n × k standard normal, k = r + oversample, drawn from (seed, step)
                  Q = qr(G·Ω);   q times:  Q = qr(G·qr(Gᵀ·Q))
                  B = Qᵀ·G (k × n);   B·Bᵀ = W·Λ·Wᵀ (a k × k eigh);   P = Q·W[:, the r largest λ]

              Matmuls, a tall QR and a small eigh: seconds to compile on TPU. P's columns are G's
              top singular vectors up to a factor (σ_{k+1} / σ_r)^(2q+1) of the spectrum's decay;
              exact when G's rank is at most k.

Each refresh uses one Ω for every matrix of a step (over_layers maps layers with the same count);
Ω is independent of the gradients, which is all the range finder's bound asks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from optax.contrib import GaLoreState

PROJECTORS = ("svd", "randomized")
OVERSAMPLE = 8            # k = r + 8 test vectors: Halko et al.'s suggested 5–10
POWER_ITERATIONS = 2      # q: each sharpens the subspace by (σ_{k+1}/σ_r)² at 2 matmuls of G
_EXACT = jax.lax.Precision.HIGHEST   # a TPU runs f32 dots as bf16 passes by default


def fresh_projector(g: jax.Array, rank: int, how: str, key: jax.Array) -> jax.Array:
    """G's first ``rank`` singular vectors on its longer side (f32 G, m × n): left (m × rank) when
    m ≥ n, right (n × rank) otherwise. An SVD's vectors are defined up to sign; "svd" takes them
    from svd(G) on both sides, as optax does, so the two agree step for step."""
    left = g.shape[0] >= g.shape[1]
    if how == "svd":
        u, _, vh = jnp.linalg.svd(g, full_matrices=False)
        return u[:, :rank] if left else vh[:rank].T
    a = g if left else g.T
    k = min(rank + OVERSAMPLE, *a.shape)
    dot = lambda x, y: jnp.matmul(x, y, precision=_EXACT)
    q, _ = jnp.linalg.qr(dot(a, jax.random.normal(key, (a.shape[1], k), a.dtype)))
    for _ in range(POWER_ITERATIONS):   # re-orthonormalised each half-step: f32 would lose σ_r
        z, _ = jnp.linalg.qr(dot(a.T, q))
        q, _ = jnp.linalg.qr(dot(a, z))
    b = dot(q.T, a)
    _, w = jnp.linalg.eigh(dot(b, b.T))           # ascending eigenvalues σ²
    return dot(q, w[:, ::-1][:, :rank])


def scale_by_galore(rank: int = 128, update_proj_gap: int = 200, scale: float = 1.0,
                    base_optimizer: optax.GradientTransformation | None = None,
                    projector: str = "svd", seed: int = 0) -> optax.GradientTransformation:
    """GaLore's projection around ``base_optimizer`` (default scale_by_adam) for 2-D leaves;
    other leaves get the base optimizer unprojected. State: optax's GaLoreState."""
    if projector not in PROJECTORS:
        raise ValueError(f"GaLore projector must be one of {', '.join(PROJECTORS)}, got {projector!r}")
    if not isinstance(rank, int) or rank <= 0:
        raise ValueError(f"GaLore rank must be a positive int, got {rank!r}")
    base_optimizer = base_optimizer or optax.scale_by_adam()

    def shapes(p):
        """(projector, projected gradient) shapes of a leaf: (0, 0) and p's for a non-matrix."""
        if p.ndim != 2:
            return (0, 0), p.shape
        m, n = p.shape
        r = min(rank, m, n)
        return ((m, r), (r, n)) if m >= n else ((n, r), (m, r))

    def init_fn(params):
        return GaLoreState(
            count=jnp.zeros([], jnp.int32),
            base_optimizer_state=base_optimizer.init(
                jax.tree.map(lambda p: jnp.zeros(shapes(p)[1], p.dtype), params)),
            projector=jax.tree.map(lambda p: jnp.zeros(shapes(p)[0], p.dtype), params))

    def update_fn(updates, state, params=None):
        del params
        refresh = state.count % update_proj_gap == 0
        key = jax.random.fold_in(jax.random.PRNGKey(seed), state.count)

        def project(g, p):
            if g.ndim != 2:
                return g, p
            left = g.shape[0] >= g.shape[1]

            def fresh():
                return fresh_projector(g.astype(jnp.float32), p.shape[1], projector,
                                       key).astype(p.dtype)

            p = jax.lax.cond(refresh, fresh, lambda: p)
            return (p.T @ g if left else g @ p), p

        def back(u, p, g):
            if g.ndim != 2:
                return u
            full = p @ u if g.shape[0] >= g.shape[1] else u @ p.T
            return (scale * full).astype(g.dtype)

        projected = jax.tree.map(project, updates, state.projector)
        outer, pair = jax.tree.structure(updates), jax.tree.structure((0, 0))
        low_rank, projectors = jax.tree.transpose(outer, pair, projected)
        low_rank, base_state = base_optimizer.update(low_rank, state.base_optimizer_state, None)
        return (jax.tree.map(back, low_rank, projectors, updates),
                GaLoreState(count=optax.safe_int32_increment(state.count),
                            base_optimizer_state=base_state, projector=projectors))

    return optax.GradientTransformation(init_fn, update_fn)


def galore(learning_rate: optax.ScalarOrSchedule, rank: int = 128, update_proj_gap: int = 200,
           scale: float = 1.0, base_optimizer: optax.GradientTransformation | None = None,
           weight_decay: float = 0.0, projector: str = "svd", seed: int = 0
           ) -> optax.GradientTransformation:
    """GaLore with decoupled weight decay in the full space and the learning rate, as
    optax.contrib.galore chains them."""
    return optax.chain(scale_by_galore(rank, update_proj_gap, scale, base_optimizer, projector, seed),
                       optax.add_decayed_weights(weight_decay),
                       optax.scale_by_learning_rate(learning_rate))
