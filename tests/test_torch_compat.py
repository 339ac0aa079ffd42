"""The torch range is honest: every torchrun command line the launcher builds runs on the torch
floor's torchrun when the ranks' torch lacks the newer options (bench/reference/torchrun_flags/,
written by bench/torch_compat.sh from the floor's own parser), and parses with the installed
torch's torchrun when it has them; capabilities are probed in the ranks' interpreter and cached."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from launcher import compat
from launcher.compat import CAPABILITIES, TORCH_FLOOR, TorchCapabilities, floor_capabilities, probe, ranks_capabilities
from launcher.config.loader import compose_spec
from launcher.launch import slurm
from launcher.launch.local import local_torchrun_argv
from launcher.launch.torchrun import SHUTDOWN_TIMEOUT, torchrun_argv, torchrun_env
from launcher.plan.present.plan import build_plan

REPO = Path(__file__).resolve().parents[1]
FLAGS_DIR = REPO / "bench" / "reference" / "torchrun_flags"
ALL_ON = TorchCapabilities("newest", frozenset(c.name for c in CAPABILITIES))


def floor_flags() -> set:
    [path] = [p for p in FLAGS_DIR.glob("*.txt") if re.fullmatch(re.escape(TORCH_FLOOR) + r"(\.\d+)?", p.stem)]
    return {line.strip() for line in path.read_text().splitlines() if line.strip() and not line.startswith("#")}


def torchrun_options(argv: list) -> list:
    """The torchrun option names of a `python -m torch.distributed.run ... -m MODULE ...` argv."""
    assert argv[1:3] == ["-m", "torch.distributed.run"], argv
    options = []
    for arg in argv[3:]:
        if arg == "-m":  # the ranks' module and its own arguments follow
            break
        options.append(arg.split("=", 1)[0])
    return options


def every_command_line(tmp_path: Path, caps: TorchCapabilities) -> dict:
    """Each torchrun argv the launcher builds: local, the SLURM template (through a render), the
    rendezvous variants torchrun_argv knows, with and without a shutdown timeout."""
    spec = compose_spec(["+recipe=debug"])
    plan = build_plan(spec)
    assert plan.checkpoint["shutdown_timeout_s"] > 0
    slurm_spec = compose_spec(["+recipe=debug", "cluster=slurm", "cluster.nodes=2"])
    slurm_plan = build_plan(slurm_spec)
    lines = {
        "local": local_torchrun_argv(spec, plan, tmp_path, caps),
        "slurm": slurm.launch_argv(slurm_spec, slurm_plan, tmp_path, caps),
        "endpoint": torchrun_argv(tmp_path, nproc_per_node=8, nnodes=4, rdzv_endpoint="n1:29500", rdzv_id="7",
                                  max_restarts=2, shutdown_timeout_s=300, capabilities=caps),
        "no_timeout": torchrun_argv(tmp_path, nproc_per_node=2),
    }
    return lines


def test_the_floor_is_what_pyproject_declares_and_its_torchrun_flags_are_recorded():
    text = (REPO / "pyproject.toml").read_text()
    [spec] = re.findall(r'"torch(>=[^"]+)"', text)
    assert spec.startswith(f">={TORCH_FLOOR},"), f"pyproject says torch{spec}; launcher/compat.py TORCH_FLOOR={TORCH_FLOOR}"
    upper = spec.split(",<")[1]
    newest = tuple(int(x) for x in compat.TORCH_NEWEST_TESTED.split("."))
    assert newest < tuple(int(x) for x in upper.split(".")), "the newest tested torch must be inside the range"
    flags = floor_flags()
    assert {"--standalone", "--nnodes", "--nproc_per_node", "--rdzv_backend", "--max_restarts"} <= flags
    assert "--shutdown-timeout" not in flags  # the reason the floor needs a fallback (torch 2.12)


def test_without_the_capabilities_every_command_line_uses_only_the_floors_flags(tmp_path):
    allowed = floor_flags()
    for name, argv in every_command_line(tmp_path, floor_capabilities()).items():
        unknown = [o for o in torchrun_options(argv) if o not in allowed]
        assert not unknown, f"{name}: {unknown} are not options of torch {TORCH_FLOOR}'s torchrun: {argv}"
        assert torchrun_options(argv), name


def test_with_the_capabilities_every_command_line_parses_with_the_installed_torchrun(tmp_path):
    from torch.distributed.run import get_args_parser

    caps = compat.in_process()
    assert caps.has(SHUTDOWN_TIMEOUT)  # the CI torch (2.13) has it: the check below then covers the option
    for name, argv in every_command_line(tmp_path, caps).items():
        args = get_args_parser().parse_args(argv[3:])  # argparse exits (SystemExit) on an unknown option
        assert args.training_script == "launcher.runtime.entry" and args.module, name
    line = every_command_line(tmp_path, caps)["local"]
    assert any(a.startswith("--shutdown-timeout=") for a in line)


def test_without_the_option_the_timeout_travels_as_the_variable_torchrun_reads(tmp_path):
    from torch.distributed.run import get_args_parser

    assert torchrun_env(300, ALL_ON) == {} and torchrun_env(0, floor_capabilities()) == {}
    env = torchrun_env(300, floor_capabilities())
    assert env == {"PET_SHUTDOWN_TIMEOUT": "300"}
    # A torchrun that has the option takes it from that variable (an older one ignores it).
    parser_args = torchrun_argv(tmp_path, nproc_per_node=1, capabilities=floor_capabilities())[3:]
    old = os.environ.get("PET_SHUTDOWN_TIMEOUT")
    os.environ["PET_SHUTDOWN_TIMEOUT"] = "300"
    try:
        assert get_args_parser().parse_args(parser_args).shutdown_timeout == 300
    finally:
        os.environ.pop("PET_SHUTDOWN_TIMEOUT")
        if old is not None:
            os.environ["PET_SHUTDOWN_TIMEOUT"] = old


def test_a_job_script_for_a_container_uses_the_floors_flags_and_exports_the_timeout(tmp_path):
    spec = compose_spec(["+recipe=debug", "cluster=slurm", "cluster.container=/images/torch.sqsh"])
    plan = build_plan(spec)
    script = slurm.render_script(spec, plan, tmp_path / "run", cwd=tmp_path)
    launch = next(line for line in script.splitlines() if "torch.distributed.run" in line)
    assert "--shutdown-timeout" not in launch
    assert f"export PET_SHUTDOWN_TIMEOUT={plan.checkpoint['shutdown_timeout_s']}" in script
    # This venv's torch (2.13) was asked and has the option: it is on the command line instead.
    spec = compose_spec(["+recipe=debug", "cluster=slurm"])
    script = slurm.render_script(spec, plan, tmp_path / "run2", cwd=tmp_path)
    assert "PET_SHUTDOWN_TIMEOUT" not in script
    assert f"--shutdown-timeout={plan.checkpoint['shutdown_timeout_s']}" in script


def test_probe_asks_the_ranks_interpreter_once_per_torch_build(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    first = probe(sys.executable)
    assert first is not None and first == TorchCapabilities(compat.in_process().torch_version,
                                                            compat.in_process().present, source=sys.executable)
    [cached] = (tmp_path / "launcher" / "torch_capabilities").glob("*.json")
    # The answer comes from the cache now: an edited cache entry is what the next probe returns.
    cached.write_text(json.dumps({"torch": "9.9.9", "present": []}))
    assert probe(sys.executable).torch_version == "9.9.9"


def test_an_interpreter_that_cannot_be_asked_gets_the_floors_command_line(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert probe(str(tmp_path / "no-such-python")) is None
    caps = ranks_capabilities(str(tmp_path / "no-such-python"))
    assert caps.source == "floor" and not caps.present
    with pytest.raises(KeyError, match="unknown torch capability"):
        caps.has("no_such_capability")


def test_compat_command_prints_what_the_torch_has():
    out = subprocess.run([sys.executable, "-m", "launcher.compat"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    answer = json.loads(out.stdout)
    assert answer["floor"] == TORCH_FLOOR and SHUTDOWN_TIMEOUT in answer["present"]
