#!/usr/bin/env bash
# Wheels for running the notebooks on a GPU machine that has torch and Triton (Python 3.12) but cannot reach a package
# index: nbdev 2 and the packages it needs that such an image lacks. Run from the repo root on a machine that can reach
# one; the wheels land in .whl/ (git-ignored), which tools/gpu_check.sh installs on the GPU machine with
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
#     && export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH
# Extra requirements may follow as arguments:  bash tools/gpu_wheels.sh hypothesis==6.140.0
# Seen working on an H200 image with torch 2.11 and Triton 3.6.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
for p in nbdev==2.4.14 fastcore==1.12.47 execnb==0.1.18 fastgit==0.1.4 ghapi==1.1.1 \
         ipython==9.18.1 ipython_pygments_lexers==1.1.1 traitlets==5.16.1 jedi==0.20.1 parso==0.8.7 \
         matplotlib-inline==0.2.2 pexpect==4.9.0 ptyprocess==0.7.0 prompt_toolkit==3.0.53 wcwidth==0.9.4 \
         stack-data==0.6.3 executing==2.3.0 asttokens==3.0.2 pure_eval==0.2.4 astunparse==1.6.3 \
         watchdog==7.1.0 safetensors==0.8.0 tqdm \
         nbformat==5.10.4 fastjsonschema==2.21.2 jsonschema==4.25.1 jsonschema-specifications==2025.9.1 \
         referencing==0.36.2 rpds-py==0.27.1 jupyter_core==5.8.1 platformdirs==4.4.0 "$@"; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "$p" 2>&1 | { grep -v '^WARNING: Location' || true; }
done
ls .whl
