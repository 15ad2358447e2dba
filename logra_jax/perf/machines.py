"""The machines the memory planner compiles for without having them: GPU nodes and TPU slices.

A machine is a row of data: its devices, the memory a program may use on each, the peak dense bf16
FLOP/s and bandwidth of each (for roofline bounds), the XLA options its programs need, and how its
compiler builds its devices from a topology (nothing runs on them: a mesh over them lowers and
compiles as if on the hardware). `launch.memory --target NAME` and `launch.memory_table` look one
up with `machine(NAME)`; the planner itself sees only a mesh, so it does not fork per vendor.

Two compilers build devices, and they judge memory differently:

- **XLA:GPU, deviceless** (the ``gpu-plan`` extra: jax-cuda12-plugin and -pjrt pinned to the jax
  the project pins, and ptxas from nvidia-cuda-nvcc-cu12). The CUDA plugin registers a
  compile-only GPU topology where no GPU or driver is present: ``get_topology_desc(platform="cuda",
  target_config=<a GpuTargetConfigProto as text>, topology="<slices>x<hosts>x<GPUs per host>")``
  (jax's own tests/aot_test.py does this), and ``memory_analysis()`` is XLA:GPU's own plan per GPU.
  The plan is XLA's without autotuning: the kernels' default tile configurations, where a GPU
  would try several and keep the fastest. XLA:GPU refuses nothing for memory: over its budget it
  warns ("Can't reduce memory use below ...") and plans past the device's memory, so the fit
  verdict is drawn from the plan against `Machine.memory_per_device`, the allocator's limit.
  docs/results/memory.md compares such a plan with what an H200 measured.
- **The TPU compiler** (libtpu, the ``tpu`` extra) compiles for a TPU topology on any host, and
  refuses a program over a device's HBM itself (`oom.DoesNotFit`). ``memory_analysis()`` is a
  lower bound on what a program needs (XLA's wording), so a plan "fits the compiler's budget"; it
  does not promise the run fits. MaxText's train_compile.py plans pretraining the same way.

Names are the vendors': a GPU node is ``<gpu>-8`` (8 GPUs, NVLink within the node); Cloud TPU's
v4, v5p and tpu7x names count TensorCores (``v5p-8`` is 4 chips), v5e and v6e names count chips.
On v4 and v5p a chip's two TensorCores are one JAX device ("megacore"); on tpu7x each TensorCore
is a device with half the chip's HBM.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.metadata
import importlib.resources
import os
import re

GIB = 2 ** 30


def gib_text(n: int) -> str:
    """Bytes as GiB with one decimal, e.g. "95.0 GiB"."""
    return f"{n / GIB:.1f} GiB"


GPU_PLUGIN = "jax-cuda12-plugin"
GPU_EXTRA = "pip install -e '.[gpu-plan]'"
TPU_EXTRA = "pip install -e '.[tpu]'"
# Every GPU program's options: XLA:GPU compiles a sort through CUB's radix sort by default, which
# needs a device to size its scratch; XLA's own sort kernel compiles without one (the sampler's
# top-k / top-p sort the logits).
XLA_GPU_OPTIONS = {"xla_gpu_enable_cub_radix_sort": False}
# The share of a GPU's memory JAX's allocator takes (XLA_PYTHON_CLIENT_MEM_FRACTION). JAX's own
# default, 0.75, would stop an H200's program near 104 GiB; the project's GPU runs set 0.95, and
# the plan assumes the same unless the variable says otherwise here too.
DEFAULT_MEM_FRACTION = 0.95
# XLA:GPU schedules a program within 80 % of a target config's device_memory_size when no runtime
# is present (GetSchedulerMemoryLimit); on a GPU, JAX passes the allocator's limit instead.
SCHEDULER_SHARE = 0.8


@dataclasses.dataclass(frozen=True)
class Machine:
    """One machine to compile for: a GPU node (``kind="gpu"``) or a TPU slice (``kind="tpu"``)."""

    name: str                      # what --target calls it: "h100-8", "v5p-16"
    kind: str                      # "gpu" (XLA:GPU, deviceless) or "tpu" (the TPU compiler)
    family: str                    # the hardware's short name, for cost lines: "H200", "v5p"
    devices: int                   # JAX devices
    memory: int                    # bytes of one device: a TPU device's HBM, a GPU's own memory
    bf16_flops_per_device: float   # peak dense bf16 FLOP/s (published)
    bandwidth_per_device: float    # memory bandwidth, bytes/s (published)
    topology: str                  # as get_topology_desc reads it: "v5:2x2x1", "1x1x8"
    xla_options: tuple[tuple[str, object], ...] = ()   # every program's compiler options
    # TPU slices
    chip_config: str = "default"   # "megacore": a chip's two TensorCores are one device
    devices_per_chip: int = 1      # 2 on tpu7x: one per TensorCore
    # GPU nodes
    target_config: str = ""        # XLA's GpuTargetConfigProto for the GPU, a file in gpu_specs/
    device_name: str = ""          # the GPU as its target config names it
    devices_per_host: int = 0
    hosts: int = 1

    @property
    def memory_per_device(self) -> int:
        """Bytes a program may use on one device: a TPU's HBM; a GPU's allocator limit,
        XLA_PYTHON_CLIENT_MEM_FRACTION of its memory."""
        if self.kind == "gpu":
            return int(self.memory * mem_fraction())
        return self.memory

    @property
    def unit(self) -> str:
        """What a table's column is per: "GPU", "chip", or "device" (half a tpu7x chip)."""
        if self.kind == "gpu":
            return "GPU"
        return "device" if self.devices_per_chip > 1 else "chip"

    @property
    def memory_text(self) -> str:
        """How the fit lines name the budget: "95.0 GiB HBM"."""
        if self.kind == "gpu":
            fraction = mem_fraction()
            return (f"{gib_text(self.memory_per_device)} ({fraction:.0%} of {gib_text(self.memory)}: "
                    f"XLA_PYTHON_CLIENT_MEM_FRACTION={fraction:g})")
        return f"{gib_text(self.memory_per_device)} HBM"

    @property
    def judge(self) -> str:
        """Who draws the fit verdict, for the fit lines' parenthesis."""
        if self.kind == "gpu":
            return "XLA:GPU's plan against the allocator's limit"
        return "the compiler's plan is a lower bound"

    def compiler_options(self) -> dict:
        """XLA options every program compiled for this machine needs."""
        return dict(self.xla_options)

    def compiler(self) -> str:
        """The compiler and its version, for headers: "TPU, libtpu 0.0.42.1 (jax 0.10.2)"."""
        import jax
        if self.kind == "tpu":
            return f"TPU, libtpu {libtpu_version()} (jax {jax.__version__})"
        import jaxlib
        return (f"XLA:GPU deviceless, {GPU_PLUGIN} {plugin_version()} (jax {jax.__version__}, "
                f"jaxlib {jaxlib.__version__}), target config '{self.device_name}'; XLA's plan "
                f"without autotuning (default kernel configurations)")

    def describe(self, mesh_size: int) -> str:
        """The hardware for a header: topology, devices and their memory, the training mesh's share."""
        if self.kind == "tpu":
            chips = self.devices // self.devices_per_chip
            return (f"target {self.name} = topology {self.topology}, {chips} chips × "
                    f"{gib_text(self.memory * self.devices_per_chip)} HBM, {self.devices} devices "
                    f"({gib_text(self.memory)} each); training mesh uses {mesh_size} devices "
                    f"({mesh_size // self.devices_per_chip} chips)")
        hosts = f"{self.hosts} hosts × " if self.hosts > 1 else ""
        return (f"target {self.name} = topology {self.topology}, {hosts}{self.devices_per_host} × "
                f"{self.device_name} ({gib_text(self.memory)}; the allocator's limit "
                f"{gib_text(self.memory_per_device)}); training mesh uses {mesh_size} GPUs")

    def with_hosts(self, hosts: int) -> Machine:
        """The machine spanning ``hosts`` hosts: a GPU node repeated; a TPU slice is one slice
        whatever hosts drive it. ValueError for fewer than one host of GPUs."""
        if self.kind == "tpu":
            return self
        if hosts < 1:
            raise ValueError(f"--hosts {hosts}: expected at least 1")
        return dataclasses.replace(self, hosts=hosts, devices=hosts * self.devices_per_host,
                                   topology=f"1x{hosts}x{self.devices_per_host}")

    def roofline_seconds(self, flops: float, bytes_accessed: float) -> dict[str, float]:
        """Lower bounds of one device's time for a program: compute-bound, memory-bound and their
        max (peak bf16 FLOP/s and bandwidth per device; a lower bound, never a prediction)."""
        compute = flops / self.bf16_flops_per_device
        memory = bytes_accessed / self.bandwidth_per_device
        return {"compute": compute, "memory": memory, "bound": max(compute, memory)}

    def jax_devices(self) -> list:
        """The machine's devices, for meshes that lower and compile; a ValueError naming the extra
        to install where this machine cannot compile for it."""
        found = _gpu_devices(self) if self.kind == "gpu" else _tpu_devices(self)
        if len(found) != self.devices:
            raise RuntimeError(f"{self.name}: the compiler built {len(found)} devices for topology "
                               f"{self.topology}, expected {self.devices}")
        return list(found)


