"""TPU slices as compile targets on a machine without TPUs: the real TPU compiler judges the memory.

libtpu (the ``tpu`` extra) compiles for a TPU topology on any host: `devices` builds the slice's
devices from its topology description, a mesh over them lowers and compiles as if on the hardware,
and ``compiled.memory_analysis()`` reports per-device bytes as the TPU compiler plans them — the
same out-of-memory verdict the hardware would give (MaxText's train_compile.py does this for
pretraining). ``memory_analysis()`` is a lower bound on what a program needs (XLA's wording), so a
plan "fits the compiler's budget"; it does not promise the run fits.

Names are Cloud TPU's: v4, v5p and tpu7x count TensorCores (``v5p-8`` is 4 chips), v5e and v6e count
chips. On v4 and v5p a chip's two TensorCores are one JAX device ("megacore"); on tpu7x each
TensorCore is a device with half the chip's HBM. Figures per chip are the published ones.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import os
import re

GIB = 2 ** 30


@dataclasses.dataclass(frozen=True)
class Chip:
    """Published per-chip figures of a TPU generation. HBM sold as "16 GB" (v5e) and "32 GB" (v6e)
    is 16 and 32 GiB: the compiler's budget on a v5e chip reads 15.75G of it (GiB), the rest its own."""

    hbm: int                  # bytes of HBM per chip
    bf16_flops: float         # peak dense bf16 FLOP/s per chip
    hbm_bandwidth: float      # bytes/s per chip
    devices_per_chip: int     # JAX devices one chip shows (2 on tpu7x: one per TensorCore)


CHIPS = {
    "v4": Chip(hbm=32 * GIB, bf16_flops=275e12, hbm_bandwidth=1228e9, devices_per_chip=1),
    "v5e": Chip(hbm=16 * GIB, bf16_flops=197e12, hbm_bandwidth=819e9, devices_per_chip=1),
    "v5p": Chip(hbm=95 * GIB, bf16_flops=459e12, hbm_bandwidth=2765e9, devices_per_chip=1),
    "v6e": Chip(hbm=32 * GIB, bf16_flops=918e12, hbm_bandwidth=1640e9, devices_per_chip=1),
    "tpu7x": Chip(hbm=192 * GIB, bf16_flops=2307e12, hbm_bandwidth=7370e9, devices_per_chip=2),
}


@dataclasses.dataclass(frozen=True)
class Target:
    """One TPU slice: its Cloud name, topology (as ``get_topology_desc`` reads it) and chips."""

    name: str
    generation: str
    topology: str
    chip_config: str          # "megacore": a chip's two TensorCores are one device
    chips: int

    @property
    def chip(self) -> Chip:
        return CHIPS[self.generation]

    @property
    def devices(self) -> int:
        return self.chips * self.chip.devices_per_chip

    @property
    def hbm_per_device(self) -> int:
        return self.chip.hbm // self.chip.devices_per_chip


def _targets() -> dict[str, Target]:
    out = {}
    for name, topology, chips in [
            ("v4-8", "v4:2x2x1", 4), ("v4-16", "v4:2x2x2", 8),
            ("v5p-8", "v5:2x2x1", 4), ("v5p-16", "v5:2x2x2", 8), ("v5p-32", "v5:2x2x4", 16),
            ("v5p-64", "v5:2x4x4", 32), ("v5p-128", "v5:4x4x4", 64),
            ("v5e-4", "v5e:2x2", 4), ("v5e-8", "v5e:2x4", 8),
            ("v6e-4", "v6e:2x2", 4), ("v6e-8", "v6e:2x4", 8),
            ("v6e-16", "v6e:4x4", 16), ("v6e-32", "v6e:4x8", 32), ("v6e-64", "v6e:8x8", 64),
            ("tpu7x-8", "tpu7x:2x2x1", 4), ("tpu7x-16", "tpu7x:2x2x2", 8),
            ("tpu7x-32", "tpu7x:2x2x4", 16)]:
        generation = name.split("-")[0]
        megacore = "megacore" if generation in ("v4", "v5p") else "default"
        out[name] = Target(name, generation, topology, megacore, chips)
    return out


TARGETS = _targets()


def target(name: str) -> Target:
    if name not in TARGETS:
        raise ValueError(f"unknown TPU target {name!r}; known: cpu, {', '.join(TARGETS)}")
    return TARGETS[name]


