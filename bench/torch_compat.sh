#!/usr/bin/env bash
# The launcher on another torch: a venv with that torch from the package index, its torchrun's
# flags written into the repo, then the CLI smoke on CPU through the real `train` command.
#
#   bash bench/torch_compat.sh VERSION [OUTDIR]      e.g. 2.11.0 (the floor) or 2.14.1
#
# Not in CI (each torch is a CUDA build: ~0.5 GB plus ~3 GB of NVIDIA libraries). Rerun it for
# the floor and the newest tested torch whenever pyproject's torch range changes, and put the
# table it prints into docs/benchmarks.md.
#
# Writes bench/reference/torchrun_flags/VERSION.txt (every option string of that torchrun's
# get_args_parser(); tests/test_torch_compat.py holds the launcher's command lines to the
# floor's list) and OUTDIR/results.md (default /tmp/torch_compat_VERSION). VENV_ROOT (default
# /tmp/torch_compat_venvs) keeps the venvs between runs.
set -uo pipefail
version=${1:?usage: bash bench/torch_compat.sh VERSION [OUTDIR]}
out=${2:-/tmp/torch_compat_$version}
root=$(cd "$(dirname "$0")/.." && pwd)
venv=${VENV_ROOT:-/tmp/torch_compat_venvs}/torch-$version
mkdir -p "$out"
results=$out/results.md
: >"$results"
cd "$root"

if [ ! -x "$venv/bin/train" ]; then
  echo "== installing torch $version into $venv (several GB on first use)"
  python3 -m venv "$venv" || exit 1
  "$venv/bin/python" -m pip install -q --upgrade pip || exit 1
  "$venv/bin/python" -m pip install -q "torch==$version" || exit 1
  # The launcher and its needs, keeping that torch (a constraint, not an upgrade).
  "$venv/bin/python" -m pip install -q -e "$root" "torch==$version" "deepspeed==0.19.8" "torchao==0.18.0" || exit 1
fi
py=$venv/bin/python
train=$venv/bin/train
torch_version=$("$py" -c 'import torch; print(torch.__version__)')

mkdir -p bench/reference/torchrun_flags
"$py" - "$version" <<'EOF'
import sys
from torch.distributed.run import get_args_parser
flags = sorted({s for a in get_args_parser()._actions for s in a.option_strings})
path = f"bench/reference/torchrun_flags/{sys.argv[1]}.txt"
with open(path, "w") as f:
    f.write(f"# torchrun's option strings in torch {sys.argv[1]} (get_args_parser), written by bench/torch_compat.sh\n")
    f.write("\n".join(flags) + "\n")
print(f"wrote {path}: {len(flags)} option strings")
EOF

work=$(mktemp -d /tmp/torch_compat_run.XXXXXX)
export OMP_NUM_THREADS=1 WANDB_MODE=offline
pass=0 fail=0
row() {  # row NAME SECONDS OK DETAIL
  echo "| $1 | $2 | $3 | $4 |" >>"$results"
  if [ "$3" = pass ]; then pass=$((pass + 1)); else fail=$((fail + 1)); fi
}
# check NAME CMD...: runs CMD in $work, logs to $out/NAME.log, one row.
check() {
  local name=$1 t0=$SECONDS
  shift
  if (cd "$work" && "$@") >"$out/$name.log" 2>&1; then
    row "$name" $((SECONDS - t0)) pass "$(tail -n 1 "$out/$name.log" | cut -c1-120)"
  else
    row "$name" $((SECONDS - t0)) FAIL "see $out/$name.log: $(tail -n 1 "$out/$name.log" | cut -c1-100)"
  fi
}
losses() {  # the step -> loss pairs of a run dir's metrics.jsonl
  "$py" -c 'import json,sys; print(json.dumps({r["step"]: r["loss"] for r in map(json.loads, open(sys.argv[1])) if "loss" in r}))' "$1/metrics.jsonl"
}

{
  echo "## torch $torch_version ($(date -u '+%Y-%m-%d %H:%M UTC'), $(nproc --all) CPUs, Python $("$py" -c 'import sys; print(sys.version.split()[0])'))"
  echo
  echo "| check | s | result | detail |"
  echo "|---|---|---|---|"
} >>"$results"

base=(+recipe=debug trainer.device=cpu trainer.steps=12 trainer.log_every=1 checkpoint.interval=4)
check train_2_ranks "$train" "${base[@]}" hydra.run.dir="$work/full"
# Kill every process of a run after its step-8 checkpoint, resume in the same run dir: equal losses.
resume_check() {
  "$train" "${base[@]}" hydra.run.dir="$work/killed" &
  local pid=$!
  for _ in $(seq 1 600); do
    [ -d "$work/killed/checkpoints/step_00000008" ] && break
    sleep 0.5
  done
  pkill -KILL -f -- "--run-dir $work/killed"; kill -KILL "$pid" 2>/dev/null; wait "$pid" 2>/dev/null
  "$train" "${base[@]}" hydra.run.dir="$work/killed" || return 1
  local a b
  a=$(losses "$work/full"); b=$(losses "$work/killed")
  [ "$a" = "$b" ] && echo "resumed losses equal the uninterrupted run's (12 steps)" || { echo "losses differ: $a vs $b"; return 1; }
}
check kill_and_resume resume_check
check plan "$train" +recipe=llama405b action=plan cluster.nodes=64
check rehearse "$train" +recipe=debug action=rehearse
check rehearse_pp "$train" +recipe=debug parallel.pp=2 action=rehearse
prepare_check() {
  mkdir -p raw
  for i in $(seq 1 200); do echo "{\"text\": \"document $i: the quick brown fox jumps over the lazy dog $i times\"}"; done >raw/a.jsonl
  "$py" - <<'EOF'
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
tok = Tokenizer(models.BPE(unk_token="<unk>"))
tok.pre_tokenizer = pre_tokenizers.Whitespace()
tok.train_from_iterator((l for l in open("raw/a.jsonl")), trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "<s>", "</s>"]))
import os; os.makedirs("tok", exist_ok=True); tok.save("tok/tokenizer.json")
EOF
  "$train" action=prepare prepare.input="$work/raw/a.jsonl" prepare.output="$work/prepared" prepare.tokenizer="$work/tok"
}
check prepare prepare_check
check slurm_dry_run "$train" +recipe=debug cluster=slurm cluster.dry_run=true cluster.nodes=2 hydra.run.dir="$work/slurm"
rm -rf "$work"

echo >>"$results"
echo "$pass passed, $fail failed" >>"$results"
cat "$results"
[ "$fail" -eq 0 ]
