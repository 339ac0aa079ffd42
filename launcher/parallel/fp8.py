"""FP8 training on the native path: torchao float8 linears, plus the hardware check.

Call order on a rank (the parallelize step owns it):

    problem = fp8_hardware_problem(device_type, compute_capability, cfg.emulate)   # refuse early
    model = convert_to_float8(model, cfg, device_type=..., fsdp_enabled=...)       # before TP / FSDP
    ... apply TP, activation checkpointing, compile, FSDP ...
    each step:  optimizer.step(); precompute_float8_scales(model)                  # if all-gather is on

What stays in bf16 and why:
- the output layer: the logits feed a softmax over the whole vocabulary, and fp8's 3-bit
  mantissa there costs loss for a small share of the FLOPs;
- the MoE router: top-k selection is discontinuous, so a rounding error flips which expert a
  token goes to;
- the MoE routed experts (``GroupedExperts``, batched [E, ...] weights, not nn.Linear) except on
  CUDA >= 8.9 with the grouped path: there ``convert_experts_to_float8`` hands them to torchao's
  fp8 grouped GEMM (torchao.prototype.moe_training, on torch._scaled_grouped_mm, which has no CPU
  kernel in torch 2.13 / torchao 0.18, so only the wiring is tested here, not a GPU run);
  elsewhere ``fp8_expert_note`` logs why they stay bf16 (shared experts are nn.Linear: fp8);
- names listed in ``precision.fp8.exclude``;
- linears whose in/out features are not multiples of 16 (the FP8 GEMM kernels require it) or
  are smaller than ``precision.fp8.min_features`` (the casts cost more than the GEMM saves).

Emulation: ``precision.fp8.emulate=true`` lets FP8 run where there are no FP8 tensor cores
(CPU, A100): torchao casts to float8 and back and multiplies in high precision, so the numerics
match FP8 training but nothing gets faster.

torch and torchao are imported lazily inside the functions so that importing this module
(e.g. from the validator for `fp8_hardware_problem`) stays cheap.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Dict, List, Optional, Tuple

from launcher.config.schema import Fp8Config

if TYPE_CHECKING:  # pragma: no cover
    import torch.nn as nn

log = logging.getLogger(__name__)

FP8_RECIPES = ("tensorwise", "rowwise")
# FP8 tensor cores arrived with Ada (8.9: L4, L40S) and Hopper (9.0: H100, H200).
FP8_MIN_COMPUTE_CAPABILITY: Tuple[int, int] = (8, 9)
# The FP8 GEMM (torch._scaled_mm) requires both matrix dimensions to be multiples of 16.
FP8_DIM_MULTIPLE = 16


# --------------------------------------------------------------------------- hardware


def fp8_hardware_problem(
    device_type: str, compute_capability: Optional[Tuple[int, int]], emulate: bool
) -> Optional[str]:
    """Why FP8 training cannot run on this device, or None when it can.

    `device_type` is "cuda" or "cpu" (anything else is treated like the CPU);
    `compute_capability` is `torch.cuda.get_device_capability()` for CUDA, None when
    unknown. With `emulate=True` every device is accepted (numerics only, no speed-up).
    """
    if emulate:
        return None
    if device_type != "cuda":
        return (
            f"precision=fp8 on device '{device_type}': it has no FP8 tensor cores "
            f"(needs an NVIDIA GPU with compute capability >= "
            f"{FP8_MIN_COMPUTE_CAPABILITY[0]}.{FP8_MIN_COMPUTE_CAPABILITY[1]}). "
            "Fix: precision=bf16, or precision.fp8.emulate=true to check FP8 numerics (slow)."
        )
    if compute_capability is None:
        return (
            "precision=fp8: the GPU's compute capability is unknown, so FP8 support cannot be "
            "checked. Fix: run where torch.cuda.get_device_capability() works, or "
            "precision.fp8.emulate=true."
        )
    cc = tuple(compute_capability)
    if cc < FP8_MIN_COMPUTE_CAPABILITY:
        need = f"{FP8_MIN_COMPUTE_CAPABILITY[0]}.{FP8_MIN_COMPUTE_CAPABILITY[1]}"
        return (
            f"precision=fp8 on a GPU with compute capability {cc[0]}.{cc[1]}: FP8 tensor cores need "
            f">= {need} (L40S, H100, H200, B200; an A100 is 8.0). "
            "Fix: precision=bf16, or precision.fp8.emulate=true to check FP8 numerics (slow, no speed-up)."
        )
    return None


def device_compute_capability(device_type: str) -> Optional[Tuple[int, int]]:
    """The current CUDA device's compute capability, None off CUDA."""
    if device_type != "cuda":
        return None
    import torch  # lazy: keeps this module torch-free for the planner's fp8_hardware_problem

    if not torch.cuda.is_available():
        return None
    return tuple(torch.cuda.get_device_capability())  # type: ignore[return-value]


