"""The line shapes of XLA's optimized HLO text (``compiled.as_text()``) that its readers share.

profiling.py (where wall time goes) and matmul_count.py (how many product operations run) both
walk the same text: computations, their instructions, and which computations an instruction
runs. The patterns live here once.
"""

import re

# "%name = <type> opcode(...), attributes": group 1 the name, group 2 the rest.
INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%([^\s=]+)\s*=\s*(.*)$")
# A computation's header, "[ENTRY ]%name (params) -> type {": group 1 the name. A header line
# ends with "{" (check it: an instruction's attributes may start the same way).
COMPUTATION = re.compile(r"^\s*(?:ENTRY\s+)?%([^\s(]+)\s*\(")
# The computations an instruction runs: a fusion's or call's body, a loop's body and condition,
# a reduction's combiner (group 1 the kind, group 2 the computation), and a conditional's branches.
CALLED = re.compile(r"\b(calls|body|condition|to_apply)=%([^\s,}]+)")
BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
