"""Which flax imports with which jax: the one pairing pip cannot check for us.

A flax release declares only a lower bound on jax (flax 0.12.8: ``jax>=0.10.0``), never an upper
one, so pip will pair an older flax with a newer jax and call it consistent. One such pair is known
broken: flax 0.12.8 with jax 0.11.2 fails at ``import flax.nnx`` (``AttributeError: module
'jax.experimental.hijax' has no attribute 'HiPrimitive'``, flax/nnx/variablelib.py) — what a GPU
machine carrying its own CUDA jax 0.11.2 got from this project's earlier pin ``flax==0.12.8``.

`FIRST_FLAX` records, per jax minor, the oldest flax known to import and run with it, and where that
is known from. pyproject.toml admits a range of jax and of flax; tests/test_install.py checks that
every jax minor the range admits is in this table and has an admitted flax at or above its floor
(`contradictions`), and `check_installed` (run when ``logra_jax`` is imported) turns the known-broken
pairs into one clear error instead of a traceback from inside flax. The newer side is left to flax's
own metadata: a flax that needs a newer jax raises its own lower bound, which pip does enforce.
"""

from __future__ import annotations

import importlib.metadata
from typing import NamedTuple

from packaging.specifiers import SpecifierSet
from packaging.version import Version


class FlaxFloor(NamedTuple):
    flax: str        # the oldest flax known to import and run with this jax minor
    evidence: str    # where that is known from


FIRST_FLAX: dict[tuple[int, int], FlaxFloor] = {
    (0, 10): FlaxFloor("0.12.8", "jax 0.10.2 + flax 0.12.8: this repository's test suite (`make "
                                 "test`); no older flax was tried"),
    (0, 11): FlaxFloor("0.12.10", "jax 0.11.2 on one H200, 2026-12-04 (docs/results/gpu.md): flax "
                                  "0.12.8 fails at `import flax.nnx` (jax.experimental.hijax has "
                                  "no HiPrimitive), flax 0.12.10 imports and trains; 0.12.9 was "
                                  "not tried"),
}


def _minor(version: str) -> tuple[int, int]:
    release = Version(version).release
    return release[0], release[1] if len(release) > 1 else 0


def broken_pair(jax_version: str, flax_version: str) -> str | None:
    """Why ``flax_version`` cannot run with ``jax_version`` (None: nothing known against it): the
    flax is older than the floor `FIRST_FLAX` holds for that jax minor."""
    floor = FIRST_FLAX.get(_minor(jax_version))
    if floor is None or Version(flax_version) >= Version(floor.flax):
        return None
    return (f"flax {flax_version} does not work with jax {jax_version}: jax "
            f"{'.'.join(map(str, _minor(jax_version)))} needs flax >= {floor.flax} ({floor.evidence})")


def _admitted_versions(spec: SpecifierSet, majors=(0, 1), minors=100, patches=30):
    """Candidate versions X.Y.Z a specifier admits, with X.Y.Z small enough to enumerate."""
    return [f"{a}.{b}.{c}" for a in majors for b in range(minors) for c in range(patches)
            if spec.contains(f"{a}.{b}.{c}")]


def contradictions(jax_spec: str, flax_spec: str) -> list[str]:
    """What the pair of requirement ranges promises without evidence, one line each: a jax minor
    they admit that `FIRST_FLAX` does not cover, or one whose floor no admitted flax reaches. An
    empty list: every admitted jax has an admitted flax known to import with it."""
    jax_admits, flax_admits = SpecifierSet(jax_spec), SpecifierSet(flax_spec)
    problems = []
    jax_minors = sorted({_minor(v) for v in _admitted_versions(jax_admits)})
    unknown = [".".join(map(str, minor)) for minor in jax_minors if minor not in FIRST_FLAX]
    if unknown:
        shown = ", ".join(unknown[:3]) + (f" and {len(unknown) - 3} more" if len(unknown) > 3 else "")
        problems.append(f"jax {shown} admitted (jax{jax_spec}), but no flax is known to work with "
                        "it: add the evidence to logra_jax/versions.py, or bound jax")
    for minor in jax_minors:
        name = "jax " + ".".join(map(str, minor))
        floor = FIRST_FLAX.get(minor)
        if floor is not None and not any(Version(v) >= Version(floor.flax)
                     for v in _admitted_versions(flax_admits)):
            problems.append(f"{name} is admitted (jax{jax_spec}), but every admitted flax"
                            f"{flax_spec} is older than {floor.flax}, the first that works with "
                            f"it ({floor.evidence})")
    return problems


def check_installed() -> None:
    """Raises ImportError with one ``error:`` line when the installed jax and flax are a pair known
    not to work (read from their metadata: nothing is imported). Quiet when either is missing."""
    try:
        jax_version = importlib.metadata.version("jax")
        flax_version = importlib.metadata.version("flax")
    except importlib.metadata.PackageNotFoundError:
        return
    why = broken_pair(jax_version, flax_version)
    if why:
        floor = FIRST_FLAX[_minor(jax_version)].flax
        raise ImportError(f"error: {why}. Install a flax that does, keeping this jax: "
                          f"pip install 'flax>={floor},<0.13' (docs/gpu.md)")