def needs_emulation(device_type: str, compute_capability: Optional[Tuple[int, int]]) -> bool:
    """True where FP8 GEMMs must be emulated (no FP8 tensor cores)."""
    if device_type != "cuda" or compute_capability is None:
        return True
    return tuple(compute_capability) < FP8_MIN_COMPUTE_CAPABILITY


# --------------------------------------------------------------------------- module filter


@dataclass
class Float8ConversionReport:
    """Which nn.Linear layers become float8 and which stay in bf16 (name -> reason)."""

    recipe: str
    converted: List[str] = field(default_factory=list)
    kept: Dict[str, str] = field(default_factory=dict)
    all_gather: bool = False
    emulated: bool = False
    already_float8: int = 0  # Float8Linear layers found (converted by an earlier call)

    @property
    def total(self) -> int:
        return len(self.converted) + len(self.kept)

    def summary(self) -> str:
        """One log line, e.g. "converted 28 of 30 Linear layers to float8 (tensorwise); ..."."""
        line = (
            f"converted {len(self.converted)} of {self.total} Linear layers to float8 ({self.recipe}"
            f"{', emulated' if self.emulated else ''}"
            f"{', float8 all-gather' if self.all_gather else ''})"
        )
        if self.kept:
            # Group by reason so a 126-layer model prints one short line.
            by_reason: Dict[str, List[str]] = {}
            for name, reason in self.kept.items():
                by_reason.setdefault(reason, []).append(name)
            parts = []
            for reason, names in by_reason.items():
                shown = ", ".join(names[:4]) + (f" (+{len(names) - 4} more)" if len(names) > 4 else "")
                parts.append(f"{shown} [{reason}]")
            line += "; kept in bf16: " + "; ".join(parts)
        return line


def _excluded_by_name(fqn: str, exclude: List[str]) -> Optional[str]:
    """The exclude entry matching `fqn`, by whole dotted component (so "output" does not match
    "attention.output_proj" but does match "output" and "layers.0.moe.output")."""
    parts = fqn.split(".")
    for pattern in exclude:
        pattern_parts = pattern.split(".")
        n = len(pattern_parts)
        for i in range(len(parts) - n + 1):
            if parts[i : i + n] == pattern_parts:
                return pattern
    return None


def float8_skip_reason(module: "nn.Module", fqn: str, cfg: Fp8Config) -> Optional[str]:
    """Why the nn.Linear `module` at `fqn` stays in bf16, or None if it goes float8."""
    matched = _excluded_by_name(fqn, list(cfg.exclude))
    if matched is not None:
        return f"excluded by name '{matched}'"
    out_features, in_features = module.weight.shape
    if in_features % FP8_DIM_MULTIPLE or out_features % FP8_DIM_MULTIPLE:
        return f"{in_features}x{out_features} not divisible by {FP8_DIM_MULTIPLE}"
    if min(in_features, out_features) < cfg.min_features:
        return f"{in_features}x{out_features} smaller than min_features={cfg.min_features}"
    return None


