"""Every ```python block of README.md and docs/*.md runs alone, as its text says to run it.

The convention: a ```python block is a whole program, with its own imports and
objects. The line directly above its fence ends with "run with `COMMAND`:", the command a
reader types to run the block saved as the file it names, one of

    python NAME.py
    torchrun --nproc_per_node N NAME.py
    [VAR=value ...] deepspeed --num_accelerators N NAME.py

(leading VAR=value words are the command's environment, e.g. DS_ACCELERATOR=cpu). The test
writes the block to NAME.py in a fresh temporary directory, never the repository (shipped files
must be found the way an install finds them), and runs the command there in a fresh process:
`python` is this interpreter, `torchrun` is torch.distributed.run and `deepspeed` is the
DeepSpeed launcher beside it, both on a free port (ranks talk over gloo without a GPU). The
environment is the caller's without torchrun's rank variables, plus coat_ds on PYTHONPATH (as
an install puts it on the path), one OpenMP thread and, without a GPU, TRITON_INTERPRET=1.
Each block starts processes of its own, so each is a slow test. A block that cannot run so (needs a GPU, a
download) has the line `<!-- norun: reason -->` directly above its fence instead; a
```python block with neither line fails, naming its file and line. A failure names the file
and the fence's line; tracebacks point at lines of the Markdown file itself.

Shell blocks are not run; `test_shell_commands_chain` checks that a command that reads a
checkpoint or a plan file comes after the command that writes it.
"""
from __future__ import annotations

import glob
import importlib.util
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch

from helpers import ROOT, free_port

FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)")
NORUN = re.compile(r"^\s*<!--\s*norun\s*:\s*(.*?)\s*-->\s*$")
RUN_LINE = re.compile(r"\b[Rr]un with `([^`]+)`:\s*$")
PYTHON = ("python", "py")
RANK_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                  "MASTER_PORT", "TORCHELASTIC_RUN_ID")


@dataclass(frozen=True)
class Block:
    """One fenced code block of a Markdown file."""

    path: str  # file, relative to the repository root
    line: int  # 1-based line of the opening fence
    lang: str  # the fence's info string ("python", "bash", "")
    code: str  # the block's text
    norun: str | None  # the reason given by a `<!-- norun: reason -->` line directly above, else None
    run: str | None = None  # the command of a "run with `COMMAND`:" line directly above, else None


@dataclass(frozen=True)
class Command:
    """A run line's command: the launcher, its number of ranks, the script and extra environment."""

    launcher: str  # "python", "torchrun" or "deepspeed"
    nproc: int
    script: str  # NAME.py, the file the block is saved as
    env: tuple[tuple[str, str], ...] = ()


# The launchers a run line may name, each with the one flag that gives its number of ranks.
LAUNCHERS = {"python": None, "torchrun": "--nproc_per_node", "deepspeed": "--num_accelerators"}


def parse_command(text: str) -> Command:
    """A run line's command; raises ValueError saying what is allowed for anything else."""
    allowed = ("allowed: `python NAME.py`, `torchrun --nproc_per_node N NAME.py`, "
               "`[VAR=value ...] deepspeed --num_accelerators N NAME.py`")
    words = shlex.split(text)
    env = []
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):
        env.append(tuple(words.pop(0).split("=", 1)))
    if not words or words[0] not in LAUNCHERS:
        raise ValueError(f"run command `{text}`: unknown launcher; {allowed}")
    launcher, rest = words[0], words[1:]
    nproc = 1
    flag = LAUNCHERS[launcher]
    if flag is not None:
        if len(rest) < 2 or rest[0] != flag or not rest[1].isdigit() or int(rest[1]) < 1:
            raise ValueError(f"run command `{text}`: {launcher} needs `{flag} N` first; {allowed}")
        nproc, rest = int(rest[1]), rest[2:]
    if len(rest) != 1 or not re.fullmatch(r"\w+\.py", rest[0]):
        raise ValueError(f"run command `{text}`: must end with the script, NAME.py, and nothing after; {allowed}")
    stem = rest[0][:-3]
    if stem in sys.stdlib_module_names or importlib.util.find_spec(stem) is not None:
        raise ValueError(f"run command `{text}`: a script named {rest[0]} would shadow the module {stem}")
    return Command(launcher, nproc, rest[0], tuple(env))


