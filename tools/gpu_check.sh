#!/usr/bin/env bash
# On a GPU machine, from the repo root: run every `#| gpu` cell (nbdev_test --flags gpu), the pytest suite with compiled
# kernels, the benchmarks, and re-execute the kernel notebooks so their committed outputs carry GPU numbers.
#   bash tools/gpu_check.sh OUTDIR [notebooks to re-execute ...]
# Wheels for nbdev on a machine without a registry: ../shared/tools/gpu-wheels.sh puts them in .whl/ (installed here).
set -uo pipefail
OUTDIR=${1:-/tmp/gpu_out}; shift || true
NOTEBOOKS=${*:-nbs/01_formats.ipynb}
mkdir -p "$OUTDIR"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
status=0
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; date -u; } | tee "$OUTDIR/machine.txt"
nbdev_test --flags gpu --timing 2>&1 | tee "$OUTDIR/nbdev_test_gpu.log"; status=$((status | PIPESTATUS[0]))
python3 -m pytest tests/ -q -p no:cacheprovider 2>&1 | tail -15 | tee "$OUTDIR/pytest_gpu.log"; status=$((status | PIPESTATUS[0]))
python3 tools/bench_formats.py --json "$OUTDIR/bench_formats.json" 2>&1 | tee "$OUTDIR/bench_formats.txt"; status=$((status | PIPESTATUS[0]))
for nb in $NOTEBOOKS; do
  python3 tools/run_nb.py "$nb" --flags gpu 2>&1 | tee -a "$OUTDIR/run_nb.log" && cp "$nb" "$OUTDIR/"; status=$((status | PIPESTATUS[0]))
done
cp images/formats_bandwidth.png "$OUTDIR/" 2>/dev/null || true
echo "gpu_check exit status $status"
exit $status
