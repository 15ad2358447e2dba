"""NVIDIA GPU nodes as compile targets on a machine without GPUs: XLA:GPU plans the memory.

The CUDA plugin (the ``gpu-plan`` extra: jax-cuda12-plugin and -pjrt pinned to the jax the project
pins, and ptxas from nvidia-cuda-nvcc-cu12) registers a compile-only GPU topology even where no
GPU or driver is present (``JAX_PLATFORMS=cpu`` keeps JAX from looking for one to run on):
``get_topology_desc(platform="cuda", target_config=<a GpuTargetConfigProto as text>,
topology="<slices>x<hosts>x<GPUs per host>")`` gives the node's devices, a mesh over them lowers and
compiles as if on the hardware, and ``memory_analysis()`` is XLA:GPU's own plan per GPU. jax's own
tests do this (tests/aot_test.py, test_deviceless_aot_compile).

Calibrated on one H200 (the first GPU run): the 7B update XLA:GPU planned here, deviceless, is
0.13 % under what the device measured (``peak_bytes_in_use``); XLA:CPU's plan of the same program
was 45 % over. The plan is XLA's without autotuning: the kernels' default tile configurations, where
a GPU would try several and keep the fastest (``xla_gpu_load_autotune_results_from`` with results
dumped on a real GPU would make it that program exactly).

XLA:GPU refuses nothing for memory: over its budget it warns ("Can't reduce memory use below ...")
and plans past the device's memory. The fit verdict is drawn from the plan against
`Node.memory_per_device`.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.resources
import os
import re

from logra_jax.perf import target as target_lib
from logra_jax.perf.target import gib_text

EXTRA = "pip install -e '.[gpu-plan]'"
PLUGIN = "jax-cuda12-plugin"
# Every GPU program's options: XLA:GPU compiles a sort through CUB's radix sort by default, which
# needs a device to size its scratch; XLA's own sort kernel compiles without one (the sampler's
# top-k / top-p sort the logits).
COMPILER_OPTIONS = {"xla_gpu_enable_cub_radix_sort": False}
# The share of a GPU's memory JAX's allocator takes (XLA_PYTHON_CLIENT_MEM_FRACTION; JAX's own
# default is 0.75, which on an H200 stops a program near 104 GiB): the GPU runs set 0.95, and so
# does the plan unless the variable says otherwise here too.
DEFAULT_MEM_FRACTION = 0.95
# XLA:GPU schedules a program within 80 % of a target config's device_memory_size when no runtime
# is present (GetSchedulerMemoryLimit); on a GPU, JAX passes the allocator's limit instead.
SCHEDULER_SHARE = 0.8


@dataclasses.dataclass(frozen=True)
class Gpu:
    """One GPU model: XLA's target config for it (``gpu_specs/``, copied from openxla/xla, where
    XLA dumps them from the devices) and its published peak dense bf16 FLOP/s and bandwidth. Its
    memory is the config's device_memory_size: what the device reports to CUDA."""

    spec: str
    bf16_flops: float     # dense (the datasheets' "with sparsity" figure halved)
    bandwidth: float      # bytes/s

    @property
    def config_text(self) -> str:
        return importlib.resources.files("logra_jax.perf").joinpath("gpu_specs", self.spec).read_text()

    @property
    def memory(self) -> int:
        return int(re.search(r"device_memory_size: (\d+)", self.config_text).group(1))

    @property
    def device_name(self) -> str:
        return re.search(r'device_description_str: "([^"]+)"', self.config_text).group(1)


GPUS = {
    # NVIDIA A100 datasheet (SXM4 80GB): BF16 Tensor Core 312 TFLOPS dense, HBM2e 2,039 GB/s.
    "a100-80gb": Gpu("a100_sxm_80.txtpb", bf16_flops=312e12, bandwidth=2039e9),
    # NVIDIA H100 datasheet (SXM): BF16 Tensor Core 1,979 TFLOPS with sparsity (989 dense),
    # HBM3 3.35 TB/s.
    "h100": Gpu("h100_sxm.txtpb", bf16_flops=989e12, bandwidth=3.35e12),
    # NVIDIA H200 datasheet (SXM): BF16 1,979 TFLOPS with sparsity (989 dense), 141 GB HBM3e at
    # 4.8 TB/s.
    "h200": Gpu("h200.txtpb", bf16_flops=989e12, bandwidth=4.8e12),
    # NVIDIA HGX B200 datasheet: FP16/BF16 Tensor Core 36 PFLOPS with sparsity for 8 GPUs (2.25
    # dense per GPU), HBM3e 8 TB/s per GPU.
    "b200": Gpu("b200.txtpb", bf16_flops=2.25e15, bandwidth=8e12),
}


