#!/usr/bin/env bash
# On a GPU machine, from the repo root: run every `#| gpu` cell (nbdev_test --flags gpu), the pytest suite with compiled
# kernels, every tools/bench_*.py, and re-execute the kernel notebooks so their committed outputs carry GPU numbers.
#   bash tools/gpu_check.sh OUTDIR [notebooks to re-execute ...]
# Without a notebook list it re-executes the kernel notebooks that exist among 01_formats, 01b_records,
# 03b_compressor_kernel, 04b_indexer_kernels, 07a_mhc_kernel, 07b_mhc_speed, 08_moe, 08b_fused_moe and 09_engram_table.
# Each benchmark runs as `python3 tools/bench_NAME.py --json OUTDIR/bench_NAME.json`.
# A GPU machine that cannot reach a package index needs nbdev's wheels: `bash tools/gpu_wheels.sh` puts them in .whl/
# beforehand, and this script installs them from there.
set -uo pipefail
cd "$(dirname "$0")/.."
OUTDIR=${1:-/tmp/gpu_out}; shift || true
if [ $# -gt 0 ]; then NOTEBOOKS="$*"
else
  NOTEBOOKS=""
  for n in 01_formats 01b_records 03b_compressor_kernel 04b_indexer_kernels 07a_mhc_kernel 07b_mhc_speed 08_moe \
           08b_fused_moe 09_engram_table; do
    [ -f "nbs/$n.ipynb" ] && NOTEBOOKS="$NOTEBOOKS nbs/$n.ipynb"
  done
fi
mkdir -p "$OUTDIR"
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1 DSV41_SAVE_FIGURES=1
unset TRITON_INTERPRET
status=0
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; date -u; } | tee "$OUTDIR/machine.txt"
nbdev_test --flags gpu --timing 2>&1 | tee "$OUTDIR/nbdev_test_gpu.log"; status=$((status | PIPESTATUS[0]))
python3 -m pytest tests/ -q -p no:cacheprovider 2>&1 | tail -15 | tee "$OUTDIR/pytest_gpu.log"; status=$((status | PIPESTATUS[0]))
for bench in tools/bench_*.py; do
  [ -f "$bench" ] || continue
  name=$(basename "$bench" .py)
  echo "== $bench"
  python3 "$bench" --json "$OUTDIR/$name.json" 2>&1 | tee "$OUTDIR/$name.txt"; status=$((status | PIPESTATUS[0]))
done
for nb in $NOTEBOOKS; do
  echo "== re-executing $nb"
  python3 tools/run_nb.py "$nb" --flags gpu 2>&1 | tee -a "$OUTDIR/run_nb.log"; rc=${PIPESTATUS[0]}; status=$((status | rc))
  [ "$rc" -eq 0 ] && cp "$nb" "$OUTDIR/"
done
mkdir -p "$OUTDIR/images" && cp images/*.png "$OUTDIR/images/" 2>/dev/null || true
echo "gpu_check exit status $status"
exit $status
