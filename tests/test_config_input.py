"""Odd input: `${...}` in values, unknown `+` keys, values the ranks would reject late, sweeps.

Most checks run validate()/compose in process; a few run the real `train` command to see
exit code 2, no traceback, no torch import and nothing written before the refusal.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from launcher.cli import sweep_points
from launcher.config.errors import ConfigError
from launcher.config.loader import RESOLVED_CONFIG, compose_spec, load_spec, save_spec
from launcher.config.store import RECIPES_ENV
from launcher.plan.decide.resolve import resolve, validate
from tests.conftest import TRAIN, losses_by_step, train_env

# Shell text that must reach config.yaml, the ranks and the job script unchanged.
SHELL_VALUES = ["export PATH=${HOME}/bin:$PATH", "/x:\\${X:-}", "$PATH", "a\\\\${Y}\\", "plain"]


def _problems(*overrides):
    return validate(compose_spec(["+recipe=debug", *overrides]))


def _with_cluster(spec, **fields):
    return dataclasses.replace(spec, cluster=dataclasses.replace(spec.cluster, **fields))


# --- Item 1: config.yaml round-trips `${...}` ------------------------------------------------


def test_config_yaml_round_trips_shell_variables(tmp_path):
    spec = _with_cluster(
        compose_spec(["+recipe=debug", "cluster=slurm"]),
        setup=list(SHELL_VALUES),
        env={f"V{i}": v for i, v in enumerate(SHELL_VALUES)},
    )
    spec = dataclasses.replace(spec, run=dataclasses.replace(spec.run, name="${oc.env:HOME}"))
    save_spec(spec, tmp_path)
    assert load_spec(tmp_path) == spec
    # Any OmegaConf reader (not only load_spec) sees the same text, nothing resolved.
    raw = OmegaConf.load(tmp_path / RESOLVED_CONFIG)
    assert list(raw.cluster.setup) == SHELL_VALUES
    assert raw.run.name == "${oc.env:HOME}"


RECIPE_WITH_SHELL_TEXT = r"""
defaults:
  - debug
cluster:
  env:
    LIBS: '/x:\${LD_LIBRARY_PATH:-}'
    HOMEBIN: 'export PATH=\${HOME}/bin:$PATH'
trainer:
  steps: 2
  log_every: 1
checkpoint:
  interval: 0
  save_final: false