def parse_blocks(path: str, text: str) -> list[Block]:
    """Fenced blocks of `text`; raises ValueError (naming file and line) for an unclosed fence,
    a norun marker without a reason, a marker or run line that is not directly above a fence
    (a run line: a ```python fence), a bad run command, and a ```python block with neither."""
    lines = text.splitlines()
    blocks, i = [], 0
    while i < len(lines):
        nxt = FENCE.match(lines[i + 1]) if i + 1 < len(lines) else None
        if re.match(r"^\s*<!--\s*norun\b", lines[i]):
            marker = NORUN.match(lines[i])
            if not marker or not marker.group(1):
                raise ValueError(f"{path}:{i + 1}: norun marker needs a reason: `<!-- norun: reason -->`")
            if not nxt:
                raise ValueError(f"{path}:{i + 1}: norun marker must be the line directly above a code fence")
        elif RUN_LINE.search(lines[i]) and not FENCE.match(lines[i]):
            if not nxt or nxt.group(3).lower() not in PYTHON:
                raise ValueError(f"{path}:{i + 1}: a run line must be the line directly above a ```python fence")
            try:
                parse_command(RUN_LINE.search(lines[i]).group(1))
            except ValueError as e:
                raise ValueError(f"{path}:{i + 1}: {e}") from None
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
        above = lines[start - 1] if start > 0 else ""
        norun, run = NORUN.match(above), RUN_LINE.search(above)
        if lang.lower() in PYTHON and not norun and not run:
            raise ValueError(f"{path}:{start + 1}: a ```python block needs, on the line directly above its fence, "
                             "one ending with \"run with `COMMAND`:\" (e.g. run with `python example.py`:) "
                             "or `<!-- norun: reason -->`")
        blocks.append(Block(path, start + 1, lang.lower(), "\n".join(body) + "\n", norun.group(1) if norun else None,
                            run.group(1) if run else None))
        i += 1
    return blocks


def doc_files() -> list[str]:
    return ["README.md"] + sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))


def doc_blocks(path: str) -> list[Block]:
    with open(os.path.join(ROOT, path)) as f:
        return parse_blocks(path, f.read())


def launch_argv(cmd: Command, port: int) -> list[str]:
    if cmd.launcher == "python":
        return [sys.executable, cmd.script]
    if cmd.launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(cmd.nproc),
                "--master_port", str(port), cmd.script]
    return [os.path.join(os.path.dirname(sys.executable), "deepspeed"), "--num_accelerators", str(cmd.nproc),
            "--master_port", str(port), cmd.script]


