"""Every command README.md and docs/*.md show in a code block runs as written on this CPU machine,
or says on its line what it needs (`# needs: slurm`, `# needs: gpu`; docs/contributing.md, "Docs").

Cheap by design: a `train` command goes through what `train` does before it writes anything or
starts a rank (compose, every config rule, the plan; launcher/cli.py `_point_problems`), in this
process, with the paths it names (`/raw/...`, `/data/...`, `/models/...`) mapped to a small corpus and
tokenizer this test makes, and without `sbatch` on PATH; an `action=plan` command also renders
its plan. A command marked `# needs: slurm` gets the same checks with `cluster.dry_run=true` (all
but the submission); one marked `# needs: gpu` (a model and weights no CPU machine holds) is held
to its keys and options existing (a renamed key fails here). `make TARGET` must be a target (`make -n`), and a script a command runs
must exist. The `$ train ...` examples with their output are tests/test_readme_examples.py's.
"""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path
from typing import List, Tuple

import pytest

from tests.conftest import REPO

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
COMMAND = re.compile(r"^(\.venv/bin/)?(train |make |python -m launcher|\.venv/bin/python |python |bash )")
NEEDS = re.compile(r"#\s*needs:\s*([a-z, ]+)")
KNOWN_NEEDS = {"slurm", "gpu"}
# The placeholder folders the docs use for your files, mapped into the test's own folder.
PLACEHOLDERS = ("/raw/", "/data/", "/models/")


def _code_blocks(text: str) -> List[str]:
    """Fenced blocks (```) and indented blocks (4 spaces after a blank line) of a markdown text."""
    blocks = re.findall(r"^```[^\n]*\n(.*?)^```", text, re.S | re.M)
    outside = re.sub(r"^```[^\n]*\n.*?^```", "", text, flags=re.S | re.M)
    current: List[str] = []
    previous_blank = True
    for line in outside.splitlines():
        if line.startswith("    ") and (previous_blank or current):
            current.append(line[4:])
        elif current and not line.strip():
            current.append("")
        else:
            if current:
                blocks.append("\n".join(current))
            current = []
        previous_blank = not line.strip()
    if current:
        blocks.append("\n".join(current))
    return blocks


def doc_commands() -> List[Tuple[str, str, List[str]]]:
    """(doc, command, needs) for every command line of every code block (continuations joined)."""
    found = []
    for doc in DOCS:
        for block in _code_blocks(doc.read_text()):
            for line in re.sub(r"\\\n\s*", " ", block).splitlines():
                line = line.strip()
                if not COMMAND.match(line):
                    continue
                marker = NEEDS.search(line)
                needs = [n.strip() for n in marker.group(1).split(",") if n.strip()] if marker else []
                found.append((doc.name, line, needs))
    return found


def _argv(command: str) -> List[str]:
    """The command's words without its trailing comment."""
    return shlex.split(command, comments=True)


@pytest.fixture(scope="module")
def user_files(tmp_path_factory) -> Path:
    """The files the docs' commands name, small: raw text, a tokenizer folder per /models/ name,
    a token-id folder (/data/tokens), and the datasets the docs' mixtures read, written by the
    docs' own `action=prepare` steps (the same input, tokenizer and settings: the prepare
    commands then find a dataset they would continue)."""
    import numpy as np

    from launcher.config.schema import PrepareConfig
    from launcher.data.prepare import run_prepare
    from tests.test_data_prepare import make_corpus, make_tokenizer

    root = tmp_path_factory.mktemp("user_files")
    for command in (c for _, c, needs in doc_commands() if "gpu" not in needs):
        for name in re.findall(r"/models/([A-Za-z0-9._-]+)", command):
            if not (root / "models" / name).exists():
                make_tokenizer(root / "models" / name)
    for name in ("web", "code", "math", "web_val", "code_val"):
        make_corpus(root / "raw" / name, per_file=300)  # > trainer.seq_len=8192 tokens per source
        source = f"{root}/raw/web/*.jsonl.zst" if name == "web" else str(root / "raw" / name)
        run_prepare(PrepareConfig(input=source, output=str(root / "data" / name),
                                  tokenizer=str(root / "models" / "Llama-3.1-8B"), workers=1), progress=False)
    (root / "data" / "tokens").mkdir()
    np.arange(100_000, dtype=np.uint16).tofile(root / "data" / "tokens" / "shard_0.bin")
    return root


def _local(words: List[str], root: Path) -> List[str]:
    out = []
    for word in words:
        for prefix in PLACEHOLDERS:
            word = re.sub(rf"(?<![\w./]){re.escape(prefix)}", f"{root}{prefix}", word)
        out.append(word)
    return out


def test_the_docs_show_commands_and_mark_only_known_needs():
    commands = doc_commands()
    assert len(commands) > 30, "the extraction found too few commands: has the docs' code-block style changed?"
    unknown = [(doc, c, needs) for doc, c, needs in commands if set(needs) - KNOWN_NEEDS]
    assert not unknown, f"markers other than `# needs: {'|'.join(sorted(KNOWN_NEEDS))}`: {unknown}"


@pytest.mark.parametrize("doc, command, needs", doc_commands(), ids=lambda x: x if isinstance(x, str) else None)
def test_a_doc_command_runs_as_written_or_says_what_it_needs(doc, command, needs, user_files, tmp_path, monkeypatch):
    words = _argv(command)
    if words[0] in ("make",):
        targets = [w for w in words[1:] if "=" not in w]
        proc = subprocess.run(["make", "-n", *targets], cwd=REPO, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, f"{doc}: `{command}`: {proc.stderr}"
        return
    if not words[0].endswith("train"):
        script = next((w for w in words[1:] if w.endswith((".py", ".sh"))), None)
        tests = [w for w in words if w.startswith("tests/")]
        for path in [script, *tests] if script else tests:
            assert (REPO / path).is_file(), f"{doc}: `{command}` runs {path}, which does not exist"
        return
    from launcher.cli import _point_problems
    from launcher.config.overrides import override_problems

    overrides = words[1:]
    if "gpu" in needs:  # a model (and weights) no CPU machine holds: its keys and options exist
        assert not override_problems(overrides), f"{doc}: `{command}`: {override_problems(overrides)}"
        return
    if "slurm" in needs:  # every check but the submission itself
        overrides.append("cluster.dry_run=true")
    # As on a machine without SLURM: a command that would submit must say `# needs: slurm`.
    monkeypatch.setenv("PATH", str(Path(words[0]).parent if "/" in words[0] else REPO / ".venv" / "bin"))
    monkeypatch.chdir(tmp_path)
    overrides = _local(overrides, user_files)
    problems = _point_problems(overrides)
    assert not problems, f"{doc}: `{command}` does not run as written here:\n" + "\n".join(problems)
    if "action=plan" in overrides:
        from launcher.config.loader import compose_spec
        from launcher.plan.decide.resolve import check
        from launcher.plan.present.plan import build_plan
        from launcher.plan.present.report import render_plan

        spec = compose_spec(overrides)
        assert render_plan(build_plan(spec, check(spec)), spec, spec.plan.format).strip()
