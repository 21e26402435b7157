# syntax=docker/dockerfile:1
# The translation service. CPU PyTorch by default; the CUDA build with
#   docker build --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 -t nmt-service:cuda .
# (the CUDA wheels bundle their CUDA libraries; the host needs the NVIDIA driver and container toolkit).
ARG PYTHON_VERSION=3.11

FROM python:${PYTHON_VERSION}-slim AS build
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
RUN apt-get update \
    && apt-get install -y --no-install-recommends make \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY Makefile pyproject.toml README.md ./
COPY requirements/ requirements/
COPY model/ model/
COPY training/ training/
COPY app/ app/
# The same install steps CI runs (`make install`): torch==2.13.0 first, then the project at the
# versions of requirements/constraints.txt (without the dev extras here).
RUN make install VENV=/opt/venv EXTRAS= TORCH_INDEX=${TORCH_INDEX} \
    && find /opt/venv -name '__pycache__' -prune -exec rm -rf {} +

FROM python:${PYTHON_VERSION}-slim AS runtime
# g++: AOTInductor compiles the decoding step into C++ when a worker starts (NMT_COMPILE; kept
# in /home/nmt/.cache/nmt-service, a volume in docker-compose.yml). Without it the workers decode
# eagerly, slower, and /info says "decoding": "eager".
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*
# The compile cache and the keys' usage (NMT_DATA_DIR), owned by nmt: a volume mounted there
# starts with this owner.
RUN useradd --create-home --uid 10001 nmt \
    && mkdir -p /home/nmt/.cache/nmt-service /home/nmt/.local/share/nmt-service /home/nmt/models \
    && chown -R nmt /home/nmt/.cache /home/nmt/.local /home/nmt/models
WORKDIR /app
COPY --from=build /opt/venv /opt/venv
COPY --from=build /app /app
# The shipped models are part of the image, all served (each direction its own model and workers,
# ~1.7 GiB of memory per model); mount other model directories and set NMT_MODEL_DIR to serve yours.
COPY artifacts/ /app/artifacts/
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    NMT_MODEL_DIR=/app/artifacts
USER nmt
# Models by name (README "Serve a real model"): docker build --build-arg NMT_MODELS=opus-mt:de-en
# fetches and converts them into the image's store (baked in: a container starts offline); at run
# time -e NMT_MODELS=... fetches what the store lacks at start (a volume on /home/nmt/models keeps
# them; a new named volume starts with what the image baked). The hub's cache is left out of the
# image: the converted directory is all that is served.
ARG NMT_MODELS=
ENV NMT_MODELS=${NMT_MODELS} \
    NMT_MODEL_STORE=/home/nmt/models
RUN if [ -n "$NMT_MODELS" ]; then \
        HF_HUB_CACHE=/tmp/hf-cache python -m model.fetch $(echo "$NMT_MODELS" | tr ',' ' ') \
        && rm -rf /tmp/hf-cache; \
    fi
# docker build --build-arg PRECOMPILE=true: the shipped models' decoding steps compiled into the
# image (python -m app.models.precompile), so that a container is ready in seconds rather than compiling
# at its first start. A compiled step is named by the CPU's features: build on the CPU kind you
# serve on (on another, the step is compiled at start, as without this).
ARG PRECOMPILE=false
RUN if [ "$PRECOMPILE" = true ]; then python -m app.models.precompile; fi
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=3s --start-period=120s --retries=3 \
    CMD ["python", "-c", "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/health/ready', timeout=2).status != 200)"]
# One uvicorn process per container: it is the front end (HTTP, the queue, admission, metrics) and
# starts the model workers itself (NMT_REPLICAS, one per core by default); scale out with more
# containers (docker compose up --scale translator=N). Its options are app.http.connections.SERVE_OPTIONS:
# uvicorn's protocol with a deadline and a size for each request's head; asyncio's event loop, not
# uvloop (under a flood uvloop left new connections unanswered for seconds); no access log (a line
# per request cost the event loop ~0.4 ms of CPU; /metrics counts requests by endpoint and status).
CMD ["uvicorn", "app.main:app", "--host", "0.0.0.0", "--port", "8000", "--workers", "1", "--http", "app.http.connections:GuardedHttp", "--loop", "asyncio", "--no-access-log"]