def plan_float8_conversion(model: "nn.Module", cfg: Fp8Config) -> Float8ConversionReport:
    """Decide, without changing the model, which Linear layers `convert_to_float8` converts."""
    import torch.nn as nn  # lazy: keeps this module torch-free for the planner's fp8_hardware_problem
    # lazy: torchao is slow to import (~0.6 s); only fp8 runs use it
    from torchao.float8.float8_linear import Float8Linear

    report = Float8ConversionReport(recipe=cfg.recipe)
    for fqn, module in model.named_modules():
        if isinstance(module, Float8Linear):
            report.already_float8 += 1  # from an earlier conversion
            continue
        if type(module) is not nn.Linear:
            continue
        reason = float8_skip_reason(module, fqn, cfg)
        if reason is None:
            report.converted.append(fqn)
        else:
            report.kept[fqn] = reason
    return report


def float8_module_filter(cfg: Fp8Config) -> Callable[["nn.Module", str], bool]:
    """The `module_filter_fn` for torchao: True for the linears that become float8."""
    import torch.nn as nn  # lazy: keeps this module torch-free for the planner's fp8_hardware_problem

    def keep_float8(module: "nn.Module", fqn: str) -> bool:
        # Exact type: a Float8Linear (an nn.Linear subclass) must not be converted twice.
        return type(module) is nn.Linear and float8_skip_reason(module, fqn, cfg) is None

    return keep_float8


# --------------------------------------------------------------------------- conversion


def float8_all_gather_enabled(cfg: Fp8Config, fsdp_enabled: bool) -> bool:
    """FSDP2 all-gathers float8 weights only with FSDP and the tensorwise recipe.

    Rowwise scales each row separately, which the all-gather hook cannot express
    (torchao asserts on it), so rowwise all-gathers bf16 weights instead.
    """
    return bool(cfg.all_gather and fsdp_enabled and cfg.recipe == "tensorwise")


def build_float8_linear_config(cfg: Fp8Config, *, fsdp_enabled: bool, emulate: bool):
    """torchao's Float8LinearConfig for `cfg.recipe`, with all-gather and emulation set."""
    from torchao.float8 import Float8LinearConfig  # lazy: torchao is slow to import (~0.6 s); only fp8 runs use it

    if cfg.recipe not in FP8_RECIPES:
        raise ValueError(
            f"precision.fp8.recipe={cfg.recipe!r} is not supported; choose one of {', '.join(FP8_RECIPES)}."
        )
    base = Float8LinearConfig.from_recipe_name(cfg.recipe)
    return dataclasses.replace(
        base,
        enable_fsdp_float8_all_gather=float8_all_gather_enabled(cfg, fsdp_enabled),
        emulate=emulate,
    )


