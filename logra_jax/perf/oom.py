"""What XLA says a program needs, in bytes of one device: the one place its words are read.

Three sources, each the compiler's or the runtime's own figure, never an estimate of ours:

- the TPU compiler's refusal of a program over a device's HBM (`compile_or_refuse` →
  `DoesNotFit`, with what it needs and what the device has);
- what a GPU (or XLA:CPU) states when it runs out: its rematerialization pass's warning or the
  allocator's RESOURCE_EXHAUSTED message (`xla_needs`: launch.step_time --peak_memory reports an
  update that does not fit with it);
- XLA's ahead-of-time plan of a program it compiled (`planned_peak`).

XLA:GPU and XLA:CPU refuse nothing at compile time: over budget they warn and plan past it.
"""

from __future__ import annotations

import re

# XLA's byte units are binary whichever way it writes them: "15.75G" (the TPU compiler), "80.10GiB".
_UNITS = {"": 1, "K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30, "T": 2 ** 40}
_NUMBER = r"([\d.]+)\s*([KMGT]?)(?:i?B)?"
# The TPU compiler's two wordings of an over-budget program: the whole program's use, or its
# temporaries alone ("the total memory required for HLO temporaries (X) exceeds available HBM (Y)").
_TPU_REFUSALS = (re.compile(rf"Used {_NUMBER} of {_NUMBER} hbm"),
                 re.compile(rf"required for .*?\({_NUMBER}\) exceeds available HBM \({_NUMBER}\)"))
# What a runtime states a program needs, most specific first: the rematerialization pass's "...;
# only reduced to 167.29GiB" (the whole program), then an allocator's "Out of memory while trying
# to allocate 80.10GiB" (one buffer: a lower bound).
_XLA_NEEDS = (re.compile(rf"only reduced to {_NUMBER}"),
              re.compile(rf"trying to allocate {_NUMBER}"))


def _bytes(number: str, unit: str) -> int:
    return int(float(number) * _UNITS[unit])


class DoesNotFit(Exception):
    """The TPU compiler refused a program over its HBM budget: needs ``needed`` of ``available``.

    One of the compiler's two refusals counts the program's temporaries alone
    (``counts_arguments=False``); `with_arguments` adds the arguments' bytes, known from shapes."""

    def __init__(self, needed: int, available: int, message: str, program: str = "the program",
                 counts_arguments: bool = True):
        super().__init__(message)
        self.needed, self.available, self.program = needed, available, program
        self.counts_arguments = counts_arguments

    def with_arguments(self, arguments: int) -> DoesNotFit:
        """The refusal with ``needed`` covering the program's arguments too."""
        if self.counts_arguments:
            return self
        return DoesNotFit(self.needed + arguments, self.available, str(self), self.program)


def compile_or_refuse(lowered, program: str = "the program", **kwargs):
    """``lowered.compile(**kwargs)``; the compiler's out-of-HBM refusal of ``program`` (its name in
    messages) as `DoesNotFit`."""
    try:
        return lowered.compile(**kwargs)
    except Exception as e:  # JaxRuntimeError: RESOURCE_EXHAUSTED, raised by the compiler
        text = str(e)
        match = next(filter(None, (r.search(text) for r in _TPU_REFUSALS)), None)
        if match is None:
            raise
        used, used_unit, total, total_unit = match.groups()
        raise DoesNotFit(_bytes(used, used_unit), _bytes(total, total_unit),
                         text.strip().splitlines()[0], program,
                         counts_arguments="temporaries" not in match.group(0)) from None


def xla_needs(text: str) -> tuple[int, str] | None:
    """(bytes, XLA's sentence) of the first statement of ``_XLA_NEEDS`` in ``text``, else None."""
    for pattern in _XLA_NEEDS:
        match = pattern.search(text)
        if match:
            line = next(line for line in text.splitlines() if match.group(0) in line)
            return _bytes(*match.groups()), line.strip()
    return None


def planned_peak(analysis) -> int:
    """The peak bytes of one device by XLA's ``memory_analysis()`` of a compiled program: its
    arguments and outputs (less what the outputs alias: donated params and optimizer state) and
    its temporaries."""
    return (analysis.argument_size_in_bytes + analysis.output_size_in_bytes
            - analysis.alias_size_in_bytes + analysis.temp_size_in_bytes)