"""

EXPECTED_ENV = {"LIBS": "/x:${LD_LIBRARY_PATH:-}", "HOMEBIN": "export PATH=${HOME}/bin:$PATH"}


def test_slurm_job_script_has_shell_text_literally(tmp_path):
    """The job's ranks read config.yaml: render from what they would load, as SLURM runs it."""
    from launcher.launch import slurm
    from launcher.plan.present.plan import build_plan

    spec = compose_spec([  # written as on a command line: `\${` is Hydra's escape for a literal `${`
        "+recipe=debug", "cluster=slurm", 'cluster.setup=["export PATH=\\${HOME}/bin:$PATH"]',
        "+cluster.env.LIBS=/x:\\${LD_LIBRARY_PATH:-}", "+cluster.env.HOMEBIN='export PATH=\\${HOME}/bin:$PATH'",
    ])
    assert spec.cluster.setup == [SHELL_VALUES[0]] and spec.cluster.env == EXPECTED_ENV
    save_spec(spec, tmp_path)
    loaded = load_spec(tmp_path)
    script = slurm.render_script(loaded, build_plan(loaded), tmp_path / "run")
    assert "export PATH=${HOME}/bin:$PATH" in script.splitlines(), script
    exports = [line for line in script.splitlines() if line.startswith(("export LIBS=", "export HOMEBIN="))]
    probe = "\n".join(exports) + '\nprintf "%s|%s" "$LIBS" "$HOMEBIN"'
    out = subprocess.run(["bash", "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out == f"{EXPECTED_ENV['LIBS']}|{EXPECTED_ENV['HOMEBIN']}"


def test_local_run_with_shell_text_in_recipe_trains(tmp_path):
    """2 real ranks load config.yaml holding `${...}` and train (they died with InterpolationKeyError)."""
    recipes = tmp_path / "recipes"
    recipes.mkdir()
    (recipes / "shelltext.yaml").write_text(RECIPE_WITH_SHELL_TEXT)
    run_dir = tmp_path / "run"
    env = dict(train_env(tmp_path), **{RECIPES_ENV: str(recipes)})
    proc = subprocess.run(
        [TRAIN, "+recipe=shelltext", f"hydra.run.dir={run_dir}"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert sorted(losses_by_step(run_dir)) == [1, 2]
    assert load_spec(run_dir).cluster.env == EXPECTED_ENV


# --- Unknown keys -----------------------------------------------------------------------------


@pytest.mark.parametrize("override", ["+trainer.stpes=5", "++model.nheads=4", "+cluster.nodez=2", "+extra=1"])
def test_unknown_plus_key_is_refused(override):
    with pytest.raises(ConfigError) as err:
        compose_spec(["+recipe=debug", override])
    key = override.lstrip("+").split("=")[0]
    assert any(key in p and "Fix" in p for p in err.value.problems), err.value.problems


def test_plus_keys_of_dict_groups_are_allowed():
    spec = compose_spec(["+recipe=debug", "+cluster.env.FOO=bar"])
    assert spec.cluster.env == {"FOO": "bar"}


# --- Values refused before launch -----------------------------------------------------------

BAD_VALUES = [
    # (overrides, fragments of the problem line)
    (["model.n_heads=0"], ["model.n_heads=0"]),
    (["model.n_kv_heads=0"], ["model.n_kv_heads=0"]),
    (["model=debug_moe", "parallel.dp_replicate=0", "parallel.ep=2"], ["parallel.dp_replicate=0"]),
    (["hardware.bf16_tflops=0"], ["hardware.bf16_tflops=0"]),
    (["hardware.tf32_tflops=0"], ["hardware.tf32_tflops=0"]),
    (["hardware.network_gbps=0"], ["hardware.network_gbps=0"]),
    (["hardware.comm_efficiency=0"], ["hardware.comm_efficiency=0"]),
    (["plan.format=xml"], ["plan.format='xml'", "text, json"]),
    (["model.n_heads=1000000000000", "parallel.tp=3"], ["model.n_heads=1000000000000", "not divisible by 3"]),
    (["optim.beta1=5"], ["optim.beta1=5"]),
    (["optim.beta2=1"], ["optim.beta2=1"]),
    (["optim.eps=-1"], ["optim.eps=-1"]),
    (["optim.weight_decay=-3"], ["optim.weight_decay=-3"]),
    (["logging.level=LOUD"], ["logging.level='LOUD'"]),
    (["activation_checkpointing=selective", "activation_checkpointing.selective=abc"], ["activation_checkpointing.selective='abc'"]),
    (["activation_checkpointing.selective=0"], ["activation_checkpointing.selective='0'"]),
    (["model=debug_moe", "activation_checkpointing=selective", "activation_checkpointing.selective=op_alternate_mm"],
     ["activation_checkpointing.selective=op_alternate_mm", "n_experts=", "Fix: activation_checkpointing.selective=op"]),
    (["data.embedded_tokens=-5"], ["data.embedded_tokens=-5", "seq_len+1 = 129"]),
    (["data=text"], ["data.source=text", "data.path"]),
    (["data=text", "data.path=/nonexistent/corpus"], ["data.path=/nonexistent/corpus"]),
    (["checkpoint.resume=/nonexistent"], ["checkpoint.resume=/nonexistent"]),
    (["action=search", "plan.top_k=0"], ["plan.top_k=0"]),
    (["logging.wandb.init_timeout_s=0"], ["logging.wandb.init_timeout_s=0"]),
    (["cluster.setup=[module load x]"], ["cluster.setup", "cluster=local"]),
    (["+cluster.env.WANDB_API_KEY=abc"], ["cluster.env.WANDB_API_KEY", "secret"]),
    (["cluster=slurm", "+cluster.env.HF_TOKEN=abc"], ["cluster.env.HF_TOKEN", "secret"]),
    # A checkpoint folder the ranks could not create: refused here, not in every rank's traceback.
    (["checkpoint.dir=/proc/nope"], ["checkpoint.dir=/proc/nope", "cannot be created or written",
                                     "/proc is not writable", "Fix: a folder you can write"]),
    (["cluster=slurm", "checkpoint.dir=/proc/nope/deeper"], ["checkpoint.dir=/proc/nope/deeper", "Fix:"]),
    ([f"checkpoint.dir={Path(__file__).resolve()}/ckpt"], ["checkpoint.dir=", "is a file, not a folder", "Fix:"]),
    (["cluster.max_restarts=-1"], ["cluster.max_restarts=-1", "must be >= 0", "Fix:"]),
    (["cluster=slurm", "cluster.max_restarts=-2"], ["cluster.max_restarts=-2", "Fix:"]),
    (["cluster=slurm", "cluster.nodes=2", "cluster.spare_nodes=-1"], ["cluster.spare_nodes=-1", "must be >= 0", "Fix:"]),
    (["cluster=slurm", "cluster.nodes=2", "cluster.spare_nodes=2"],
     ["cluster.spare_nodes=2 >= cluster.nodes=2", "Fix: cluster.spare_nodes=1 or fewer"]),
    (["cluster.spare_nodes=1"], ["cluster.spare_nodes=1", "cluster=local", "Fix: cluster.spare_nodes=0"]),
    # The node-local tier: a folder the ranks could not write, no interval, or DeepSpeed's states.
    (["checkpoint.local_dir=/proc/nope"], ["checkpoint.local_dir=/proc/nope", "cannot be created or written",
                                           "Fix: a folder every node can create"]),
    (["checkpoint.local_dir=/tmp", "checkpoint.local_interval=0"],
     ["checkpoint.local_interval=0 must be at least 1", "Fix: a step count"]),
    (["backend=deepspeed", "checkpoint.local_dir=/tmp"],
     ["checkpoint.local_dir=/tmp", "DeepSpeed (ZeRO-", "Fix: checkpoint.local_dir=''"]),
]


@pytest.mark.timeout(60)  # the divisor search for n_heads=10**12 used to hang
@pytest.mark.parametrize("overrides,fragments", BAD_VALUES, ids=[" ".join(o) for o, _ in BAD_VALUES])
def test_bad_value_is_one_problem_line_with_a_fix(overrides, fragments):
    problems = _problems(*overrides)
    hits = [p for p in problems if all(f in p for f in fragments)]
    assert hits, f"no problem mentions {fragments}: {problems}"
    assert "Fix" in hits[0] or "export" in hits[0]
    assert all("\n" not in p for p in problems)


@pytest.mark.parametrize("model", ["deepseek_v3_small", "qwen3_30b_a3b"])
def test_context_parallel_with_mla_or_qk_norm_is_refused_on_cpu_and_planned_on_gpus(model):
    """parallel.cp=2 with DeepSeek-V3's MLA or Qwen3's QK-norm: on CPU it validates (backend.cp_impl=auto
    is the all-gather implementation there, tests/test_parallel_layouts.py runs it per family), and
    ring attention (no CPU kernel, whatever the attention) is one problem line with the fix before
    launch; on GPUs the same job validates and resolves to cp=2."""
    args = [f"model={model}", "parallel.cp=2", "cluster.gpus_per_node=2"]
    assert _problems(*args) == []
    problems = _problems(*args, "backend.cp_impl=ring")
    assert len(problems) == 1 and all(f in problems[0] for f in ("parallel.cp=2", "trainer.device=cpu",
                                                                  "Fix: backend.cp_impl=allgather")), problems
    spec = compose_spec(["+recipe=debug", *args, "trainer.device=cuda"])
    assert validate(spec) == []
    assert resolve(spec).mesh.cp == 2


def test_good_values_stay_valid(tmp_path):
    ckpt = tmp_path / "step_00000010"
    ckpt.mkdir()
    assert _problems(
        "activation_checkpointing=selective", "activation_checkpointing.selective=2", "logging.level=DEBUG",
        "optim.beta1=0", "optim.weight_decay=0", f"checkpoint.resume={ckpt}", "plan.format=json",
        "+cluster.env.FOO=1",
    ) == []
    assert _problems("cluster=slurm", "cluster.setup=[module load x]") == []
    # A checkpoint folder that does not exist yet but can be made is fine, and the check makes nothing.
    assert _problems(f"checkpoint.dir={tmp_path / 'new' / 'ckpt'}", "cluster.max_restarts=2",
                     f"checkpoint.local_dir={tmp_path / 'node' / 'local'}", "checkpoint.local_interval=2") == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000010"]
    # checkpoint.enabled=false writes no checkpoint: the folder is not the ranks' business then.
    assert _problems("checkpoint.dir=/proc/nope", "checkpoint.enabled=false") == []


def _tokenizer(path: Path, n_tokens: int) -> Path:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    tok = Tokenizer(WordLevel({f"w{i}": i for i in range(n_tokens)}, unk_token="w0"))
    tok.pre_tokenizer = Whitespace()
    tok.save(str(path))
    return path


def test_tokenizer_larger_than_vocabulary_is_refused_before_launch(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("w1 w2 w3 w511\n" * 50)
    big = _tokenizer(tmp_path / "tokenizer.json", 512)
    problems = _problems("data=text", f"data.path={corpus}", f"data.tokenizer={big}")
    hits = [p for p in problems if "512 token ids" in p and "model.vocab_size=256" in p and "Fix" in p]
    assert hits, problems
    assert _problems("data=text", f"data.path={corpus}", f"data.tokenizer={big}", "model.vocab_size=512") == []
    missing = _problems("data=text", f"data.path={corpus}", f"data.tokenizer={tmp_path / 'none.json'}")
    assert any("data.tokenizer=" in p and "does not exist" in p for p in missing), missing
    (tmp_path / "bad.json").write_text("{not json")
    broken = _problems("data=text", f"data.path={corpus}", f"data.tokenizer={tmp_path / 'bad.json'}")
    assert any("could not be read" in p for p in broken), broken


# --- Sweeps -----------------------------------------------------------------------------------


def test_sweep_points_match_hydras_basic_sweeper():
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    overrides = ["+recipe=debug", "cluster=slurm", "parallel.tp=1,3,2", "trainer.steps=range(1,3)", "+cluster.env.A='x,y'"]
    (hydras,) = BasicSweeper.split_arguments(OverridesParser.create().parse_overrides(overrides), None)
    assert [point for _, point in sweep_points(overrides)] == [list(p) for p in hydras]
    assert sweep_points(overrides)[2][0] == "parallel.tp=3 trainer.steps=1"
    globbed = sweep_points(["+recipe=debug", "precision=glob(fp*)"])
    assert [label for label, _ in globbed] == ["precision=fp32", "precision=fp8"]


# --- The real command: exit 2, no traceback, no torch, nothing written -----------------------

WRAPPER = (
    "import atexit, sys\n"
    "atexit.register(lambda: sys.stderr.write('TORCH_IMPORTED=%s\\n' % ('torch' in sys.modules)))\n"
    "sys.argv = ['train'] + sys.argv[1:]\n"
    "from launcher.cli import main\n"
    "main()\n"
)

SECRET = "s3cr3t-NOT-ON-DISK-91b"

CLI_CASES = [
    ["model.n_heads=0"],
    ["action=plan", "plan.format=xml"],
    ["+trainer.stpes=5"],
    ["cluster=slurm", "cluster.dry_run=true", f"+cluster.env.WANDB_API_KEY={SECRET}"],
    ["-m", "model.n_heads=4,0"],
    ["-m", "cluster=slurm", "cluster.dry_run=true", "parallel.tp=1,3,2"],
    ["checkpoint.dir=/proc/nope"],
    ["model=deepseek_v3_small", "parallel.cp=2", "backend.cp_impl=ring", "cluster.gpus_per_node=2"],  # ring CP with MLA on CPU
    ["cluster=slurm", "cluster.dry_run=true", "checkpoint.dir=/proc/nope", "cluster.max_restarts=-1"],
    ["cluster=slurm", "cluster.dry_run=true", "cluster.nodes=2", "cluster.spare_nodes=2"],
    ["backend=deepspeed", "checkpoint.local_dir=/proc/nope"],  # both refusals of the node-local tier
]


@pytest.mark.parametrize("args", CLI_CASES, ids=[" ".join(a) for a in CLI_CASES])
def test_cli_refuses_before_torch_and_before_writing(tmp_path, args):
    script = tmp_path / "wrapper.py"
    script.write_text(WRAPPER)
    work = tmp_path / "work"
    work.mkdir()
    proc = subprocess.run(
        [sys.executable, str(script), "+recipe=debug", *args, f"hydra.run.dir={work / 'run'}",
         f"hydra.sweep.dir={work / 'sweep'}"],
        cwd=work, env=train_env(work), capture_output=True, text=True, timeout=120,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    assert "Traceback" not in out
    assert "TORCH_IMPORTED=False" in proc.stderr, out
    problems = [line for line in proc.stderr.splitlines() if line.startswith("  - ")]
    assert problems and all("Fix" in p or "export" in p for p in problems), out
    assert sorted(p.name for p in work.iterdir()) == [], "something was written before the refusal"
    if "-m" in args:
        assert "sweep job #1" in proc.stderr and "sweep job #0" not in proc.stderr
    leaked = [p for p in tmp_path.rglob("*") if p.is_file() and SECRET in p.read_text(errors="ignore")]
    assert leaked == []


def test_tokenizer_vocab_check_runs_without_torch(tmp_path):
    path = _tokenizer(tmp_path / "tokenizer.json", 300)
    code = (
        "import sys; from launcher.config.validate import tokenizer_vocab_size; "
        f"print(tokenizer_vocab_size({str(path)!r}, 0)[0], 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=dict(os.environ), check=True)
    assert out.stdout.split() == ["300", "False"]


# --- Inputs every rank used to fail on (or silently override), refused before launch -----------------------

NON_FINITE_AND_CONFLICTING = [
    "data=indexed", "data.mix=[{path:/nonexistent/web,weight:inf,name:web},{path:/nonexistent/code,weight:nan,name:code}]",
    "data.reset_positions=true", "parallel.cp=2", "backend.cp_impl=ring", "plan.moe_imbalance=inf", "trainer.tokens=100000", "trainer.steps=7",
]


def _train_refuses(tmp_path, *overrides):
    """The real `train` on the debug recipe: exit 2, no traceback, nothing written; its problem lines."""
    work = tmp_path / "work"
    work.mkdir()
    proc = subprocess.run([TRAIN, "+recipe=debug", *overrides, f"hydra.run.dir={work / 'run'}"],
                          cwd=work, env=train_env(work), capture_output=True, text=True, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2 and "Traceback" not in out, out
    assert list(work.iterdir()) == [], "something was written before the refusal"
    return [line for line in proc.stderr.splitlines() if line.startswith("  - ")]


def test_non_finite_values_and_conflicting_inputs_are_all_refused_at_once(tmp_path):
    """An inf/nan data.mix weight (every rank failed on Fraction('inf')), an inf plan.moe_imbalance,
    data.reset_positions with ring context parallelism (every rank raised in the engine) and a command-line
    trainer.steps that the token budget would silently override: one exit 2, every line with a Fix."""
    problems = _train_refuses(tmp_path, *NON_FINITE_AND_CONFLICTING)

    def line(*fragments):
        hits = [p for p in problems if all(f in p for f in fragments)]
        assert len(hits) == 1 and "Fix:" in hits[0], (fragments, problems)

    line("data.mix: weights must be > 0 and finite", "web=inf", "code=nan")
    line("backend.cp_impl=ring with parallel.cp=2 and data.document_masking / data.reset_positions",
         "Fix: backend.cp_impl=allgather")
    line("plan.moe_imbalance=inf must be at least 1 and finite")
    line("trainer.steps=7 and trainer.tokens=100000 disagree", "gives 98 steps", "Fix: drop trainer.steps")


@pytest.mark.parametrize("price", ["inf", "nan"])
def test_non_finite_gpu_hour_price_is_refused(tmp_path, price):
    (problem,) = [p for p in _train_refuses(tmp_path, f"hardware.usd_per_gpu_hour={price}")
                  if "hardware.usd_per_gpu_hour" in p]
    assert f"hardware.usd_per_gpu_hour={price} must be >= 0 and finite" in problem and "Fix:" in problem


def test_token_budget_with_agreeing_or_recipe_steps_still_runs_the_plan(tmp_path):
    """trainer.steps on the command line equal to what trainer.tokens gives, or a recipe's own
    trainer.steps (its default without a budget), is not a conflict: the plan runs."""
    for steps in (["trainer.steps=98"], []):
        proc = subprocess.run([TRAIN, "+recipe=debug", "action=plan", "trainer.tokens=100000", *steps,
                               f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, env=train_env(tmp_path),
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "Budget (trainer.tokens=100,000): 98 steps" in proc.stdout