def convert_to_float8(
    model: "nn.Module",
    cfg: Fp8Config,
    *,
    device_type: str,
    fsdp_enabled: bool,
    compute_capability: Optional[Tuple[int, int]] = None,
) -> "nn.Module":
    """Swap the model's eligible nn.Linear layers for torchao Float8Linear, in place.

    Call it on the freshly built model (meta device is fine) before tensor parallel, FSDP and
    compile. `device_type` is where the model will train ("cuda" or "cpu");
    `compute_capability` defaults to the current CUDA device's. Raises RuntimeError when the
    device has no FP8 support and `cfg.emulate` is false. Returns the same model object; the
    decision is logged and kept on `model.float8_report` (a Float8ConversionReport).
    """
    # lazy: torchao is slow to import (~0.6 s); only fp8 runs use it
    from torchao.float8 import convert_to_float8_training

    if compute_capability is None:
        compute_capability = device_compute_capability(device_type)
    problem = fp8_hardware_problem(device_type, compute_capability, cfg.emulate)
    if problem:
        raise RuntimeError(problem)
    emulate = needs_emulation(device_type, compute_capability)

    report = plan_float8_conversion(model, cfg)
    report.all_gather = float8_all_gather_enabled(cfg, fsdp_enabled)
    report.emulated = emulate
    if cfg.all_gather and fsdp_enabled and not report.all_gather:
        log.info(
            "precision.fp8.all_gather=true is ignored with recipe=%s: float8 all-gather needs the "
            "tensorwise recipe, so FSDP all-gathers bf16 weights", cfg.recipe,
        )
    if not report.converted and report.already_float8:
        log.info("model already has %d float8 Linear layers; nothing more to convert", report.already_float8)
    elif not report.converted:
        log.warning(
            "precision=fp8 converted no Linear layer (%d kept in bf16): %s. The model trains in bf16; "
            "check precision.fp8.exclude / min_features.", report.total, report.summary(),
        )
    else:
        convert_to_float8_training(
            model,
            module_filter_fn=float8_module_filter(cfg),
            config=build_float8_linear_config(cfg, fsdp_enabled=fsdp_enabled, emulate=emulate),
        )
        log.info(report.summary())
    convert_experts_to_float8(model, device_type=device_type, compute_capability=compute_capability)
    # A plain attribute, not a buffer: it must stay out of state_dict and checkpoints.
    object.__setattr__(model, "float8_report", report)
    return model


def fp8_experts_skip_reason(
    experts: "nn.Module", device_type: str, compute_capability: Optional[Tuple[int, int]]
) -> Optional[str]:
    """Why the routed experts `experts` (a GroupedExperts) stay bf16 under fp8, None when
    torchao's fp8 grouped GEMM can take them.

    It needs CUDA with FP8 tensor cores (torch._scaled_grouped_mm has no CPU kernel and no
    emulation), the grouped path of launcher/models/grouped_mm.py (the per-expert loop has no
    torch._grouped_mm call for torchao to intercept), and expert dims that are multiples of 16.
    """
    import torch  # lazy: keeps this module torch-free for the planner's fp8_hardware_problem

    # lazy: grouped_mm imports torch; keeps this module torch-free for the planner's fp8_hardware_problem
    from launcher.models.grouped_mm import grouped_mm_problem

    if device_type != "cuda":
        return (f"device '{device_type}': torchao's fp8 grouped GEMM needs torch._scaled_grouped_mm, "
                "which has no CPU kernel")
    if compute_capability is None or tuple(compute_capability) < FP8_MIN_COMPUTE_CAPABILITY:
        return (f"compute capability {compute_capability} < 8.9: no FP8 tensor cores, and torchao's fp8 "
                "grouped GEMM has no emulation")
    if getattr(experts, "implementation", "auto") == "loop":
        return "experts forced to the per-expert loop: no torch._grouped_mm call to intercept"
    _, hidden, dim = experts.w1.shape
    # The grouped path's own check, on meta bf16 stand-ins (training computes in bf16 on CUDA;
    # the device checks passed above).
    x = torch.empty(1, dim, dtype=torch.bfloat16, device="meta")
    w1 = torch.empty(1, hidden, dim, dtype=torch.bfloat16, device="meta")
    problem = grouped_mm_problem(x, w1, w1.transpose(-2, -1))
    if problem:
        return f"experts take the per-expert loop ({problem}): no torch._grouped_mm call to intercept"
    if dim % FP8_DIM_MULTIPLE or hidden % FP8_DIM_MULTIPLE:
        return f"dim={dim}, hidden={hidden} not divisible by {FP8_DIM_MULTIPLE}"
    return None


