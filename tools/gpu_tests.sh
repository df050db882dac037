#!/usr/bin/env bash
# The GPU test tier: every test compiled on one GPU (no interpreter), in parallel processes, with the hypothesis example
# counts scaled down (each new shape compiles), and a record of the run. Run it after every kernel or engine change:
#   bash tools/gpu_tests.sh [OUTDIR]          (default OUTDIR: records/; the record is OUTDIR/gpu_tier.json)
# pytest's whole output goes to OUTDIR/gpu_tier.log as it runs, so a run stopped early still shows how far it got, and
# its JUnit report to OUTDIR/gpu_tier_junit.xml, so that a run stopped after pytest can still be recorded:
#   python3 tools/gpu_record.py OUTDIR/gpu_tier_junit.xml --out OUTDIR/gpu_tier.json
# Environment: DSV41_EXAMPLES (default 0.5: half the CPU suite's examples), WORKERS (default 12 pytest processes),
# TESTS (default: tests/), DSV41_COMMIT (the commit to record when the tree has no .git).
# A GPU machine that cannot reach a package index needs the wheels of `bash tools/gpu_wheels.sh` in .whl/.
set -uo pipefail
cd "$(dirname "$0")/.."
OUTDIR=${1:-records}
start=$(date +%s)
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1 DSV41_EXAMPLES=${DSV41_EXAMPLES:-0.5}
unset TRITON_INTERPRET
python3 -c "import torch; assert torch.cuda.is_available(), 'the GPU tier needs a GPU'" || exit 1
mkdir -p "$OUTDIR"
setup=$(( $(date +%s) - start ))
python3 -m pytest ${TESTS:-tests/} -m "not cpu_exact" -n "${WORKERS:-12}" -q -p no:cacheprovider \
  --junitxml="$OUTDIR/gpu_tier_junit.xml" --durations=15 2>&1 | tee "$OUTDIR/gpu_tier.log" | tail -40
status=${PIPESTATUS[0]}
python3 tools/gpu_record.py "$OUTDIR/gpu_tier_junit.xml" --out "$OUTDIR/gpu_tier.json" --setup-s "$setup" \
  --wall-s "$(( $(date +%s) - start ))"
exit "$status"
