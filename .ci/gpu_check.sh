#!/usr/bin/env bash
# Runs tests/test_gpu.py on a machine with a GPU whose python3 already has torch, transformers,
# accelerate, pytest, pluggy and numpy, and no network. What else the engine needs travels with the
# working tree, both ignored by git (.git/info/exclude):
#   .whl/                      pydantic, pydantic-settings, xgrammar and their dependencies, as wheels;
#   .gpu/smollm2-tokenizer/    the default model's tokenizer files (its 98 MB GGUF is too big to carry).
# To make them on a fresh checkout (pip download needs the package index; the tokenizer comes from
# the converted default model, ~/.cache/batchyard/models/<SmolLM2...>/ once the engine has run):
#   echo /.whl/ >>.git/info/exclude; echo /.gpu/ >>.git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux2014_x86_64 \
#     --platform manylinux_2_17_x86_64 -d .whl pydantic==2.14.4 \
#     pydantic-core==2.50.5 pydantic-settings==2.16.3 annotated-types==0.8.0 typing-inspection==0.4.5 \
#     python-dotenv==1.2.4 typing-extensions==4.16.0 xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2
#   mkdir -p .gpu/smollm2-tokenizer && cp <model folder>/{tokenizer.json,tokenizer_config.json,chat_template.jinja} .gpu/smollm2-tokenizer/
# then run it there with the device tool: command `bash .ci/gpu_check.sh`, carry [".whl", ".gpu"].
# The project is not installed: without its entry points, the bundled plugins register through
# framework.plugins.DEFAULT_PLUGINS. The log goes to $OUT/gpu_log.txt when OUT is set.
# PYTHON, GPU_CHECK_WHEELS and BATCHYARD_GPU_CHECK_DEVICE=cpu let the same steps run on a CPU.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
SITE=${GPU_CHECK_SITE:-/tmp/site}
"$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
  "${GPU_CHECK_WHEELS:-.whl}"/*.whl
export PYTHONPATH="$SITE:$PWD" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export BATCHYARD_GPU_CHECK_TOKENIZER="$PWD/.gpu/smollm2-tokenizer"
log=/dev/null
if [ -n "${OUT:-}" ]; then log="$OUT/gpu_log.txt"; fi
{
  nvidia-smi -L || echo "nvidia-smi failed or is missing"
  "$PY" -c 'import torch;print(torch.__version__, torch.cuda.is_available())'
  if [ "${BATCHYARD_GPU_CHECK_DEVICE:-cuda}" = cuda ]; then
    # Without CUDA the tests would all be skipped and the check would pass without checking anything.
    "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else "torch sees no GPU")'
  fi
  # A hang (the overlap worker's forward thread, say) dumps every thread's stack after 120 s.
  timeout 270 "$PY" -m pytest -q -rs --tb=short tests/test_gpu.py -p no:cacheprovider -o faulthandler_timeout=120
} 2>&1 | tee "$log"