def convert_experts_to_float8(
    model: "nn.Module", *, device_type: str, compute_capability: Optional[Tuple[int, int]]
) -> List[str]:
    """Give the routed experts' w1/w2/w3 torchao's fp8 grouped-GEMM weight wrapper where it can
    run (see `fp8_experts_skip_reason`); log once what was converted or why not.

    Call it before FSDP / EP wrapping, like the nn.Linear swap. torchao.prototype.moe_training's
    Float8TrainingOpConfig swaps each Parameter's data for a Float8TrainingWeightWrapperTensor,
    whose __torch_function__ routes ``torch._grouped_mm(A_2d, B_3d, offs=...)`` to its rowwise
    fp8 scaled grouped GEMM (B = w.transpose(-2, -1), as our grouped path passes it; transpose
    keeps the wrapper). pad_token_groups_for_grouped_mm stays False: torchao 0.18 asserts it is
    unsupported for fp8, so our grouped path pads each expert's group to 16 rows itself
    (grouped_mm.py). Returns the converted modules' names.
    """
    experts = [(fqn, m) for fqn, m in model.named_modules() if type(m).__name__ == "GroupedExperts"]
    if not experts:
        return []
    convert, kept = [], {}
    for fqn, module in experts:
        reason = fp8_experts_skip_reason(module, device_type, compute_capability)
        if reason is None:
            convert.append(fqn)
        else:
            kept[fqn] = reason
    if convert:
        # lazy: torchao is slow to import (~0.6 s); only fp8 runs use it
        from torchao.prototype.moe_training.config import Float8TrainingOpConfig
        from torchao.quantization import quantize_  # lazy: torchao is slow to import (~0.6 s); only fp8 runs use it

        names = set(convert)
        quantize_(model, Float8TrainingOpConfig(pad_token_groups_for_grouped_mm=False),
                   filter_fn=lambda m, fqn: fqn in names)
        log.info("precision=fp8: the routed experts (w1/w2/w3) of %d MoE layers use torchao's rowwise fp8 "
                 "grouped GEMM (torchao.prototype.moe_training, CUDA compute capability %s); "
                 "router kept bf16 by design, shared experts fp8 as nn.Linear", len(convert), compute_capability)
    if kept:
        log.info(fp8_expert_note(model, sorted(set(kept.values()))))
    return convert


def fp8_expert_note(model: "nn.Module", reasons: Optional[List[str]] = None) -> Optional[str]:
    """The log line saying that the model's routed MoE experts stay bf16 under fp8 (None
    without MoE layers)."""
    n = sum(1 for m in model.modules() if type(m).__name__ == "GroupedExperts")
    if not n:
        return None
    why = "; ".join(reasons) if reasons else (
        "torchao's fp8 grouped GEMM needs torch._scaled_grouped_mm on CUDA >= 8.9 (no CPU kernel)")
    return (f"precision=fp8: the routed experts of {n} MoE layers stay bf16 ({why}); "
            f"router kept bf16 by design, shared experts fp8")


# --------------------------------------------------------------------------- per step


def float8_scale_precompute_needed(model: "nn.Module") -> bool:
    """True when the model has float8 linears whose weights FSDP all-gathers in float8.

    Only then does `precompute_float8_scales` do anything; evaluate it once after
    parallelisation and skip the per-step call otherwise.
    """
    # lazy: torchao is slow to import (~0.6 s); only fp8 runs use it
    from torchao.float8.float8_linear import Float8Linear

    return any(
        isinstance(m, Float8Linear) and m.config.enable_fsdp_float8_all_gather for m in model.modules()
    )


def precompute_float8_scales(model: "nn.Module") -> None:
    """Call after every optimizer.step() when float8 all-gather is on.

    It computes all float8 weight scales with one all-reduce of the per-weight amax, instead
    of one small all-reduce per weight inside the next forward's all-gather. A no-op for
    models without float8 all-gather weights (e.g. no FSDP, or the rowwise recipe).
    """
    # lazy: torchao is slow to import (~0.6 s); only fp8 runs use it
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    precompute_float8_dynamic_scale_for_fsdp(model)
