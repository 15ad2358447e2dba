"""What XLA says a program needs, in bytes of one device: its ahead-of-time plan of a compiled
program, and the figure it states when it refuses one (a log line or a RESOURCE_EXHAUSTED message).
launch.step_time --peak_memory reports an update that does not fit with these figures.
"""

import re

# XLA's own statements of what a program needs, most specific first: the rematerialization pass's
# "...; only reduced to 167.29GiB" (the whole program), then an allocator's "Out of memory while
# trying to allocate 80.10GiB" (one buffer: a lower bound).
_XLA_NEEDS = (re.compile(r"only reduced to ([0-9.]+)\s*([KMGT]i?B)"),
              re.compile(r"trying to allocate ([0-9.]+)\s*([KMGT]i?B)"))
_UNITS = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def xla_needs(text: str) -> tuple[int, str] | None:
    """(bytes, XLA's sentence) of the first statement of ``_XLA_NEEDS`` in ``text``, else None."""
    for pattern in _XLA_NEEDS:
        match = pattern.search(text)
        if match:
            line = next(line for line in text.splitlines() if match.group(0) in line)
            return int(float(match.group(1)) * _UNITS[match.group(2)[0]]), line.strip()
    return None


def planned_peak(analysis) -> int:
    """The peak bytes of one device by XLA's ``memory_analysis()`` of a compiled program: its
    arguments and outputs (less what the outputs alias: donated params and optimizer state) and
    its temporaries."""
    return (analysis.argument_size_in_bytes + analysis.output_size_in_bytes
            - analysis.alias_size_in_bytes + analysis.temp_size_in_bytes)
