"""Real 2-process DeepSpeed runs on CPU (torchrun, gloo) against a single-process torch reference.

One torchrun runs every case in sequence (ZeRO 1/2/3, ZeRO-2 + CPU optimizer offload, the
ZeRO-3 save -> resume, the native FSDP2 engine on the same data, and DeepSeek-V3's router bias
in bf16 on ZeRO-3 and on the native engine), so start-up and the JIT-built ops are paid once.
The ZeRO-3 case also runs the training loop's downstream evaluation (eval.tasks) on its trained
engine, compared with lm-eval's HF backend on the same weights. The JIT cache lives in <repo>/.cache/torch_extensions.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

HARNESS = Path(__file__).resolve().parent / "deepspeed_harness"
sys.path.insert(0, str(HARNESS))

from common import CASES, SAVE_AT, SLOW_CASES, deepspeed_env, reference_run, spec_for  # noqa: E402

from tests.parallel_harness.spread import record_spread, record_value  # noqa: E402

# Tolerances, from what each backend guarantees and what was measured (`[spread]` lines; run
# with `pytest -s`, SPREAD_LOG=FILE keeps raw values). Every case here is deterministic run to
# run: the ranks use one intra-op thread (OMP_NUM_THREADS=1), two-rank gloo sums are
# commutative, DeepSpeedCPUAdam's OpenMP loop is element-wise, and async IO only moves bytes.
# Measured on a 2-core machine under load average 5-90 (other test suites and two CPU hogs
# beside it): 6 runs of this file (the NVMe case in 5, the pipeline case in 3) plus 4 runs of
# the NVMe case alone gave bitwise identical losses, grad norms and weights every time, and
# the torch reference is identical with 1 and 2 intra-op threads. What the tolerances absorb is
# the fixed difference of summation order against the single-process reference:
#   ZeRO 1/2/3, CPU offload, activation checkpointing, pipeline pp=2 (dim 64): loss <= 1.7e-7, grad norm
#     <= 2.0e-7 relative, weights <= 6.1e-6 absolute -> 1e-5 / 1e-5 / 1e-5;
#   vs the native FSDP2 engine: loss <= 6.4e-8, grad norm <= 1.4e-7 -> 1e-5;
#   save -> resume: bitwise equal (same process, same order), compared exactly;
#   zero3_nvme: see NVME_* below.
#   The weights' bound depends on the CPU: on an AVX-512 machine (AMD EPYC with avx512f, 2026-11-26)
#   the same fixed difference came out at 1.22e-5 (ZeRO-1, pipeline) and 1.52e-5 (ZeRO-2/3, offload)
#   absolute, its largest per-tensor mean |difference| 8.7e-8: Adam divides each update by sqrt(v),
#   so where v is ~0 an ulp of the gradient becomes a visible step (as for zero3_nvme below). The
#   outlier bound is 1e-4, and the mean bound of 1e-6 is what catches a real bug: a lost or
#   doubled update moves every element of a tensor by about lr (3e-3).
RTOL = 1e-5
WEIGHT_ATOL = 1e-4
WEIGHT_MEAN_ATOL = 1e-6
# zero3_nvme (dim 256, DeepSpeedCPUAdam's vectorised update vs torch AdamW): Adam divides each
# update by sqrt(v), so where v is ~0 (embedding rows of tokens a step barely saw) a 1-ulp
# difference in the gradient becomes a step of up to lr. Measured, identical in all 9 runs
# (and the same numbers as the failure in issue 10): grad norm 2.07e-5 relative at step index 3,
# loss 2.1e-7, weights 6.2e-4 absolute in tok_embeddings (3e-5 of its elements beyond 1e-4),
# largest per-tensor mean |difference| 2.8e-7. The mean bound keeps a systematic error (a lost
# or doubled update moves every element by ~lr = 3e-3) from hiding under the outlier bound.
NVME_GRAD_NORM_RTOL = 1e-4
NVME_WEIGHT_ATOL = 2e-3
NVME_WEIGHT_MEAN_ATOL = 1e-6

pytestmark = pytest.mark.multiprocess


def _torchrun(work: Path, *args: str, timeout: int = 900) -> dict:
    work.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(HARNESS / "run_cases.py"), "--work", str(work), *args]
    proc = subprocess.run(cmd, env=deepspeed_env(), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return json.loads((work / "results.json").read_text())


@pytest.fixture(scope="module")
def eval_dir(tmp_path_factory) -> Path:
    """tokenizer/ (the debug model's 256 ids) and tasks/ of tests/eval_tasks.py."""
    from tests.eval_tasks import write_tasks, write_tokenizer

    root = tmp_path_factory.mktemp("deepspeed_eval")
    write_tokenizer(root / "tokenizer", spec_for([]).model.vocab_size)
    write_tasks(root / "tasks", spec_for([]).model.vocab_size)
    return root


@pytest.fixture(scope="module")
def results(tmp_path_factory, eval_dir):
    work = tmp_path_factory.mktemp("deepspeed")
    return _torchrun(work, "--cases", ",".join(CASES), "--resume", "zero3", "--native", "--bias-bf16",
                     "--eval-dir", str(eval_dir), "--eval-case", "zero3")


@pytest.fixture(scope="module")
def reference():
    spec = spec_for(CASES["zero1"])
    steps, weights = reference_run(spec, spec.trainer.steps)
    raw = {k: [s[k] for s in steps] for k in ("loss", "grad_norm")}
    record_spread("torch reference (raw values)", raw, raw)  # shows whether the reference varies run to run
    return steps, weights


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def _assert_matches(steps, expected, what, grad_norm_rtol: float = RTOL):
    assert len(steps) == len(expected), what
    record_spread(what, {k: [s[k] for s in steps] for k in ("loss", "grad_norm")},
                  {k: [s[k] for s in expected] for k in ("loss", "grad_norm")})
    for i, (got, want) in enumerate(zip(steps, expected)):
        assert _rel(got["loss"], want["loss"]) <= RTOL, f"{what} step {i}: loss {got['loss']} vs {want['loss']}"
        assert _rel(got["grad_norm"], want["grad_norm"]) <= grad_norm_rtol, (
            f"{what} step {i}: grad_norm {got['grad_norm']} vs {want['grad_norm']} "
            f"(relative {_rel(got['grad_norm'], want['grad_norm']):.2e} > {grad_norm_rtol:g})")
        assert math.isclose(got["lr"], want["lr"], rel_tol=1e-12), f"{what} step {i}: lr {got['lr']} vs {want['lr']}"


def _assert_weights_match(export_path: str, expected: dict, what: str, atol: float = WEIGHT_ATOL,
                          mean_atol: float = WEIGHT_MEAN_ATOL):
    import torch

    got = torch.load(export_path)
    assert set(got) == set(expected), f"{what}: exported names differ: {sorted(set(got) ^ set(expected))[:5]}"
    worst = max(float((got[k] - expected[k]).abs().max()) for k in expected)
    worst_mean = max(float((got[k] - expected[k]).abs().mean()) for k in expected)
    record_value(what, "weights max abs", worst)
    record_value(what, "weights largest per-tensor mean abs", worst_mean)
    assert worst <= atol, f"{what}: exported fp32 weights differ from the reference by up to {worst:.2e} > {atol:g}"
    assert worst_mean <= mean_atol, (
        f"{what}: a tensor's mean |difference| from the reference is {worst_mean:.2e} > {mean_atol:g}")


@pytest.mark.parametrize("case", list(CASES))
def test_deepspeed_matches_torch_reference(results, reference, case):
    ref_steps, ref_weights = reference
    assert results[case]["backends"]["sharding"].startswith("DeepSpeed ZeRO-")
    _assert_matches(results[case]["steps"], ref_steps, case)
    _assert_weights_match(results[case]["export"], ref_weights, case)


def test_cases_ran_what_they_claim(results):
    assert results["zero2_cpu_offload"]["backends"]["offload_optimizer"] == "DeepSpeed offload_optimizer device=cpu"
    assert results["zero2_ac_full"]["backends"]["activation_checkpointing"].startswith("deepspeed.checkpointing")
    assert results["zero1_ac_selective_op"]["backends"]["activation_checkpointing"] == (
        "torch.utils.checkpoint per block (selective=op)")


def _assert_built_the_layout(result: dict, case: str) -> None:
    """What DeepSpeed built (read back from its engine) is what plan.json's layout says."""
    lay, built = result["layout"], result["built"]
    bk = built["backends"]
    assert bk["sharding"] == lay["sharding_backend"] == "deepspeed", case
    assert bk["zero_stage"] == lay["zero_stage"], f"{case}: DeepSpeed runs ZeRO-{bk['zero_stage']}, layout says {lay['zero_stage']}"
    assert bk["gradient_accumulation_steps"] == lay["microbatches"], case
    assert built["mesh"]["pp"] == lay["pp"] and built["mesh"]["dp"] == lay["derived"]["dp"] * lay["cp"] * lay["tp"], case
    assert built["pp_microbatches"] == (lay["derived"]["pp_microbatches"] if lay["pp"] > 1 else None), case
    assert built["fsdp"] is lay["derived"]["fsdp_wraps"] is False, case
    assert bk["offload_optimizer"] == lay["offload_optimizer"] and bk["offload_param"] == lay["offload_params"], case
    # The Engine contract: the memory tracker sees DeepSpeed's module and optimizer.
    assert result["memory_parts"] == 1 and result["memory_optimizers"] == 1, case


@pytest.mark.parametrize("case", list(CASES))
def test_deepspeed_built_the_resolved_layout(results, case):
    _assert_built_the_layout(results[case], case)


def test_zero3_evaluation_equals_lm_evals_hf_backend_on_the_same_weights(results, eval_dir, tmp_path):
    """The loop's downstream evaluation on the live ZeRO-3 engine (parameters partitioned over the
    2 ranks, gathered for each forward) scores lm-eval's tasks as lm-eval's HF backend (HFLM) does
    on an HF folder of the weights it evaluated (the case's fp32 export): acc, acc_norm and is_greedy's
    acc exactly, log-likelihood metrics within 1e-4 relative."""
    import torch

    from launcher.engines.deepspeed import materialise_model
    from launcher.hf.weights import export_hf
    from tests.eval_tasks import assert_scores_equal, hflm_reference, one_context_limit

    run = results["zero3"]
    assert "eval" in run, sorted(run)
    spec = spec_for(CASES["zero3"])
    model = materialise_model(spec.model, torch.device("cpu"), spec.trainer.seed)
    model.load_state_dict(torch.load(run["export"]))
    export_hf([model], None, tmp_path / "hf", spec.model, "fp32")
    theirs = hflm_reference(tmp_path / "hf", eval_dir / "tokenizer", eval_dir / "tasks", spec.trainer.seq_len,
                            limit=one_context_limit(spec.model.vocab_size))
    assert_scores_equal(run["eval"], theirs)
    record_value("zero3 evaluation", "seconds", run["eval_s"])


def test_deepspeed_matches_native_engine(results):
    native = results["native_zero3"]["steps"]
    for case in CASES:
        _assert_matches(results[case]["steps"], native, f"{case} vs native FSDP2")


def test_save_resume_gives_identical_continuation(results):
    run = results["zero3"]
    assert run["resumed"] == run["steps"][SAVE_AT:], "resumed losses differ from the uninterrupted run"


def test_router_bias_stays_fp32_under_deepspeed_bf16_and_moves_as_the_native_engines(results):
    """DeepSeek-V3's aux-loss-free balancing in bf16 under ZeRO-3, whose zero.Init makes every float
    tensor a constructor returns bf16 (the bias's zeros too, unless the model declares it float32):
    the bias is float32 once the engine has wrapped the model and after every step, and after each of
    the 3 steps it equals the native engine's bit for bit (in bf16 the first 0.01 step is 0.01000977,
    and a 0.001 step vanishes once |bias| >= 0.5)."""
    ds, native = results["bias_bf16_deepspeed"], results["bias_bf16_native"]
    assert ds["layout"]["zero_stage"] == 3 and ds["backends"]["sharding"].startswith("DeepSpeed ZeRO-3")
    assert len(ds["biases_built"]) == 1 and set(ds["biases_built"]) == set(native["biases_built"])  # block 1
    for run in (ds, native):
        assert {dtype for dtype, _ in run["biases_built"].values()} == {"torch.float32"}
    assert len(ds["steps"]) == len(native["steps"]) == 3
    for i, (got, want) in enumerate(zip(ds["steps"], native["steps"])):
        assert {dtype for dtype, _ in got["biases"].values()} == {"torch.float32"}, f"step {i + 1}"
        assert got["biases"] == want["biases"], f"step {i + 1}: DeepSpeed bias {got['biases']} vs native {want['biases']}"
    assert all(v != 0 for _, values in ds["steps"][-1]["biases"].values() for v in values)  # it moved


def test_generated_config_is_written_and_consistent(results):
    run_dir = Path(results["zero2_cpu_offload"]["export"]).parents[1]
    cfg = json.loads((run_dir / "deepspeed_config.json").read_text())
    assert cfg["train_batch_size"] == cfg["train_micro_batch_size_per_gpu"] * cfg["gradient_accumulation_steps"] * 2
    assert cfg["gradient_clipping"] == 0.5
    assert cfg["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": False}


def _aio_buildable() -> bool:
    import os

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.ops.op_builder.cpu import AsyncIOBuilder

    return AsyncIOBuilder().is_compatible()


# The pipeline cases run last: DeepSpeed keeps its pipeline topology in process-global state,
# which a later non-pipeline engine in the same process would pick up. The native pipeline on
# the MoE model runs first in the same launch, as the MoE pipeline case's reference.
SLOW_RUN = ["pipeline_zero1", "pipeline_moe"]
# The first test to use slow_results builds it: one two-process launch of up to four cases and,
# on a cold cache, DeepSpeed's async-I/O op build (275 s in CI on a quiet 2-core machine; over
# 600 s with other test runs beside it). Its own limit is _torchrun's 900 s, whose failure shows
# the launch's output; pytest's 600 s default would cut it first, with no output.
SLOW_RESULTS_TIMEOUT_S = 1200


@pytest.fixture(scope="module")
def slow_results(tmp_path_factory):
    cases = (["zero3_nvme"] if _aio_buildable() else []) + SLOW_RUN
    return _torchrun(tmp_path_factory.mktemp("deepspeed_slow"), "--cases", ",".join(cases), "--native-pipeline-moe")


@pytest.mark.timeout(SLOW_RESULTS_TIMEOUT_S)
def test_pipeline_moe_aux_loss_matches_native(slow_results):
    """debug_moe through DeepSpeed's pipeline (pp=2): the aux loss is weighted 1/accumulation steps
    (later steps' losses and aux follow the native pipeline's), logged (not 0), and the MoE layers
    of both stages reach the moe/* metrics."""
    from launcher.observe.moe_load import KEYS

    ds, native = slow_results["pipeline_moe"], slow_results["native_pipeline_moe"]
    _assert_built_the_layout(ds, "pipeline_moe")
    assert ds["layout"]["pp"] == 2 and ds["built"]["backends"]["gradient_accumulation_steps"] == 4
    _assert_matches(ds["steps"], native["steps"], "DeepSpeed pipeline MoE vs native pipeline")
    for i, (got, want) in enumerate(zip(ds["steps"], native["steps"])):
        assert want["moe_aux_loss"] > 0, f"native step {i} logs no aux loss"
        assert _rel(got["moe_aux_loss"], want["moe_aux_loss"]) <= RTOL, (
            f"step {i}: DeepSpeed pipeline aux loss {got['moe_aux_loss']} vs native {want['moe_aux_loss']}")
    metrics = ds["moe_metrics"]
    assert set(KEYS) <= set(metrics), f"moe/* metrics missing for the DeepSpeed pipeline: {metrics}"
    assert metrics["moe/aux_loss"] > 0 and metrics["moe/idle_experts"] == native["moe_metrics"]["moe/idle_experts"]
    for key in KEYS:
        assert math.isclose(metrics[key], native["moe_metrics"][key], rel_tol=RTOL, abs_tol=1e-12), (
            f"{key}: DeepSpeed pipeline {metrics[key]} vs native {native['moe_metrics'][key]}")


@pytest.mark.timeout(SLOW_RESULTS_TIMEOUT_S)
def test_pipeline_engine_and_nvme_offload(slow_results, reference):
    """DeepSpeed's pipeline engine (pp=2, ZeRO-1) and ZeRO-3 with params + optimizer on NVMe (a local folder)."""
    res = slow_results
    cases = [c for c in ("zero3_nvme", "pipeline_zero1") if c in res]
    for case in cases:
        spec = spec_for(SLOW_CASES[case])
        ref_steps, ref_weights = reference if spec.model.dim == 64 else reference_run(spec, spec.trainer.steps)
        if case == "zero3_nvme":  # DeepSpeedCPUAdam vs torch AdamW: see NVME_* above
            _assert_matches(res[case]["steps"], ref_steps, case, grad_norm_rtol=NVME_GRAD_NORM_RTOL)
            _assert_weights_match(res[case]["export"], ref_weights, case, atol=NVME_WEIGHT_ATOL,
                                  mean_atol=NVME_WEIGHT_MEAN_ATOL)
        else:
            _assert_matches(res[case]["steps"], ref_steps, case)
            _assert_weights_match(res[case]["export"], ref_weights, case)
    assert res["pipeline_zero1"]["backends"]["pp"] == "DeepSpeed PipelineModule (2 stages, 1F1B)"
    for case in cases:
        _assert_built_the_layout(res[case], case)
    if "zero3_nvme" in res:
        assert res["zero3_nvme"]["nvme_bytes"] > 0, "nothing was swapped to the NVMe folder"
    else:
        pytest.fail("NVMe offload did not run: DeepSpeed's async_io op needs libaio. Fix: apt-get install libaio-dev (make test does this).")


def _assert_rehearsal_holds_the_real_partitions(run: dict, case: str, overrides, tmp_path: Path) -> None:
    """`action=rehearse` of `case` (deepspeed.initialize on a fake group of 2, fake tensors):
    each rank's partition bytes equal those DeepSpeed built in the real 2-process run, the
    plan's prediction for that rank, and the optimizer states the real run's steps created."""
    from launcher.config.loader import save_spec
    from launcher.rehearse.driver import rehearsal_problems, rehearse
    from launcher.plan.present.plan import build_plan

    spec = spec_for(list(overrides) + ["rehearse.activations=false"])
    plan = build_plan(spec, None)
    save_spec(spec, tmp_path)
    plan.save(tmp_path)
    rehearsed = rehearse(spec, plan, tmp_path)
    assert rehearsed["ok"], rehearsal_problems(rehearsed, plan.layout)
    real = run["held_per_rank"]
    assert len(real) == len(rehearsed["ranks"]) == 2
    for held, stepped, row in zip(real, run["optimizer_after_steps_per_rank"], rehearsed["ranks"]):
        got = {"params_numel": row["params_numel"], **{k: row["memory"][k] for k in ("params", "grads", "optimizer")}}
        assert got == {k: held[k] for k in got}, f"{case} rank {row['rank']}: rehearsal {got} != real run {held}"
        assert {k: held[k] for k in ("params", "grads", "optimizer")} == \
            {k: row["predicted"][k] for k in ("params", "grads", "optimizer")}, row
        # `optimizer` is the fp32 master partition and AdamW's two states of its shape, which the
        # rehearsal cannot create (DeepSpeed makes them in its first step): the real steps made these.
        assert held["optimizer"] > 0 and 2 * held["optimizer"] == 3 * stepped["states"], (case, held, stepped)


def test_rehearsal_holds_the_real_zero3_partitions(results, tmp_path):
    """ZeRO-3: zero.Init builds the partitions as fake tensors."""
    _assert_rehearsal_holds_the_real_partitions(results["zero3"], "zero3", CASES["zero3"], tmp_path)


@pytest.mark.parametrize("case", ["zero1", "zero2"])
def test_rehearsal_holds_the_real_zero12_partitions(results, case, tmp_path):
    """ZeRO-1/2: the whole module as fake tensors, DeepSpeed's flat working copy, fp32 master
    partition and (ZeRO-2) gradient partition (launcher.engines.deepspeed.fake_module_stays_put)."""
    _assert_rehearsal_holds_the_real_partitions(results[case], case, CASES[case], tmp_path)


@pytest.mark.timeout(SLOW_RESULTS_TIMEOUT_S)
def test_rehearsal_holds_the_real_pipeline_partitions(slow_results, tmp_path):
    """DeepSpeed's pipeline engine (pp=2, ZeRO-1): each rank's stage built by PipelineModule from
    meta tensors, then PipelineEngine (launcher.engines.deepspeed.fake_pipeline_counts_readable)."""
    _assert_rehearsal_holds_the_real_partitions(slow_results["pipeline_zero1"], "pipeline_zero1",
                                                SLOW_CASES["pipeline_zero1"], tmp_path)
