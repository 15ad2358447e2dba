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

from logra_jax.perf import target as target_lib
# Where callers of this module found them before GPU nodes joined: the refusal is the TPU compiler's.
from logra_jax.perf.target import DoesNotFit, compile_or_refuse, gib_text  # noqa: F401

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
class Slice(target_lib.Target):
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

    memory_per_device = hbm_per_device

    @property
    def bf16_flops_per_device(self) -> float:
        return self.chip.bf16_flops / self.chip.devices_per_chip

    @property
    def bandwidth_per_device(self) -> float:
        return self.chip.hbm_bandwidth / self.chip.devices_per_chip

    @property
    def unit(self) -> str:
        return "device" if self.chip.devices_per_chip > 1 else "chip"

    @property
    def family(self) -> str:
        return self.generation

    def compiler(self) -> str:
        import jax
        return f"TPU, libtpu {libtpu_version()} (jax {jax.__version__})"

    def jax_devices(self) -> list:
        return devices(self)

    def describe(self, mesh_size: int) -> str:
        return (f"target {self.name} = topology {self.topology}, {self.chips} chips × "
                f"{gib_text(self.chip.hbm)} HBM, {self.devices} devices ({gib_text(self.hbm_per_device)} "
                f"each); training mesh uses {mesh_size} devices "
                f"({mesh_size // self.chip.devices_per_chip} chips)")


Target = Slice   # the name callers of this module knew it by


def _targets() -> dict[str, Slice]:
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
        out[name] = Slice(name, generation, topology, megacore, chips)
    return out


TARGETS = _targets()


def target(name: str) -> Slice:
    if name not in TARGETS:
        raise ValueError(f"unknown TPU target {name!r}; known: {', '.join(TARGETS)}")
    return TARGETS[name]


def libtpu_version() -> str | None:
    try:
        return importlib.metadata.version("libtpu")
    except importlib.metadata.PackageNotFoundError:
        return None


def devices(t: Slice) -> list:
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
