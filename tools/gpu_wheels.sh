#!/usr/bin/env bash
# Wheels for running the notebooks on a GPU machine that has torch and Triton (Python 3.12) but cannot reach a package
# index: nbdev 2 and the packages it needs that such an image lacks, and the server's (FastAPI, uvicorn, the openai
# client). Run from the repo root on a machine that can reach one; the wheels land in .whl/ (git-ignored), which tools/gpu_check.sh installs on the GPU machine with
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
         referencing==0.36.2 rpds-py==0.27.1 jupyter_core==5.8.1 platformdirs==4.4.0 \
         fastapi==0.165.0 starlette==1.10.0 annotated-doc==0.0.7 opentelemetry-api==1.45.2 pydantic==2.14.4 \
         pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 typing_extensions==4.16.0 \
         anyio==4.16.0 idna==3.20 sniffio==1.3.1 uvicorn==0.54.0 h11==0.16.0 click==8.5.1 \
         openai==3.57.0 jiter==0.19.0 distro httpx2==2.16.2 httpcore2==2.16.2 truststore \
         prometheus_client==0.26.0 "$@"; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "$p" 2>&1 | { grep -v '^WARNING: Location' || true; }
done
ls .whl