def mem_fraction() -> float:
    text = os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION")
    try:
        value = float(text) if text else DEFAULT_MEM_FRACTION
    except ValueError:
        raise ValueError(f"XLA_PYTHON_CLIENT_MEM_FRACTION={text!r}: expected a fraction such as 0.95") from None
    if not 0 < value <= 1:
        raise ValueError(f"XLA_PYTHON_CLIENT_MEM_FRACTION={text!r}: expected a fraction in (0, 1]")
    return value


@dataclasses.dataclass(frozen=True)
class Node(target_lib.Target):
    """``hosts`` nodes of ``gpus_per_host`` GPUs of one model, NVLink within a node."""

    name: str
    gpu_name: str
    gpus_per_host: int = 8
    hosts: int = 1

    @property
    def gpu(self) -> Gpu:
        return GPUS[self.gpu_name]

    @property
    def topology(self) -> str:
        return f"1x{self.hosts}x{self.gpus_per_host}"   # slices x hosts x GPUs per host

    @property
    def devices(self) -> int:
        return self.hosts * self.gpus_per_host

    @property
    def memory_per_device(self) -> int:
        """The allocator's limit: XLA_PYTHON_CLIENT_MEM_FRACTION of the GPU's memory."""
        return int(self.gpu.memory * mem_fraction())

    @property
    def bf16_flops_per_device(self) -> float:
        return self.gpu.bf16_flops

    @property
    def bandwidth_per_device(self) -> float:
        return self.gpu.bandwidth

    @property
    def unit(self) -> str:
        return "GPU"

    @property
    def family(self) -> str:
        return self.gpu_name.upper()

    @property
    def memory_text(self) -> str:
        return (f"{gib_text(self.memory_per_device)} ({mem_fraction():.0%} of "
                f"{gib_text(self.gpu.memory)}: XLA_PYTHON_CLIENT_MEM_FRACTION={mem_fraction():g})")

    @property
    def judge(self) -> str:
        return "XLA:GPU's plan against the allocator's limit"

    def compiler(self) -> str:
        import jax
        import jaxlib
        return (f"XLA:GPU deviceless, {PLUGIN} {plugin_version()} (jax {jax.__version__}, jaxlib "
                f"{jaxlib.__version__}), target config '{self.gpu.device_name}'; XLA's plan without "
                f"autotuning (default kernel configurations)")

    def describe(self, mesh_size: int) -> str:
        hosts = f"{self.hosts} hosts × " if self.hosts > 1 else ""
        return (f"target {self.name} = topology {self.topology}, {hosts}{self.gpus_per_host} × "
                f"{self.gpu.device_name} ({gib_text(self.gpu.memory)}; the allocator's limit "
                f"{gib_text(self.memory_per_device)}); training mesh uses {mesh_size} GPUs")

    def compiler_options(self) -> dict:
        return COMPILER_OPTIONS

    def with_hosts(self, hosts: int) -> "Node":
        if hosts < 1:
            raise ValueError(f"--hosts {hosts}: expected at least 1")
        return dataclasses.replace(self, hosts=hosts)

    def config_text(self) -> str:
        """The GPU's target config with device_memory_size set so XLA:GPU's deviceless budget (80 %
        of it) is the allocator's limit JAX gives the compiler on the GPU: the same program then
        gets the same rematerialization and schedule here as there."""
        budget = int(self.memory_per_device / SCHEDULER_SHARE)
        return re.sub(r"device_memory_size: \d+", f"device_memory_size: {budget}",
                      self.gpu.config_text, count=1)

    def jax_devices(self) -> list:
        if plugin_version() is None:
            raise ValueError(f"--target {self.name} compiles with XLA:GPU, which comes with the "
                             f"CUDA plugin: {EXTRA}")
        from jax.experimental import topologies
        try:
            found = topologies.get_topology_desc(platform="cuda", target_config=self.config_text(),
                                                 topology=self.topology).devices
        except NotImplementedError as e:
            raise ValueError(f"--target {self.name}: the CUDA plugin registered no GPU topology "
                             f"({e}); reinstall it: {EXTRA}") from None
        if len(found) != self.devices:
            raise RuntimeError(f"{self.name}: the CUDA plugin built {len(found)} devices for "
                               f"topology {self.topology}, expected {self.devices}")
        return list(found)


def plugin_version() -> str | None:
    try:
        return importlib.metadata.version(PLUGIN)
    except importlib.metadata.PackageNotFoundError:
        return None


TARGETS = {f"{name}-8": Node(f"{name}-8", name) for name in GPUS}
