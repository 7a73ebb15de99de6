"""Every console example in README.md and docs/*.md is what the command prints today.

A ```console block holds commands, each on a line that starts with `$ `, and below each the output it shows, up to
the next command or the block's end. Every command is `mage-gen ...`; it is run here (no GPU: CUDA_VISIBLE_DEVICES
empty, a cold compile cache of its own) and its output compared with the block's, line for line, trailing spaces
stripped. A command that succeeds shows its stdout (progress goes to stderr, and its times vary); one that fails
shows its one line of stderr, and exits 2. Commands that need a GPU go in ```bash blocks, which are not run.

A ```text block whose paragraph ends by naming a recording, "(`bench/results/<gpu>/<file>.txt`):", shows an unbroken
run of that file's lines.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_FENCE = re.compile(r"^```(\S*)\s*$")
_RECORDING = re.compile(r"\(`(bench/results/[^`]+\.txt)`\)\s*:?\s*$")


def _blocks(path: Path) -> list[tuple[str, int, list[str], str]]:
    """(language, line number of the opening fence, the block's lines, the last line of text before it) of each
    fenced block."""
    lines = path.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        opened = _FENCE.match(lines[i])
        if not opened:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), None)
        assert end is not None, f"{path.name}:{i + 1}: a fenced block is never closed"
        before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        blocks.append((opened.group(1), i + 1, lines[i + 1:end], before))
        i = end + 1
    return blocks


def _examples() -> list[tuple[str, str, list[str]]]:
    """(where, command, the output shown) of every command in a console block."""
    found = []
    for path in PAGES:
        for language, start, body, _ in _blocks(path):
            if language != "console":
                continue
            assert body and body[0].startswith("$ "), f"{path.name}:{start}: a console block starts with a `$ ` command"
            for n, line in enumerate(body):
                if line.startswith("$ "):
                    shown = []
                    for after in body[n + 1:]:
                        if after.startswith("$ "):
                            break
                        shown.append(after.rstrip())
                    found.append((f"{path.relative_to(ROOT)}:{start + 1 + n}", line[2:].strip(), shown))
    return found


EXAMPLES = _examples()


def test_the_pages_hold_console_examples():
    assert len(EXAMPLES) >= 5, [where for where, _, _ in EXAMPLES]


@pytest.mark.parametrize("where, command, shown", EXAMPLES, ids=[where for where, _, _ in EXAMPLES])
def test_a_console_example_is_what_the_command_prints(tmp_path, where, command, shown):
    words = shlex.split(command)
    assert words[0] == "mage-gen", f"{where}: a console example runs mage-gen, not {words[0]!r}; use a bash block"
    env = {k: v for k, v in os.environ.items()
           if k not in ("FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE", "COLUMNS", "LINES")}
    env.update(MAGE_GEN_CACHE=str(tmp_path / "cache"), CUDA_VISIBLE_DEVICES="", NO_COLOR="1")
    done = subprocess.run([sys.executable, "-m", "mage_gen", *words[1:]], capture_output=True, text=True, cwd=ROOT,
                          env=env, timeout=300)
    if done.returncode == 0:
        printed = done.stdout
    else:
        assert done.returncode == 2, f"{where}: `{command}` exited {done.returncode}: {done.stderr}"
        printed = done.stderr
    lines = [line.rstrip() for line in printed.splitlines()]
    assert lines == shown, f"{where}: `{command}` printed:\n" + "\n".join(lines)


def _recorded() -> list[tuple[str, str, list[str]]]:
    found = []
    for path in PAGES:
        for language, start, body, before in _blocks(path):
            named = _RECORDING.search(before)
            if language == "text" and named:
                found.append((f"{path.relative_to(ROOT)}:{start}", named.group(1), [line.rstrip() for line in body]))
    return found


RECORDED = _recorded()


@pytest.mark.parametrize("where, recording, shown", RECORDED, ids=[where for where, _, _ in RECORDED])
def test_a_recorded_output_is_part_of_its_recording(where, recording, shown):
    lines = [line.rstrip() for line in (ROOT / recording).read_text().splitlines()]
    assert shown and any(lines[i:i + len(shown)] == shown for i in range(len(lines) - len(shown) + 1)), \
        f"{where}: these lines are not an unbroken part of {recording}"


def test_the_cpp_program_of_emit_md_names_what_emit_writes(tmp_path):
    """docs/emit.md's C++ program includes, loads and calls what its emit command writes (the program itself
    runs on a GPU, with nvcc, and is not built here)."""
    page = ROOT / "docs" / "emit.md"
    blocks = _blocks(page)
    program = "\n".join(next(body for language, _, body, _ in blocks if language == "cpp"))
    command = next(line for language, _, body, _ in blocks if language == "bash" for line in body
                   if line.startswith("mage-gen emit gemm_sm90") and line.rstrip().endswith("-o kernels"))
    words = shlex.split(command)[1:]
    env = {**os.environ, "MAGE_GEN_CACHE": str(tmp_path / "cache"), "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, "-m", "mage_gen", *words[:-1], str(tmp_path / "kernels")],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    files = re.findall(r'"kernels/([^"]+)"', program)
    assert files, "emit.md's program names no file under kernels/"
    for name in files:
        assert (tmp_path / "kernels" / name).is_file(), f"emit.md's program reads kernels/{name}, which emit did not write"
    header = next((tmp_path / "kernels").glob("*.h"))
    names = set(re.findall(rf"\b{header.stem}_\w+", program))
    assert {f"{header.stem}_kernel_name", f"{header.stem}_launch"} <= names, f"emit.md's program uses no {header.stem}_*"
    for name in names:
        assert re.search(rf"\b{name}\b", header.read_text()), f"{header.name} declares no {name}"