# ----------------------------------------------------------------------------------------------
# The table
# ----------------------------------------------------------------------------------------------
def _config_text(spec: str) -> str:
    return importlib.resources.files("logra_jax.perf").joinpath("gpu_specs", spec).read_text()


def _gpu_node(key: str, spec: str, bf16_flops: float, bandwidth: float) -> Machine:
    """8 GPUs of one model. Its memory and name are those of XLA's target config (copied from
    openxla/xla, where XLA dumps them from the devices): what the device reports to CUDA."""
    text = _config_text(spec)
    return Machine(
        name=f"{key}-8", kind="gpu", family=key.upper(), devices=8,
        memory=int(re.search(r"device_memory_size: (\d+)", text).group(1)),
        bf16_flops_per_device=bf16_flops, bandwidth_per_device=bandwidth, topology="1x1x8",
        xla_options=tuple(XLA_GPU_OPTIONS.items()), target_config=spec,
        device_name=re.search(r'device_description_str: "([^"]+)"', text).group(1),
        devices_per_host=8)


# Peak dense bf16 FLOP/s (the datasheets' "with sparsity" figure halved) and HBM bandwidth per GPU:
# NVIDIA A100 SXM4 80GB: 312 TFLOPS, 2,039 GB/s. H100 SXM: 1,979 TFLOPS with sparsity, 3.35 TB/s.
# H200 SXM: 1,979 TFLOPS with sparsity, 4.8 TB/s. HGX B200: 36 PFLOPS with sparsity for 8 GPUs,
# 8 TB/s per GPU.
_GPU_NODES = [
    _gpu_node("a100-80gb", "a100_sxm_80.txtpb", bf16_flops=312e12, bandwidth=2039e9),
    _gpu_node("h100", "h100_sxm.txtpb", bf16_flops=989e12, bandwidth=3.35e12),
    _gpu_node("h200", "h200.txtpb", bf16_flops=989e12, bandwidth=4.8e12),
    _gpu_node("b200", "b200.txtpb", bf16_flops=2.25e15, bandwidth=8e12),
]

