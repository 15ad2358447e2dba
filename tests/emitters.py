"""Which of XLA:CPU's code generators the suite compiles with, and the few programs that need the other.

The suite (tests/conftest.py, and every `launch.*` process it starts) uses XLA:CPU's elemental
emitters (``--xla_cpu_use_fusion_emitters=false``) beside LLVM level 0: they compile the tiny
update in 0.4 of the CPU time of the MLIR fusion emitters, XLA:CPU's default (measured: 6.0 → 2.3
s of CPU; the tiny sampler's generate 2.2 → 0.7 s; at the default LLVM level they make no
difference). Like the level, this is how XLA:CPU writes the code, not what it computes: every
comparison of a program with itself (resumes, syncs, bit-for-bit replays) and every tolerance
derived from the arithmetic holds under either.

A few tests compare two *different* programs bit for bit (or at a tolerance far below what
reordering may change): equal under the fusion emitters, not by construction; under the elemental
emitters they differ in the last bits (seen: 1.8e-5 relative; a key bias's gradient, zero but for
rounding, with other rounding). Those programs compile with ``FUSION_EMITTERS``, XLA:CPU's
default, so what they check is unchanged.

The flag is XLA's (jaxlib 0.10.2 has it); a jaxlib whose XLA dropped it would stop at start-up
with "Unknown flag in XLA_FLAGS".
"""

ELEMENTAL_EMITTERS = "--xla_cpu_use_fusion_emitters=false"
FUSION_EMITTERS = {"xla_cpu_use_fusion_emitters": True}   # compiler_options of a jax.jit


def with_elemental_emitters(flags: str) -> str:
    """``flags`` (an XLA_FLAGS value) with ``ELEMENTAL_EMITTERS``, unless it sets the emitters."""
    return flags if "xla_cpu_use_fusion_emitters" in flags else f"{flags} {ELEMENTAL_EMITTERS}".strip()
