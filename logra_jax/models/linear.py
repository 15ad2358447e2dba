"""The one linear layer every attention and MLP projection uses, with the LoGRA sketch probe.

Without a probe it is y = x·W (Flax layout: ``kernel`` = Wᵀ, shape (in, out)). With a probe
(docs/algorithm.md §3) it computes

    y = x·kernel + (x·Aᵀ)·Bᵀ,      B = probe.factor = 0 (out × r)

so the forward value is unchanged and ∂L/∂B = Hᵀ(X·Aᵀ) = G·Aᵀ = S exactly. The dense weight
gradient is never formed because LoGRA's loss differentiates (non-target params, B) and closes
over the target kernels — not because of a stop_gradient here: one would make the layer scan save
a second copy of every stacked kernel as a backward residual when remat is off (measured: 80.7 vs
26.2 MiB at width 1024 with and without it). Backward keeps X·Aᵀ (tokens × r), not X (tokens × in).

When the probe promises B = 0 (``factor_is_zero``, every probe ``make_probes`` builds) the layer
goes through ``sketched_matmul``, which drops what is zero at B = 0 and keeps B's derivative.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.custom_derivatives import SymbolicZero

from logra_jax.projections import SketchProbe


def cpu_layout(x):
    """``jax.lax.optimization_barrier(x)`` where the program is compiled for XLA:CPU, x elsewhere.

    The barriers below keep operands in the layouts XLA:CPU's kernels run fastest. The TPU compiler
    needs no such help and pays for it: one sketched projection of Qwen2.5-7B's shape (2048 tokens,
    3584 → 18944, r = 256, bf16), forward and backward, compiled for a v5p chip reads 175.5 MiB and
    holds 9.3 MiB of temporaries with the barriers, 157.0 and 1.0 MiB without, at the same FLOPs
    (docs/results/step_time.md). ``platform_dependent`` picks by the platform the program is
    lowered for (not the process's default backend), so a deviceless TPU compile on a CPU host
    gets the TPU form.
    """
    return jax.lax.platform_dependent(x, cpu=jax.lax.optimization_barrier, default=lambda x: x)


def times_factor_t(xa: jax.Array, factor: jax.Array) -> jax.Array:
    """(x·Aᵀ)·Bᵀ, written so that reverse mode forms ∂L/∂B = Hᵀ(x·Aᵀ) as ((x·Aᵀ)ᵀH)ᵀ.

    The optimization barrier (XLA:CPU only, `cpu_layout`) keeps Bᵀ (r × out) a value of its own.
    Transposing this product, the
    backward pass then computes (x·Aᵀ)ᵀH, r × out, and transposes that small result. Without
    the barrier, XLA folds the transpose into the product and writes Hᵀ(x·Aᵀ), out × r, directly.
    XLA:CPU runs that form 1.2–1.4× slower at r = 256 and up to 3× slower at r = 32 (2048 tokens,
    out = 256–6144; docs/results/step_time.md). The value is the same product either way, to rounding.
    """
    return xa @ cpu_layout(factor.T)


def sketch_tangent(xa: jax.Array, dfactor: jax.Array) -> jax.Array:
    """(x·Aᵀ)·dBᵀ, the B-term of the tangent at B = 0, laid out for the sketch its transpose forms.

    Reverse mode turns this term into the sketch ∂L/∂B = ((x·Aᵀ)ᵀH)ᵀ. Here x·Aᵀ (T × r) is
    stored transposed, r × T, behind optimization barriers (XLA:CPU only), so that product reads (x·Aᵀ)ᵀ as it
    lies in memory: a canonical product (the left operand contracted over its last dim, the right
    over its first), which XLA:CPU hands to YNNPACK, while any other layout of it runs as an
    Eigen dot, 2.7× slower over a whole update at width 2048, r = 256 (docs/results/step_time.md). As
    in ``times_factor_t`` the barrier on dBᵀ keeps the result r × out, transposed after. The
    transposed copy costs T·r reads and writes, small beside the product's T·r·out operations.
    Forward mode (the predicted-KL JVP, once per update) reads the copy transposed back.
    """
    xa_t = cpu_layout(cpu_layout(xa).T)   # (r, T)
    return xa_t.T @ cpu_layout(dfactor.T)


# Variable metadata of a kernel stored transposed, (out, in), for decoding: see `weights_major`.
WEIGHTS_MAJOR = "weights_major"


def weights_major(kernel: nnx.Variable) -> nnx.Variable:
    """The same kernel stored (out, in) and tagged, so that `Linear` multiplies it weights-major
    (`weights_major_matmul`). A decode loop makes these once per generate call
    (`Decoder.unstacked_layers`); the tag travels in the Variable's metadata."""
    stored = kernel.replace(kernel[...].T)
    stored.set_metadata(**{WEIGHTS_MAJOR: True})
    return stored


def weights_major_product(weights: jax.Array, x: jax.Array, **dot_kwargs) -> jax.Array:
    """weights·xᵀ (out, rows) for weights (out, in) and x (rows, in): the weights as the left
    operand, contracted over their last, contiguous dim.

    Why: for a few rows XLA:CPU multiplies a matrix read this way much faster than x·weightsᵀ,
    the form XLA's algebraic simplifier prefers (it swaps the operands of a transposed product).
    A 30-layer chain of SmolLM2's seven projections at 16 rows: 31.7 vs 52.2 ms; the tied head
    (49 152 × 576) at 16 rows: 9.7 vs 16.5 ms (docs/results/sampler.md). The optimization barrier
    (XLA:CPU only, `cpu_layout`) keeps the product in this form.
    """
    return cpu_layout(jnp.matmul(weights, x.T, **dot_kwargs))


def weights_major_matmul(x: jax.Array, kernel_t: jax.Array) -> jax.Array:
    """x·kernel (rows, out) from kernelᵀ (out, in), as (kernelᵀ·xᵀ)ᵀ: `weights_major_product`."""
    return weights_major_product(kernel_t, x).T


@jax.custom_jvp
def sketched_matmul(x: jax.Array, kernel: jax.Array, a: jax.Array, factor: jax.Array) -> jax.Array:
    """x·kernel + (x·Aᵀ)·Bᵀ at B = ``factor`` = 0, without computing what is zero there.

    At B = 0 the value is x·kernel, and of the branch's derivative only the B term survives:

        dy = dx·kernel + x·dkernel + (x·Aᵀ)·dBᵀ        [(dx·Aᵀ)·Bᵀ = 0, (x·dAᵀ)·Bᵀ = 0]

    Reverse mode transposes this: ∂L/∂B = Hᵀ(x·Aᵀ) (the sketch), ∂L/∂x = H·kernelᵀ. The general
    form would also run (x·Aᵀ)·Bᵀ in the forward (twice with remat) and (H·B)·A in the backward,
    all multiplications by zero. Forward mode (the predicted-KL JVP in direction dB = U) gets the
    exact first-order change of the logits under ΔW = U·A. Terms of inputs that are not being
    differentiated (the closed-over kernel, A) arrive as symbolic zeros and cost nothing.
    """
    del a, factor  # B = 0: the branch adds nothing to the value.
    return x @ kernel


def _sketched_matmul_jvp(primals, tangents):
    x, kernel, a, factor = primals
    dx, dkernel, _, dfactor = tangents  # dA only meets B = 0
    y = x @ kernel
    terms = []
    if not isinstance(dx, SymbolicZero):
        terms.append(dx @ kernel)
    if not isinstance(dkernel, SymbolicZero):
        terms.append(x @ dkernel)
    if not isinstance(dfactor, SymbolicZero):
        with jax.named_scope("logra_sketch"):  # named for profiles (logra_jax/perf/profiling.py)
            terms.append(sketch_tangent(x @ a.T, dfactor))
    dy = sum(terms[1:], terms[0]) if terms else jnp.zeros_like(y)
    return y, dy


sketched_matmul.defjvp(_sketched_matmul_jvp, symbolic_zeros=True)


class Linear(nnx.Module):
    """y = x·kernel (+ bias), kernel (in, out); optional sketch probe for LoGRA targets.

    A kernel tagged by `weights_major` holds kernelᵀ (out, in) and is multiplied weights-major.
    """

    def __init__(self, in_features: int, out_features: int, *, use_bias: bool = False,
                 kernel_axes: tuple[str | None, str | None] = (None, None),
                 dtype=jnp.float32, param_dtype=jnp.float32,
                 kernel_init=nnx.initializers.lecun_normal(), rngs: nnx.Rngs):
        self.in_features = in_features
        self.out_features = out_features
        self.dtype = dtype
        self.kernel_axes = kernel_axes
        self.kernel = nnx.Param(kernel_init(rngs.params(), (in_features, out_features), param_dtype))
        self.bias = (nnx.Param(jnp.zeros((out_features,), param_dtype)) if use_bias else None)

    def __call__(self, x: jax.Array, probe: SketchProbe | None = None,
                 kernel_hint=None, with_bias: bool = True) -> jax.Array:
        """``kernel_hint``: a function of the kernel (as stored, in the compute dtype) that lays
        it out for this product without changing its values (`llama.gathered_by_output_blocks`).
        ``with_bias=False``: the product alone, for a consumer that adds the bias itself (a GPU
        decode step's attention kernel, `decode_kernels.decode_attention`)."""
        # One flat token dim: the backward pass contracts H (tokens × out, the layer's output
        # gradient) over the tokens for the weight gradient or the sketch Hᵀ(x·Aᵀ), and with x as
        # (batch, seq, in) XLA:CPU does that by first writing a transposed copy of H (measured
        # at width 1024: 0.72 → 0.55 s for an MLP's dense gradients, 0.48 → 0.33 s for its
        # sketches); over one token dim it reads H as it is.
        lead = x.shape[:-1]
        x = x.reshape((-1, x.shape[-1])).astype(self.dtype)
        kernel = self.kernel[...].astype(self.dtype)
        if kernel_hint is not None:
            kernel = kernel_hint(kernel)
        stored_transposed = self.kernel.get_metadata().get(WEIGHTS_MAJOR, False)   # decoding
        if probe is not None and probe.factor_is_zero and not stored_transposed:
            y = sketched_matmul(x, kernel, probe.projection(self.in_features, self.dtype),
                                probe.factor.astype(self.dtype))
        else:
            y = weights_major_matmul(x, kernel) if stored_transposed else x @ kernel
            if probe is not None:
                y = y + self.probe_term(x, probe)
        if self.bias is not None and with_bias:
            y = y + self.bias[...].astype(self.dtype)
        return y.reshape(lead + (y.shape[-1],))

    def probe_term(self, x: jax.Array, probe: SketchProbe) -> jax.Array:
        """(x·Aᵀ)·Bᵀ, what ``probe`` adds to this layer's output for inputs x [..., in]."""
        lead = x.shape[:-1]
        x = x.reshape((-1, x.shape[-1])).astype(self.dtype)
        a = probe.projection(self.in_features, self.dtype)       # (r, in)
        with jax.named_scope("logra_sketch"):
            y = times_factor_t(x @ a.T, probe.factor.astype(self.dtype))
        return y.reshape(lead + (y.shape[-1],))