# What one kernel of a decode step costs on a GPU where the step is launch-bound, measured (the
# only such measurement there is; gpu_cost.py's SECONDS_PER_KERNEL is the mean over its programs of
# 1 / (tokens/s × kernels per token)). On one H200 (docs/results/gpu.md), `launch.sampler_bench`
# decoded SmolLM2-135M's shape (random bf16 weights, 64 + 128 tokens, batch 1) at 713.4 tokens/s
# stacked and 1,335.2 per_layer. XLA:GPU's program of that run, compiled deviceless from the code
# that ran (the sampler of main at 2259830, before its token loop was chunked; jax 0.10.2) and read
# by perf/gpu_cost.py, launches 725 and 417 kernels per token, while its bytes per token (0.73 and
# 0.28 GB) take 153 and 58 µs at the H200's 4.8 TB/s: the steps were launch-bound, at
# 1/(713.4 × 725) = 1.93 µs and 1/(1335.2 × 417) = 1.80 µs per kernel. That holds everything a
# step spent per kernel on that machine: the launch, the kernel's own minimum time, the loop's
# host sync (one per token then) spread over the step's kernels, the prefill spread over the 128
# tokens. A program whose kernels run inside command buffers (CUDA graphs) without a host sync
# may launch faster. tests/test_gpu_cost.py checks that today's sampler launches no more kernels
# at that shape than the program that ran.
KERNEL_CALIBRATIONS = {
    "H200": {
        "device": "NVIDIA H200", "date": "2026-12-04",
        "software": "jax 0.11.2 with its CUDA 13 plugin, flax 0.12.10",
        "evidence": "docs/results/gpu.md",   # its table's sampler row
        "command": ("python -m launch.sampler_bench --dtype bfloat16 --meshes 1 --batches 1,16,64 "
                    "--decode_weights stacked,per_layer --repeats 3 --prompt_length 64 "
                    "--completion_length 128 --config.model.source=tiny "
                    "--config.model.tiny.hidden_size=576 --config.model.tiny.num_layers=30 "
                    "--config.model.tiny.num_heads=9 --config.model.tiny.num_kv_heads=3 "
                    "--config.model.tiny.head_dim=64 --config.model.tiny.intermediate_size=1536 "
                    "--config.model.tiny.max_position_embeddings=2048"),
        "program": ("the sampler of main at 2259830 (a token loop synced every token), compiled "
                    "deviceless by XLA:GPU (jax 0.10.2) and counted by perf/gpu_cost.py"),
        "model": "SmolLM2-135M shape, bf16, batch 1, 64 + 128 tokens",
        "measured_tokens_per_s": {"stacked": 713.4, "per_layer": 1335.2},
        "kernels_per_token": {"stacked": 725, "per_layer": 417},
    },
}