def run_block(block: Block, workdir: str, timeout: int = 420) -> str | None:
    """Save `block` as its run line's script in `workdir` and run its command there; None when
    it exits 0, else what went wrong, tracebacks pointing at the Markdown file's lines."""
    cmd = parse_command(block.run)
    with open(os.path.join(workdir, cmd.script), "w") as f:
        f.write(block.code)
    env = {k: v for k, v in os.environ.items() if k not in RANK_VARIABLES}
    env.update(PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    env.update(dict(cmd.env))
    proc = subprocess.run(launch_argv(cmd, free_port()), cwd=workdir, env=env, capture_output=True, text=True,
                          timeout=timeout)
    if proc.returncode == 0:
        return None
    in_doc = re.compile(rf'File "[^"]*\b{re.escape(cmd.script)}", line (\d+)')
    out = in_doc.sub(lambda m: f'File "{block.path}", line {block.line + int(m.group(1))}',
                     f"{proc.stdout[-3000:]}\n{proc.stderr[-8000:]}")
    return (f"{block.path}: the ```python block at line {block.line} failed (`{block.run}` exited "
            f"{proc.returncode}):\n{out}")


def _python_block_params():
    params = []
    for path in doc_files():
        try:
            blocks = doc_blocks(path)
        except ValueError:
            continue  # test_docs_parse names it
        for b in blocks:
            if b.lang not in PYTHON:
                continue
            marks = [pytest.mark.skip(reason=f"norun: {b.norun}")] if b.norun is not None else []
            params.append(pytest.param(b, id=f"{b.path}:{b.line}", marks=marks))
    return params


@pytest.mark.parametrize("path", doc_files())
def test_docs_parse(path):
    """Every doc's fences, norun markers and run lines are well formed; every ```python block
    says how it runs."""
    doc_blocks(path)


@pytest.mark.slow
@pytest.mark.parametrize("block", _python_block_params())
def test_python_block_runs_alone(block, tmp_path):
    failure = run_block(block, str(tmp_path))
    if failure:
        pytest.fail(failure, pytrace=False)


# -- shell commands: what a command reads, an earlier command of the same file writes ---------

def shell_commands(path: str) -> list[tuple[int, list[str]]]:
    """(line, words) of each command line of the shell blocks (```bash, ```sh, plain ```) of
    a doc, in order; backslash continuations joined, comments dropped."""
    out = []
    for b in doc_blocks(path):
        if b.lang not in ("bash", "sh", "shell", "console", ""):
            continue
        lines = b.code.splitlines()
        j = 0
        while j < len(lines):
            first, text = j, lines[j]
            while text.endswith("\\") and j + 1 < len(lines):
                j += 1
                text = text[:-1] + " " + lines[j]
            j += 1
            if "--resume" not in text and "--plan" not in text and "--save-dir" not in text:
                continue  # only these commands matter here; other lines may not even be shell
            out.append((b.line + 1 + first, shlex.split(text, comments=True)))
    return out


def _flag(words: list[str], name: str) -> str | None:
    """The value after `name` in `words`, or None."""
    for k, w in enumerate(words[:-1]):
        if w == name and not words[k + 1].startswith("--"):
            return words[k + 1]
    return None


def _train_engine(words: list[str]) -> str:
    return "fsdp" if "--fsdp" in words or _flag(words, "--engine") == "fsdp" else "deepspeed"


def _writes_checkpoint(words: list[str], consumer: list[str], target: str) -> bool:
    """`words` (a train.py command) writes the checkpoint or save folder `target` that
    `consumer` (a train.py command) resumes: same engine and config, `--save-dir`, and for a
    `DIR/stepN` target an N that `--max-steps M` and `--save-interval K` make it save (the last
    step, and every K-th). Without `--max-steps` we cannot know N is reached: not accepted."""
    if "train.py" not in words or _train_engine(words) != _train_engine(consumer):
        return False
    if _flag(words, "--config") != _flag(consumer, "--config"):
        return False
    save_dir = _flag(words, "--save-dir")
    if save_dir is None:
        return False
    target = os.path.normpath(target)
    if target == os.path.normpath(save_dir):
        return True
    head, tail = os.path.split(target)
    step = re.fullmatch(r"step(\d+)", tail)
    max_steps, interval = _flag(words, "--max-steps"), _flag(words, "--save-interval") or "0"
    if head != os.path.normpath(save_dir) or not step or max_steps is None:
        return False
    n, m, k = int(step.group(1)), int(max_steps), int(interval)
    return n == m or (0 < n < m and k > 0 and n % k == 0)


def _writes_plan(words: list[str], consumer: list[str], target: str) -> bool:
    """`words` is `python -m coat_ds.profile --plan ... --out DIR` for the model of the
    consumer's `--config`, which writes DIR/plan.json."""
    if "coat_ds.profile" not in words or "--plan" not in words or _flag(words, "--out") is None:
        return False
    if _flag(words, "--model") != _flag(consumer, "--config"):
        return False
    return os.path.normpath(target) == os.path.normpath(os.path.join(_flag(words, "--out"), "plan.json"))


def chain_errors(path: str) -> list[str]:
    """train.py commands of `path` whose `--resume X` or `--plan X` no earlier command writes."""
    errors, earlier = [], []
    for line, words in shell_commands(path):
        if "train.py" in words:
            for flag, writes in (("--resume", _writes_checkpoint), ("--plan", _writes_plan)):
                target = _flag(words, flag)
                if target is not None and not any(writes(w, words, target) for w in earlier):
                    errors.append(f"{path}:{line}: `{flag} {target}`: no earlier command in this file writes it")
        earlier.append(words)
    return errors


@pytest.mark.parametrize("path", doc_files())
def test_shell_commands_chain(path):
    """A command that resumes a checkpoint or trains a saved plan follows the one that makes it."""
    errors = chain_errors(path)
    assert not errors, "\n".join(errors)


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
    text = ("# t\n\nSo, run with `python one.py`:\n```python\nx = 1\n```\n<!-- norun: needs a GPU -->\n"
            "```python\ny = 2\n```\n- item\n  ```bash\n  ls\n  ```\n")
    blocks = parse_blocks("t.md", text)
    assert [(b.line, b.lang, b.norun, b.run) for b in blocks] == [
        (4, "python", None, "python one.py"), (8, "python", "needs a GPU", None), (12, "bash", None, None)]
    assert blocks[0].code == "x = 1\n" and blocks[2].code == "ls\n"


@pytest.mark.parametrize("text, message", [
    ("<!-- norun -->\n```python\nx\n```\n", "needs a reason"),
    ("<!-- norun: gpu -->\n\n```python\nx\n```\n", "directly above a code fence"),
    ("```python\nx = 1\n", "never closed"),
    ("Some text:\n```python\nx = 1\n```\n", "needs, on the line directly above"),
    ("Run with `python a.py`:\n\n```python\nx = 1\n```\n", "directly above a ```python fence"),
    ("Run with `python a.py`:\n```bash\nls\n```\n", "directly above a ```python fence"),
    ("Run with `python3 a.py`:\n```python\nx = 1\n```\n", "unknown launcher"),
    ("Run with `torchrun a.py`:\n```python\nx = 1\n```\n", "needs `--nproc_per_node N` first"),
    ("Run with `python a.py --steps 2`:\n```python\nx = 1\n```\n", "must end with the script"),
    ("Run with `python torch.py`:\n```python\nx = 1\n```\n", "would shadow the module torch"),
])
def test_parse_blocks_rejects_bad_markup(text, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_blocks("bad.md", text)


def test_parse_command_forms():
    assert parse_command("python ex.py") == Command("python", 1, "ex.py")
    assert parse_command("torchrun --nproc_per_node 2 ex.py") == Command("torchrun", 2, "ex.py")
    assert (parse_command("DS_ACCELERATOR=cpu deepspeed --num_accelerators 2 ds_ex.py")
            == Command("deepspeed", 2, "ds_ex.py", (("DS_ACCELERATOR", "cpu"),)))


@pytest.mark.slow
def test_failure_names_file_and_fence_line(tmp_path):
    block = Block("docs/x.md", 10, "python", "b = 1\nc = nope\n", None, "python x_doc.py")
    failure = run_block(block, str(tmp_path), timeout=60)
    assert failure.startswith("docs/x.md: the ```python block at line 10 failed")
    assert 'File "docs/x.md", line 12' in failure and "NameError" in failure


@pytest.mark.slow
def test_block_runs_alone_in_its_own_directory(tmp_path):
    """A block sees neither the repository as its directory nor rank variables of the caller,
    and its command's environment is set."""
    code = ("import os, sys\n"
            "assert os.getcwd() == os.path.dirname(os.path.abspath(sys.argv[0])), os.getcwd()\n"
            "assert os.listdir('.') == ['alone.py'], os.listdir('.')\n"
            "assert 'RANK' not in os.environ and os.environ['COAT_DOC_TEST'] == 'on'\n")
    block = Block("docs/x.md", 1, "python", code, None, "COAT_DOC_TEST=on python alone.py")
    assert run_block(block, str(tmp_path), timeout=60) is None


@pytest.mark.slow
def test_torchrun_block_runs_on_two_ranks(tmp_path):
    code = ("import os\n"
            "import torch.distributed as dist\n"
            "dist.init_process_group('gloo')\n"
            "open(f\"rank{dist.get_rank()}of{dist.get_world_size()}\", 'w').close()\n"
            "dist.destroy_process_group()\n")
    block = Block("docs/x.md", 1, "python", code, None, "torchrun --nproc_per_node 2 ranks.py")
    assert run_block(block, str(tmp_path), timeout=120) is None
    assert sorted(p.name for p in tmp_path.glob("rank?of?")) == ["rank0of2", "rank1of2"]


def test_chain_rule_on_examples(tmp_path, monkeypatch):
    """The chaining check accepts a resume of a checkpoint an earlier command saves, and refuses
    one saved by no earlier command, by a later one, or at a step the earlier run never saves."""
    save = "torchrun --nproc_per_node 2 train.py --fsdp --config c.yaml --max-steps 8 --save-interval 4 --save-dir ckpt"
    profile = "python -m coat_ds.profile --model c.yaml --plan --budget-gb 1 --out out"
    cases = {
        (save, "torchrun --nproc_per_node 1 train.py --fsdp --config c.yaml --resume ckpt/step4"): True,
        (save, "python train.py --fsdp --config c.yaml --resume ckpt"): True,
        (save, "python train.py --fsdp --config c.yaml --resume ckpt/step6"): False,
        (save, "python train.py --config c.yaml --resume ckpt/step4"): False,  # another engine
        (save, "python train.py --fsdp --config d.yaml --resume ckpt/step4"): False,  # another model
        ("python train.py --fsdp --config c.yaml --save-dir ckpt", "python train.py --fsdp --config c.yaml "
         "--resume ckpt/step4"): False,  # steps unknown
        ("python train.py --fsdp --config c.yaml --resume ckpt/step4", save): False,  # the wrong order
        (profile, "python train.py --fsdp --config c.yaml --plan out/plan.json"): True,
        (profile, "python train.py --fsdp --config c.yaml --plan other/plan.json"): False,
    }
    monkeypatch.setattr(sys.modules[__name__], "ROOT", str(tmp_path))
    for (first, second), ok in cases.items():
        (tmp_path / "x.md").write_text(f"```bash\n{first}\n{second}\n```\n")
        assert (chain_errors("x.md") == []) == ok, (first, second)