def gib_text(n: int) -> str:
    """Bytes as GiB with one decimal, e.g. "95.0 GiB"."""
    return f"{n / GIB:.1f} GiB"


def libtpu_version() -> str | None:
    try:
        return importlib.metadata.version("libtpu")
    except importlib.metadata.PackageNotFoundError:
        return None


def devices(t: Target) -> list:
    """The slice's devices, for meshes that lower and compile (nothing runs on them).

    Without TPU hardware libtpu would look for a metadata server and worker hostnames and print a
    page of warnings; the environment here says there are none (one local host, no metadata), and
    lets several processes (pytest workers) load libtpu at once, which only compiling allows.
    """
    if libtpu_version() is None:
        raise ValueError(f"--target {t.name} compiles with the TPU compiler, which comes with "
                         f"libtpu: pip install -e '.[tpu]'")
    for key, value in (("TPU_SKIP_MDS_QUERY", "1"), ("ALLOW_MULTIPLE_LIBTPU_LOAD", "1"),
                       ("TPU_WORKER_HOSTNAMES", "localhost"), ("TPU_ACCELERATOR_TYPE", t.name)):
        os.environ.setdefault(key, value)
    from jax.experimental import topologies
    found = topologies.get_topology_desc(topology_name=t.topology, platform="tpu",
                                         chip_config_name=t.chip_config).devices
    if len(found) != t.devices:
        raise RuntimeError(f"{t.name}: libtpu built {len(found)} devices for topology "
                           f"{t.topology}, expected {t.devices}")
    return list(found)


class DoesNotFit(Exception):
    """The TPU compiler refused a program over its HBM budget: needs ``needed`` of ``available``.

    One of the compiler's two refusals counts the program's temporaries alone
    (``counts_arguments=False``); `with_arguments` adds the arguments' bytes, known from shapes."""

    def __init__(self, needed: int, available: int, message: str, program: str = "the program",
                 counts_arguments: bool = True):
        super().__init__(message)
        self.needed, self.available, self.program = needed, available, program
        self.counts_arguments = counts_arguments

    def with_arguments(self, arguments: int) -> "DoesNotFit":
        """The refusal with ``needed`` covering the program's arguments too."""
        if self.counts_arguments:
            return self
        return DoesNotFit(self.needed + arguments, self.available, str(self), self.program)


_UNITS = {"": 1, "K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30, "T": 2 ** 40}
# The two ways the TPU compiler words an over-budget program: the whole program's use, or its
# temporaries alone ("the total memory required for HLO temporaries (X) exceeds available HBM (Y)").
_REFUSALS = [
    re.compile(r"Used (?P<used>[\d.]+)(?P<u1>[KMGT]?) of (?P<total>[\d.]+)(?P<u2>[KMGT]?) hbm"),
    re.compile(r"required for .*?\((?P<used>[\d.]+)(?P<u1>[KMGT]?)\) exceeds available HBM "
               r"\((?P<total>[\d.]+)(?P<u2>[KMGT]?)\)")]


def compile_or_refuse(lowered, program: str = "the program", **kwargs):
    """``lowered.compile(**kwargs)``; the compiler's out-of-HBM refusal of ``program`` (its name in
    messages) as `DoesNotFit`."""
    try:
        return lowered.compile(**kwargs)
    except Exception as e:  # JaxRuntimeError: RESOURCE_EXHAUSTED, raised by the compiler
        match = next(filter(None, (r.search(str(e)) for r in _REFUSALS)), None)
        if match is None:
            raise
        needed = int(float(match["used"]) * _UNITS[match["u1"]])
        available = int(float(match["total"]) * _UNITS[match["u2"]])
        raise DoesNotFit(needed, available, str(e).strip().splitlines()[0], program,
                         counts_arguments="temporaries" not in match.group(0)) from None


def roofline_seconds(flops: float, bytes_accessed: float, t: Target) -> dict[str, float]:
    """Lower bounds of one device's time for a program: compute-bound, memory-bound, and their max
    (peak bf16 FLOP/s and HBM bandwidth per device; a lower bound, never a prediction)."""
    per_device = t.chip.devices_per_chip
    compute = flops / (t.chip.bf16_flops / per_device)
    memory = bytes_accessed / (t.chip.hbm_bandwidth / per_device)
    return {"compute": compute, "memory": memory, "bound": max(compute, memory)}
