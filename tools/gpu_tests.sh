#!/usr/bin/env bash
# The GPU test tier: every test compiled on one GPU (no interpreter), in parallel processes, with the hypothesis example
# counts scaled down (each new shape compiles), and a record of the run. Run it after every kernel or engine change:
#   bash tools/gpu_tests.sh [OUTDIR]          (default OUTDIR: records/; the record is OUTDIR/gpu_tier.json)
# Each phase's output goes to OUTDIR/gpu_tier_PHASE.log as it runs, so a run stopped early still shows how far it got,
# and its JUnit report to OUTDIR/gpu_tier_junit_PHASE.xml, so that a run stopped after pytest can still be recorded:
#   python3 tools/gpu_record.py OUTDIR/gpu_tier_junit_*.xml --out OUTDIR/gpu_tier.json
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
# Two phases, as CI runs them: the tests that start process groups of their own (spawned ranks, torchrun) run after
# the rest, alone (one pytest process), not beside twelve workers that take the cores their ranks need.
# PROCESSES_LIMIT_S: interrupt the second phase (SIGINT) after that many seconds: pytest then still writes its report
# and prints where it stood, so that a test that hangs on some machine is named and the rest is recorded.
collect() {   # collect NAME MARKERS: what a phase is to run, so that the record names a test it was stopped in
  python3 -m pytest ${TESTS:-tests/} -m "$2" --collect-only -q -p no:cacheprovider 2>/dev/null | grep '::' \
    > "$OUTDIR/gpu_tier_ids_$1.txt"
}
# both phases' lists are collected in the background, beside the first phase, not before it
collect main "not cpu_exact and not processes" & c1=$!
collect processes "processes and not cpu_exact" & c2=$!
run() {   # run NAME MARKERS WORKERS [LIMIT_S]
  ${4:+timeout -s INT -k 20 "$4"} python3 -m pytest ${TESTS:-tests/} -m "$2" -n "$3" -q -p no:cacheprovider \
    --junitxml="$OUTDIR/gpu_tier_junit_$1.xml" --durations=15 2>&1 | tee "$OUTDIR/gpu_tier_$1.log" | tail -40
  return "${PIPESTATUS[0]}"
}
run main "not cpu_exact and not processes" "${WORKERS:-12}"; status=$?
run processes "processes and not cpu_exact" 0 "${PROCESSES_LIMIT_S:-}"; s2=$?
# pytest's 5: nothing collected (TESTS without such tests)
[ "$s2" = 5 ] && s2=0; [ "$status" = 0 ] && status=$s2
wait $c1 $c2
reports=$(ls "$OUTDIR"/gpu_tier_junit_main.xml "$OUTDIR"/gpu_tier_junit_processes.xml 2>/dev/null)
python3 tools/gpu_record.py $reports --out "$OUTDIR/gpu_tier.json" --setup-s "$setup" \
  --collected $(ls "$OUTDIR"/gpu_tier_ids_main.txt "$OUTDIR"/gpu_tier_ids_processes.txt 2>/dev/null) \
  --wall-s "$(( $(date +%s) - start ))"
exit "$status"