# Published figures per TPU chip: HBM, peak dense bf16 FLOP/s, HBM bandwidth, and the JAX devices
# a chip shows. HBM sold as "16 GB" (v5e) and "32 GB" (v6e) is 16 and 32 GiB: the compiler's
# budget on a v5e chip reads 15.75G of it (GiB), the rest its own.
_TPU_CHIPS = {
    "v4": (32 * GIB, 275e12, 1228e9, 1),
    "v5e": (16 * GIB, 197e12, 819e9, 1),
    "v5p": (95 * GIB, 459e12, 2765e9, 1),
    "v6e": (32 * GIB, 918e12, 1640e9, 1),
    "tpu7x": (192 * GIB, 2307e12, 7370e9, 2),
}
# Cloud TPU slices: name, topology, chips.
_TPU_SLICES = [
    ("v4-8", "v4:2x2x1", 4), ("v4-16", "v4:2x2x2", 8),
    ("v5p-8", "v5:2x2x1", 4), ("v5p-16", "v5:2x2x2", 8), ("v5p-32", "v5:2x2x4", 16),
    ("v5p-64", "v5:2x4x4", 32), ("v5p-128", "v5:4x4x4", 64),
    ("v5e-4", "v5e:2x2", 4), ("v5e-8", "v5e:2x4", 8),
    ("v6e-4", "v6e:2x2", 4), ("v6e-8", "v6e:2x4", 8),
    ("v6e-16", "v6e:4x4", 16), ("v6e-32", "v6e:4x8", 32), ("v6e-64", "v6e:8x8", 64),
    ("tpu7x-8", "tpu7x:2x2x1", 4), ("tpu7x-16", "tpu7x:2x2x2", 8), ("tpu7x-32", "tpu7x:2x2x4", 16),
]


def _tpu_slice(name: str, topology: str, chips: int) -> Machine:
    family = name.split("-")[0]
    hbm, flops, bandwidth, per_chip = _TPU_CHIPS[family]
    return Machine(name=name, kind="tpu", family=family, devices=chips * per_chip,
                   memory=hbm // per_chip, bf16_flops_per_device=flops / per_chip,
                   bandwidth_per_device=bandwidth / per_chip, topology=topology,
                   chip_config="megacore" if family in ("v4", "v5p") else "default",
                   devices_per_chip=per_chip)


MACHINES: dict[str, Machine] = {m.name: m for m in
                                [*_GPU_NODES, *(_tpu_slice(*row) for row in _TPU_SLICES)]}


def machine(name: str) -> Machine:
    """The machine called ``name``: a GPU node (h100-8) or a Cloud TPU slice (v5p-16)."""
    if name not in MACHINES:
        raise ValueError(f"unknown target {name!r}; known: cpu, {', '.join(MACHINES)}")
    return MACHINES[name]


