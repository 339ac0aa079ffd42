"""A mistyped key, recipe or group option is answered with the closest valid names (issue 43).

Each case runs the real `train` command: exit 2, one problem line per mistake, the closest name
first and in the Fix, never Hydra's `+key=` advice or its config search path, nothing written.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from launcher.config.overrides import override_problems
from launcher.config.store import RECIPES_ENV
from tests.conftest import TRAIN, train_env

HYDRA_TEXT = ("To append to your config", "search path", "provider=", "HYDRA_FULL_ERROR")


def _refusal(args, run_dir: Path, extra_env=None):
    """The problem lines of `train ARGS`, which must exit 2 before writing anything."""
    env = train_env(run_dir.parent)
    env.update(extra_env or {})
    proc = subprocess.run([TRAIN, *args, f"hydra.run.dir={run_dir}"], cwd=run_dir.parent, env=env,
                          capture_output=True, text=True, timeout=60)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    assert "Traceback" not in out and not any(text in out for text in HYDRA_TEXT), out
    assert not run_dir.exists(), "something was written before the refusal"
    problems = [line[4:] for line in proc.stderr.splitlines() if line.startswith("  - ")]
    assert problems and all("Fix: " in p for p in problems), out
    return problems


def test_a_mistyped_key_names_the_closest_key_and_never_plus(run_dir):
    (problem,) = _refusal(["+recipe=debug", "trainer.setps=10"], run_dir)
    assert "did you mean trainer.steps?" in problem and problem.endswith("Fix: trainer.steps=10."), problem
    assert "+trainer" not in problem


def test_a_mistyped_key_added_with_plus_is_answered_the_same_way(run_dir):
    (problem,) = _refusal(["+recipe=debug", "+trainer.setps=10"], run_dir)
    assert "did you mean trainer.steps?" in problem and "Fix: trainer.steps=10" in problem, problem


def test_a_mistyped_recipe_lists_the_recipes_closest_first(run_dir):
    (problem,) = _refusal(["+recipe=lama8b"], run_dir)
    assert "did you mean llama8b?" in problem and problem.endswith("Fix: +recipe=llama8b."), problem
    choices = problem.split("closest first: ")[1].split(". Fix")[0].split(", ")
    assert choices[0] == "llama8b" and {"debug", "llama70b", "deepseek_v3"} <= set(choices), problem


def test_a_mistyped_group_option_lists_the_options_closest_first(run_dir):
    (problem,) = _refusal(["+recipe=debug", "model=lama3_8b"], run_dir)
    assert "did you mean llama3_8b?" in problem and problem.endswith("Fix: model=llama3_8b."), problem
    assert problem.split("closest first: ")[1].startswith("llama3_8b, "), problem


def test_every_mistake_of_a_command_is_reported_at_once(run_dir):
    problems = _refusal(["+recipe=debug", "trainer.setps=10", "optim.lrr=0.1", "precision=bf61", "modle=debug",
                         "run_name=mine"], run_dir)
    assert len(problems) == 5, problems
    assert "run_name was renamed run.name. Fix: run.name=mine." in problems, problems  # a key an older release had
    for fix in ("Fix: trainer.steps=10.", "Fix: optim.lr=0.1.", "Fix: precision=bf16.", "Fix: model=debug."):
        assert any(p.endswith(fix) for p in problems), (fix, problems)


def test_a_sweep_with_a_mistyped_key_is_refused_once_before_any_job(tmp_path):
    run_dir = tmp_path / "run"
    problems = _refusal(["-m", "+recipe=debug", "action=plan", "trainer.setps=1,2", f"hydra.sweep.dir={run_dir}"],
                        run_dir)
    assert len(problems) == 1 and "Fix: trainer.steps=1,2." in problems[0], problems


def test_user_recipes_are_among_the_choices_and_their_mistakes_are_named(tmp_path):
    recipes = tmp_path / "recipes"
    recipes.mkdir()
    (recipes / "my_tiny.yaml").write_text("defaults:\n  - override /model: debug_mo\ntrainer:\n  steps: 3\n")
    (recipes / "my_typo.yaml").write_text("trainer:\n  setps: 3\n")
    env = {RECIPES_ENV: str(recipes)}
    (problem,) = _refusal(["+recipe=my_tiyn"], tmp_path / "run", env)
    assert "did you mean my_tiny?" in problem and "Fix: +recipe=my_tiny." in problem, problem
    # The recipe's own defaults name a missing model: Hydra's error, translated.
    (problem,) = _refusal(["+recipe=my_tiny"], tmp_path / "run", env)
    assert "did you mean debug_moe?" in problem and "Fix: model=debug_moe." in problem, problem
    (problem,) = _refusal(["+recipe=my_typo"], tmp_path / "run", env)
    assert "trainer.setps" in problem and "did you mean trainer.steps?" in problem, problem


def test_a_new_key_of_a_free_form_map_is_the_one_place_plus_is_advised(run_dir):
    (problem,) = _refusal(["+recipe=debug", "cluster.env.FOO=1"], run_dir)
    assert problem.endswith("Fix: +cluster.env.FOO=1."), problem


def test_several_values_without_m_say_how_to_write_a_list_or_sweep(run_dir):
    (problem,) = _refusal(["+recipe=debug", "parallel.tp=1,2"], run_dir)
    assert "Fix: parallel.tp=[1,2] for a list, or `train -m ...`" in problem, problem


def test_valid_overrides_raise_no_problem():
    # `+` on a key the job has is Hydra's to judge: it takes one whose value is null.
    assert override_problems(["+recipe=llama8b", "model=llama3_8b", "trainer.steps=10", "+cluster.env.A=b",
                              "+hardware.usd_per_gpu_hour=2",
                              "model.rope_scaling.factor=8", "parallel.tp=1,2", "precision=glob(fp*)",
                              "data.mix=[]", "rehearse.ranks=all", "~trainer.tokens"]) == []
