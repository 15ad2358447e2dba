"""What a machine the memory planner compiles for without having it is: a TPU slice or a GPU node, one kind.

A target is devices built from a topology description (nothing runs on them: a mesh over them
lowers and compiles as if on the hardware), the memory a program may use on each device, the
peak dense bf16 FLOP/s and memory bandwidth per device (for roofline bounds), and the compiler that
plans it with its version. perf/tpu.py holds Cloud TPU slices (the TPU compiler, libtpu), perf/gpu.py
NVIDIA GPU nodes (XLA:GPU, the CUDA plugin), perf/targets.py finds them by name; `launch.memory`,
`launch.memory_table` and the tests see only this interface, so the planner does not fork per vendor. What the vendors differ in stays
with them: the TPU compiler refuses a program over its HBM budget itself (`DoesNotFit`), XLA:GPU
plans past the device's memory and warns, and the fit verdict is drawn from the plan.
"""

from __future__ import annotations

import abc
import re

GIB = 2 ** 30


def gib_text(n: int) -> str:
    """Bytes as GiB with one decimal, e.g. "95.0 GiB"."""
    return f"{n / GIB:.1f} GiB"


class Target(abc.ABC):
    """One machine to compile for. Subclasses are frozen dataclasses with a ``name``."""

    name: str

    @property
    @abc.abstractmethod
    def devices(self) -> int:
        """JAX devices the target has (a TPU chip may show two; a GPU is one)."""

    @property
    @abc.abstractmethod
    def memory_per_device(self) -> int:
        """Bytes a program may use on one device: a TPU's HBM, a GPU's allocator limit."""

    @property
    @abc.abstractmethod
    def bf16_flops_per_device(self) -> float:
        """Peak dense bf16 FLOP/s of one device (published)."""

    @property
    @abc.abstractmethod
    def bandwidth_per_device(self) -> float:
        """Memory bandwidth of one device in bytes/s (published)."""

    @property
    @abc.abstractmethod
    def unit(self) -> str:
        """What a table's column is per: "chip", "device" (half a tpu7x chip) or "GPU"."""

    @property
    @abc.abstractmethod
    def family(self) -> str:
        """The hardware's short name for cost lines: "v5p", "H200"."""

    @abc.abstractmethod
    def compiler(self) -> str:
        """The compiler and its version, for headers: "TPU, libtpu 0.0.42.1 (jax 0.10.2)"."""

    @abc.abstractmethod
    def jax_devices(self) -> list:
        """The target's devices, for meshes that lower and compile; an actionable ValueError
        (naming the extra to install) when this machine cannot compile for it."""

    @abc.abstractmethod
    def describe(self, mesh_size: int) -> str:
        """The hardware for a header: topology, devices and their memory, the training mesh's share."""

    def compiler_options(self) -> dict:
        """XLA options every program compiled for this target needs (none by default)."""
        return {}

    def with_hosts(self, hosts: int) -> "Target":
        """The target spanning ``hosts`` hosts: a TPU slice is one slice whatever hosts drive it; a GPU
        node is repeated. ValueError when the target cannot span them."""
        return self

    @property
    def memory_text(self) -> str:
        """How the fit lines name the budget: "95.0 GiB HBM"."""
        return f"{gib_text(self.memory_per_device)} HBM"

    @property
    def judge(self) -> str:
        """Who draws the fit verdict, for the fit lines' parenthesis."""
        return "the compiler's plan is a lower bound"

    def roofline_seconds(self, flops: float, bytes_accessed: float) -> dict[str, float]:
        """Lower bounds of one device's time for a program: compute-bound, memory-bound and their
        max (peak bf16 FLOP/s and bandwidth per device; a lower bound, never a prediction)."""
        compute = flops / self.bf16_flops_per_device
        memory = bytes_accessed / self.bandwidth_per_device
        return {"compute": compute, "memory": memory, "bound": max(compute, memory)}


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
# XLA:GPU and XLA:CPU refuse nothing for memory.
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
