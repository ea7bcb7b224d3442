"""README.md and README_zh.md list the same commands, every `make X` they name exists, and README.md
stays short."""

import re
import shutil
import subprocess
from functools import lru_cache
from pathlib import Path

import pytest
from conftest import time_limit

REPO = Path(__file__).resolve().parent.parent
EN, ZH = REPO / "README.md", REPO / "README_zh.md"
MAX_README_LINES = 220

FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
INLINE = re.compile(r"`([^`\n]+)`")
MAKE = re.compile(r"(?<![\w-])make ([a-z][a-z0-9-]*)")


def fenced_commands(text: str) -> set[str]:
    """Every command line of every fenced block, comments and extra spaces removed."""
    found = set()
    for block in FENCE.findall(text):
        for line in block.splitlines():
            # a trailing comment (the language differs between editions)
            line = re.sub(r"\s+#.*$", "", line).strip()
            if line and not line.startswith("#"):
                found.add(" ".join(line.split()))
    return found


def inline_make(text: str) -> set[str]:
    """Inline code spans outside fenced blocks that run make."""
    prose = FENCE.sub("", text)
    return {" ".join(span.split()) for span in INLINE.findall(prose) if MAKE.search(span)}


def make_targets(text: str) -> set[str]:
    """Targets named as `make <target>` in fenced blocks and inline code spans (prose words are not
    commands)."""
    spans = FENCE.findall(text) + INLINE.findall(FENCE.sub("", text))
    return {target for span in spans for target in MAKE.findall(span)}


def test_both_editions_exist_and_link_each_other():
    assert EN.read_text().splitlines()[0].strip() == "[中文](README_zh.md)"
    assert ZH.read_text().splitlines()[0].strip() == "[English](README.md)"


def test_both_editions_list_the_same_commands():
    en, zh = EN.read_text(), ZH.read_text()
    assert fenced_commands(en) == fenced_commands(zh), fenced_commands(en) ^ fenced_commands(zh)
    assert inline_make(en) == inline_make(zh), inline_make(en) ^ inline_make(zh)
    assert make_targets(en) == make_targets(zh), make_targets(en) ^ make_targets(zh)


def test_the_two_setup_commands_are_there():
    for readme in (EN, ZH):
        commands = fenced_commands(readme.read_text())
        assert {"make demo", "make test"} <= commands, readme.name


@lru_cache(maxsize=1)
def makefile_targets() -> tuple[set[str], list[re.Pattern]]:
    """Explicit targets and pattern rules (cifar-%gpu style) from make's own database, generated
    ones included."""
    out = subprocess.run(
        ["make", "-pRrq", "-f", "Makefile", ":"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=time_limit(60),
    ).stdout
    names = {m.group(1) for m in re.finditer(r"^([A-Za-z0-9_%./-]+):(?!=)", out, re.M)}
    patterns = [re.compile(re.escape(n).replace("%", ".+") + "$") for n in names if "%" in n]
    return {n for n in names if "%" not in n}, patterns


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_every_make_target_named_exists():
    explicit, patterns = makefile_targets()
    named = make_targets(EN.read_text()) | make_targets(ZH.read_text())
    assert {"demo", "test", "cifar-1gpu", "cifar-2node"} <= named
    missing = {t for t in named if t not in explicit and not any(p.match(t) for p in patterns)}
    assert not missing, f"README names make targets the Makefile lacks: {sorted(missing)}"


def test_readme_stays_short():
    lines = len(EN.read_text().splitlines())
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines; move detail into docs/"


def test_extraction_sees_what_it_should():
    text = "`make cifar-8gpu` and make sense\n```bash\nmake doctor NODE_RANK=0   # on node 0\n# note\n```\n"
    assert fenced_commands(text) == {"make doctor NODE_RANK=0"}
    assert inline_make(text) == {"make cifar-8gpu"}
    assert make_targets(text) == {"cifar-8gpu", "doctor"}
