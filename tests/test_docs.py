"""The README and docs/ stay true: links resolve, paths and tests they cite exist, the README stays a
front door, no page cites issue numbers or commits, and every launch command the README names runs.

Reads files only, except one ``--help`` subprocess per ``python -m launch.*`` module the README
names (all started at once; absl parses flags before any of them imports jax: ~1 s in all).
"""

import pathlib
import re
import subprocess
import sys
import unicodedata

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").rglob("*.md"))]
README_MAX_LINES = 220

_FENCE = re.compile(r"^(`{3,}|~{3,}).*?^\1[ \t]*$", re.MULTILINE | re.DOTALL)
_INLINE_CODE = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def _prose(text: str) -> str:
    """Markdown without code blocks and inline code: where links are links."""
    return _INLINE_CODE.sub("", _FENCE.sub("", text))


def _rel(path: pathlib.Path) -> str:
    return str(path.relative_to(ROOT))


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: its rendered text lower-cased, every character that is not
    a letter, digit, mark, space, hyphen or underscore dropped, spaces turned into hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)   # links → their text
    text = text.replace("`", "").replace("*", "").strip().lower()
    keep = [c for c in text if c in " -_" or unicodedata.category(c)[0] in "LNM"]
    return "".join(keep).replace(" ", "-")


def anchors(path: pathlib.Path) -> set[str]:
    """Every heading's anchor in a Markdown file; repeated slugs get -1, -2, … as on GitHub."""
    seen: dict[str, int] = {}
    out = set()
    for line in _FENCE.sub("", path.read_text()).splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        slug = github_slug(m.group(1))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def test_github_slug_follows_githubs_rules():
    assert github_slug("Policy sync: trainer → rollout engine") == "policy-sync-trainer--rollout-engine"
    assert github_slug("Planning memory: `shape:` plans and `launch.memory`") == \
        "planning-memory-shape-plans-and-launchmemory"
    assert github_slug("2. The random projection A") == "2-the-random-projection-a"
    assert github_slug("Tried, not kept") == "tried-not-kept"


def _links():
    for page in PAGES:
        for target in _LINK.findall(_prose(page.read_text())):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):   # http:, https:, mailto:
                continue
            yield page, target


@pytest.mark.parametrize("page,target", [pytest.param(p, t, id=f"{_rel(p)}->{t}") for p, t in _links()])
def test_every_relative_link_resolves(page, target):
    path_part, _, anchor = target.partition("#")
    resolved = (page.parent / path_part).resolve() if path_part else page
    assert resolved.exists(), f"{_rel(page)} links to {target}: {path_part} does not exist"
    if anchor and resolved.suffix == ".md":
        assert anchor in anchors(resolved), (
            f"{_rel(page)} links to {target}: {_rel(resolved)} has no heading with that anchor "
            f"(its anchors: {sorted(anchors(resolved))})")


def test_the_readme_stays_a_front_door():
    lines = README.read_text().count("\n")
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines (budget {README_MAX_LINES}): move evidence to a docs/ page "
        "and link it")
    for command in ("make train", "make test"):
        assert command in README.read_text()


def _code_map() -> str:
    text = README.read_text()
    return text[text.index("## Code layout"):text.index("## Docs")]


# Folders whose map line names each of their modules; elsewhere a subpackage is named as a folder.
MAPPED_BY_MODULE = ("logra_jax", "launch", "logra_jax/config", "logra_jax/perf", "logra_jax/rl")


def test_the_readme_code_map_names_every_module():
    """Each module of the folders the map lists file by file is named there (its file name
    without ``.py``), and every subpackage by its folder: a new module joins the map."""
    code_map = _code_map()
    missing = []
    for folder in MAPPED_BY_MODULE:
        for path in sorted((ROOT / folder).iterdir()):
            if path.suffix in (".py", ".sh") and path.stem != "__init__":
                if not re.search(rf"\b{re.escape(path.stem)}\b", code_map):
                    missing.append(f"{folder}/{path.name}")
            elif (path / "__init__.py").exists() and f"{path.name}/" not in code_map:
                missing.append(f"{folder}/{path.name}/")
    assert not missing, f"README.md's code map does not name {missing}"


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_no_page_cites_issue_numbers_or_commits(page):
    text = page.read_text()
    issues = re.findall(r"(?<![\w&(/])#\d+\b", text)
    assert not issues, f"{_rel(page)} cites {issues}: a reader cannot resolve issue numbers; say what they said"
    commits = [w for w in re.findall(r"\b[0-9a-f]{7,40}\b", text)
               if re.search(r"[a-f]", w) and re.search(r"\d", w)]
    assert not commits, f"{_rel(page)} names commits {commits}: say what changed instead"


_REPO_PATH = re.compile(r"\b((?:logra_jax|launch|configs|tests|docs)/[\w./-]*\.(?:py|sh|md|png))(?:::(\w+))?")


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_every_file_and_test_a_page_names_exists(page):
    """Evidence must be in the repository: each path like launch/x.py, tests/test_y.py::test_z."""
    missing = []
    for path, test in _REPO_PATH.findall(page.read_text()):
        file = ROOT / path
        if not file.exists():
            missing.append(path)
        elif test and not re.search(rf"^\s*def {test}\b", file.read_text(), re.MULTILINE):
            missing.append(f"{path}::{test}")
    assert not missing, f"{_rel(page)} names what the repository does not hold: {missing}"


# `--help` of every launch module the README names. absl prints the usage and exits with status 1
# (absl.app.HelpFlag: `_exit_before_main(1)`), for every absl program: the test asks for the usage.
_MODULES = sorted(set(re.findall(r"python -m launch\.(\w+)", README.read_text())))
@pytest.fixture(scope="module")
def help_outputs():
    procs = {m: subprocess.Popen([sys.executable, "-m", f"launch.{m}", "--help"], cwd=ROOT,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for m in _MODULES}
    out = {}
    for m, p in procs.items():
        stdout, stderr = p.communicate(timeout=120)
        out[m] = (p.returncode, stdout, stderr)
    return out


def test_the_readme_names_launch_commands():
    assert {"train", "memory", "export", "evaluate"} <= set(_MODULES)


@pytest.mark.parametrize("module", _MODULES)
def test_every_launch_command_in_the_readme_prints_its_help(module, help_outputs):
    returncode, stdout, stderr = help_outputs[module]
    assert returncode in (0, 1) and "Try --helpfull" in stdout and "flags:" in stdout, (
        f"python -m launch.{module} --help: status {returncode}\n{stdout[-2000:]}\n{stderr[-2000:]}")
