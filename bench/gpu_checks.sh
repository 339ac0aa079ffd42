#!/usr/bin/env bash
# The GPU checks of docs/benchmarks.md in one go, on a machine with one CUDA GPU.
#
#   bash bench/gpu_checks.sh OUTDIR [CHECK ...]
#
# CHECK: env, moe, moe_32k, rehearse, throughput, throughput_8b, throughput_moe (default: all, in that order). Each
# check's markdown goes to OUTDIR/results.md, its stderr to OUTDIR/stderr.log, JSON beside them.
# PYTHON chooses the interpreter (default .venv/bin/python, else python3); BUDGET_S (default
# 3300) stops starting checks that would run past it, so a time-boxed session keeps what ran.
set -u
out=${1:?usage: bash bench/gpu_checks.sh OUTDIR [CHECK ...]}
shift
checks=("$@")
[ ${#checks[@]} -eq 0 ] && checks=(env moe moe_32k rehearse throughput throughput_8b throughput_moe)
py=${PYTHON:-}
[ -z "$py" ] && { [ -x .venv/bin/python ] && py=.venv/bin/python || py=python3; }
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
start=$SECONDS
budget=${BUDGET_S:-3300}

# run NAME MIN_SECONDS CMD...: runs CMD if MIN_SECONDS still fit in the budget, under a timeout
# of what is left; appends its stdout to results.md.
run() {
  local name=$1 need=$2
  shift 2
  local left=$((budget - (SECONDS - start)))
  if [ "$left" -lt "$need" ]; then
    echo "## $name: not run ($left s left of the budget, needs ~$need s)" | tee -a "$out/results.md"
    return
  fi
  echo "== $name ($left s left): $*" | tee -a "$out/stderr.log"
  local t0=$SECONDS
  timeout "$left" "$@" >>"$out/results.md" 2>>"$out/stderr.log"
  local rc=$?
  echo "   $name rc=$rc in $((SECONDS - t0)) s" | tee -a "$out/stderr.log"
  echo "" >>"$out/results.md"
}

for check in "${checks[@]}"; do
  case $check in
    env)
      {
        echo "## environment, $(date -u '+%Y-%m-%d %H:%M UTC')"
        echo '```'
        nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
        "$py" -c 'import torch, sys; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(), torch.cuda.get_device_capability())'
        "$py" -c 'import torchao; print("torchao", torchao.__version__)' 2>&1 | tail -1
        "$py" -c 'import launcher.runtime.entry, launcher.engines.native; print("launcher imports: ok")' 2>&1 | tail -1
        echo '```'
      } >>"$out/results.md" 2>&1
      ;;
    moe) run gpu_moe 60 "$py" bench/gpu_moe.py ;;
    moe_32k) run gpu_moe_32k 60 "$py" bench/gpu_moe.py --tokens 32768 ;;
    rehearse) run rehearse_gpu 180 "$py" bench/rehearse_gpu.py --json "$out/rehearse_gpu.json" ;;
    throughput) run gpu_throughput 240 "$py" bench/gpu_throughput.py --json "$out/throughput_llama_1b.json" ;;
    throughput_8b)
      # Eight Llama-3-8B layers: fp8's gain at 8B width (the 1B model's GEMMs are small for it; with
      # fewer layers the bf16 output projection, 0.5 B parameters, takes a larger share).
      run gpu_throughput_8b 240 "$py" bench/gpu_throughput.py --model llama3_8b --seq-len 4096 --micro-batch 1 \
        --set model.n_layers=8 --json "$out/throughput_8b.json" ;;
    throughput_moe)
      # One Mixtral-8x7B layer (1.7 B parameters): the MoE path (router, grouped GEMM, fp8 experts) at full width.
      run gpu_throughput_moe 240 "$py" bench/gpu_throughput.py --model mixtral_8x7b --seq-len 4096 --micro-batch 2 \
        --set model.n_layers=1 --json "$out/throughput_moe.json" ;;
    *) echo "unknown check '$check': choose env, moe, moe_32k, rehearse, throughput, throughput_8b, throughput_moe" >&2; exit 2 ;;
  esac
done
cat "$out/results.md"
