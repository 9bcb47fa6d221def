#!/usr/bin/env bash
# vLLM 0.33.0 on CPU in its own venv, for the parity tests (tests/support/vllm_env.py).
#
# A plain `pip install vllm` pulls about 7 GB of CUDA wheels; this recipe takes the
# CPU torch and vLLM without its dependencies, then the light packages its event,
# hashing and render code imports (verified with vLLM 0.33.0 on CPU). Idempotent:
# a venv that already imports this vLLM is left alone. Prints the path of its Python.
# (VLLM_VENV_DIR, not a KVGATE_ name: kvgate reads every KVGATE_* variable as a setting.)
set -euo pipefail
VENV="${VLLM_VENV_DIR:-/work/vllm-venv}"
PY="$VENV/bin/python"
if [ -x "$PY" ] && "$PY" -c 'import vllm, sys; sys.exit(vllm.__version__ != "0.33.0")' >/dev/null 2>&1; then
    echo "$PY"
    exit 0
fi
python3 -m venv "$VENV"
"$PY" -m pip install -q "torch==2.13.0"
"$PY" -m pip install -q --no-deps "vllm==0.33.0"
"$PY" -m pip install -q msgspec pyzmq cbor2 xxhash pydantic transformers cachetools psutil urllib3 aiohttp \
    requests openai-harmony openai pillow pybase64 cloudpickle uvloop py-cpuinfo prometheus_client fastapi \
    partial-json-parser uvicorn watchfiles orjson einops apache-tvm-ffi prometheus-fastapi-instrumentator \
    model-hosting-container-standards
"$PY" -m pip install -q --no-deps xgrammar llguidance
"$PY" -c 'import vllm; from vllm.distributed.kv_events import ZmqEventPublisher' >/dev/null
echo "$PY"
