#!/usr/bin/env bash
# The single-GPU acceptance rows through the real `train` command (bench/gpu_acceptance.py says
# what each row checks). On the lent GPU machine, from the repo root, after ../shared/gpu/wheels.sh
# wrote .whl/ here:
#
#   bash bench/gpu_acceptance.sh OUTDIR [--rows a,b,c] [--cpu-smoke]
#
# BUDGET_S (default 480) stops starting rows that would run past it. PYTHON chooses the interpreter
# (default .venv/bin/python, else python3). Wheels in .whl/ are installed into /tmp/site first.
set -uo pipefail
out=${1:?usage: bash bench/gpu_acceptance.sh OUTDIR [--rows a,b,c] [--cpu-smoke]}
shift
cd "$(dirname "$0")/.."
py=${PYTHON:-}
[ -z "$py" ] && { [ -x .venv/bin/python ] && py=.venv/bin/python || py=python3; }
# The GPU image lacks hydra & co.: install the carried wheels once (never where hydra imports).
if compgen -G ".whl/*.whl" >/dev/null && ! "$py" -c 'import hydra' 2>/dev/null && [ ! -d /tmp/site/hydra ]; then
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
fi
[ -d /tmp/site ] && export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec "$py" bench/gpu_acceptance.py "$out" "$@"