def gpu_node_for(device_kind: str) -> Machine | None:
    """The GPU node whose GPU a device kind names ("NVIDIA H100 80GB HBM3" → h100-8): the GPU
    model, the family's first word, appears in the kinds CUDA reports. None for another GPU."""
    return next((m for m in MACHINES.values()
                 if m.kind == "gpu" and m.family.split("-")[0] in device_kind.upper()), None)


def compiler_options_for(mesh) -> dict:
    """Options every program compiled for ``mesh``'s devices needs, by their platform."""
    first = mesh.devices.flat[0] if hasattr(mesh, "devices") else list(mesh)[0]
    return dict(XLA_GPU_OPTIONS) if first.platform == "gpu" else {}


# ----------------------------------------------------------------------------------------------
# XLA:GPU's devices
# ----------------------------------------------------------------------------------------------
def mem_fraction() -> float:
    """XLA_PYTHON_CLIENT_MEM_FRACTION, or the GPU runs' 0.95 where it is not set."""
    text = os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION")
    try:
        value = float(text) if text else DEFAULT_MEM_FRACTION
    except ValueError:
        raise ValueError(f"XLA_PYTHON_CLIENT_MEM_FRACTION={text!r}: expected a fraction such as 0.95") from None
    if not 0 < value <= 1:
        raise ValueError(f"XLA_PYTHON_CLIENT_MEM_FRACTION={text!r}: expected a fraction in (0, 1]")
    return value


def plugin_version() -> str | None:
    try:
        return importlib.metadata.version(GPU_PLUGIN)
    except importlib.metadata.PackageNotFoundError:
        return None


def gpu_target_config(node: Machine) -> str:
    """The GPU's target config with device_memory_size set so XLA:GPU's deviceless budget (80 %
    of it) is the allocator's limit JAX gives the compiler on the GPU: the same program then gets
    the same rematerialization and schedule here as there."""
    budget = int(node.memory_per_device / SCHEDULER_SHARE)
    return re.sub(r"device_memory_size: \d+", f"device_memory_size: {budget}",
                  _config_text(node.target_config), count=1)


def _gpu_devices(node: Machine) -> list:
    if plugin_version() is None:
        raise ValueError(f"--target {node.name} compiles with XLA:GPU, which comes with the "
                         f"CUDA plugin: {GPU_EXTRA}")
    from jax.experimental import topologies
    try:
        return topologies.get_topology_desc(platform="cuda", target_config=gpu_target_config(node),
                                            topology=node.topology).devices
    except NotImplementedError as e:
        raise ValueError(f"--target {node.name}: the CUDA plugin registered no GPU topology "
                         f"({e}); reinstall it: {GPU_EXTRA}") from None


# ----------------------------------------------------------------------------------------------
# The TPU compiler's devices
# ----------------------------------------------------------------------------------------------
def libtpu_version() -> str | None:
    try:
        return importlib.metadata.version("libtpu")
    except importlib.metadata.PackageNotFoundError:
        return None


@contextlib.contextmanager
def _libtpu_environment(tpu: Machine):
    """The environment libtpu reads, for one slice's topology, and the process's own back after.

    Without TPU hardware libtpu would look for a metadata server and worker hostnames and print a
    page of warnings; these say there are none (one local host, no metadata), name the slice, and
    let several processes (pytest workers) load libtpu at once, which only compiling allows.
    libtpu reads them when it first builds a topology in a process (never while compiling), and
    jax's cluster detection reads TPU_WORKER_HOSTNAMES too: so they hold for the call alone.
    """
    wanted = {"TPU_SKIP_MDS_QUERY": "1", "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
              "TPU_WORKER_HOSTNAMES": "localhost", "TPU_ACCELERATOR_TYPE": tpu.name}
    saved = {key: os.environ.get(key) for key in wanted}
    for key, value in wanted.items():
        if key == "TPU_ACCELERATOR_TYPE" or saved[key] is None:   # the user's own settings stand
            os.environ[key] = value
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _tpu_devices(tpu: Machine) -> list:
    if libtpu_version() is None:
        raise ValueError(f"--target {tpu.name} compiles with the TPU compiler, which comes with "
                         f"libtpu: {TPU_EXTRA}")
    from jax.experimental import topologies
    with _libtpu_environment(tpu):
        return topologies.get_topology_desc(topology_name=tpu.topology, platform="tpu",
                                            chip_config_name=tpu.chip_config).devices
