"""Every ```python block of README.md and docs/*.md runs (CPU, small sizes).

The team convention: blocks of one file run in order in one namespace, in one fresh Python
process with the repository root as cwd. That process has the environment
`torchrun --nproc_per_node 1` gives (RANK=0, WORLD_SIZE=1, LOCAL_RANK=0, MASTER_ADDR/PORT), plus
DS_ACCELERATOR=cpu and, without a GPU, TRITON_INTERPRET=1. A block that cannot run so (needs a
GPU, several ranks, a download) is preceded by the line `<!-- norun: reason -->` directly
above its fence. A failure names the file and the line of the block's fence; tracebacks point
at lines of the Markdown file itself.
"""
from __future__ import annotations

import glob
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch

from helpers import ROOT, free_port

FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)")
NORUN = re.compile(r"^\s*<!--\s*norun\s*:\s*(.*?)\s*-->\s*$")


@dataclass(frozen=True)
class Block:
    """One fenced code block of a Markdown file."""

    path: str  # file, relative to the repository root
    line: int  # 1-based line of the opening fence
    lang: str  # the fence's info string ("python", "bash", "")
    code: str  # the block's text
    norun: str | None  # the reason given by a `<!-- norun: reason -->` line directly above, else None


def parse_blocks(path: str, text: str) -> list[Block]:
    """Fenced blocks of `text`; raises ValueError (naming file and line) for an unclosed fence,
    a norun marker without a reason, and a marker that is not directly above a fence."""
    lines = text.splitlines()
    blocks, i = [], 0
    while i < len(lines):
        if re.match(r"^\s*<!--\s*norun\b", lines[i]):
            marker = NORUN.match(lines[i])
            if not marker or not marker.group(1):
                raise ValueError(f"{path}:{i + 1}: norun marker needs a reason: `<!-- norun: reason -->`")
            if i + 1 >= len(lines) or not FENCE.match(lines[i + 1]):
                raise ValueError(f"{path}:{i + 1}: norun marker must be the line directly above a code fence")
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = m.groups()
        start = i
        i += 1
        body = []
        while i < len(lines) and not re.match(rf"^\s*{re.escape(fence[0])}{{{len(fence)},}}\s*$", lines[i]):
            body.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i].lstrip())
            i += 1
        if i >= len(lines):
            raise ValueError(f"{path}:{start + 1}: code fence is never closed")
        prev = NORUN.match(lines[start - 1]) if start > 0 else None
        blocks.append(Block(path, start + 1, lang.lower(), "\n".join(body) + "\n", prev.group(1) if prev else None))
        i += 1
    return blocks


def doc_files() -> list[str]:
    return ["README.md"] + sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))


# The child: runs the blocks it is given, each compiled under its Markdown file's name with its
# lines where they are in that file, and reports the first failure by file and fence line.
_RUNNER = r"""
import json, os, sys, traceback
blocks = json.load(sys.stdin)
namespace = {"__name__": "__main__"}
for b in blocks:
    source = "\n" * b["line"] + b["code"]
    try:
        exec(compile(source, b["path"], "exec"), namespace)
    except BaseException:
        sys.stderr.write(f"\n{b['path']}: the ```python block at line {b['line']} failed:\n{traceback.format_exc()}")
        sys.exit(1)
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)  # done: a gloo group left by a snippet must not abort interpreter finalization
"""


def run_blocks(blocks: list[Block], timeout: int = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1",
           "DS_ACCELERATOR": "cpu", "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    payload = json.dumps([{"path": b.path, "line": b.line, "code": b.code} for b in blocks])
    return subprocess.run([sys.executable, "-c", _RUNNER], input=payload, cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.slow
@pytest.mark.parametrize("path", doc_files())
def test_python_blocks_run(path):
    blocks = [b for b in parse_blocks(path, open(os.path.join(ROOT, path)).read()) if b.lang in ("python", "py")]
    runnable = [b for b in blocks if b.norun is None]
    if not runnable:
        pytest.skip(f"{path}: no runnable ```python block ({len(blocks)} marked norun)")
    proc = run_blocks(runnable)
    if proc.returncode != 0:
        pytest.fail(f"{path}: a ```python block failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n"
                    f"{proc.stderr[-6000:]}", pytrace=False)


def github_anchor(heading: str) -> str:
    """The fragment GitHub gives a Markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def test_links_to_doc_sections_resolve():
    """`[..](docs/x.md#section)` links (the README's benchmark rows) name existing headings."""
    missing = []
    for path in doc_files():
        text = open(os.path.join(ROOT, path)).read()
        for target, anchor in re.findall(r"\]\(([^)#\s]*\.md)?#([^)\s]+)\)", text):
            file = os.path.normpath(os.path.join(os.path.dirname(path), target)) if target else path
            if not os.path.isfile(os.path.join(ROOT, file)):
                missing.append(f"{path}: link to missing file {file}")
                continue
            headings = re.findall(r"^#+\s+(.*)$", open(os.path.join(ROOT, file)).read(), flags=re.M)
            if anchor not in {github_anchor(h) for h in headings}:
                missing.append(f"{path}: no heading for #{anchor} in {file}")
    assert not missing, "\n".join(missing)


# -- the harness itself ------------------------------------------------------------------------

def test_parse_blocks_marks_and_lines():
    text = ("# t\n\n```python\nx = 1\n```\n<!-- norun: needs a GPU -->\n```python\ny = 2\n```\n"
            "- item\n  ```bash\n  ls\n  ```\n")
    blocks = parse_blocks("t.md", text)
    assert [(b.line, b.lang, b.norun) for b in blocks] == [(3, "python", None), (7, "python", "needs a GPU"),
                                                          (11, "bash", None)]
    assert blocks[0].code == "x = 1\n" and blocks[2].code == "ls\n"


@pytest.mark.parametrize("text, message", [
    ("<!-- norun -->\n```python\nx\n```\n", "needs a reason"),
    ("<!-- norun: gpu -->\n\n```python\nx\n```\n", "directly above"),
    ("```python\nx = 1\n", "never closed"),
])
def test_parse_blocks_rejects_bad_markup(text, message):
    with pytest.raises(ValueError, match=message):
        parse_blocks("bad.md", text)


def test_failure_names_file_and_fence_line():
    blocks = [Block("docs/x.md", 3, "python", "a = 1\n", None),
              Block("docs/x.md", 10, "python", "b = a\nc = nope\n", None)]
    proc = run_blocks(blocks, timeout=60)
    assert proc.returncode == 1
    assert "docs/x.md: the ```python block at line 10 failed" in proc.stderr
    assert 'File "docs/x.md", line 12' in proc.stderr and "NameError" in proc.stderr
