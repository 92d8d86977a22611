# rldiag's team image: the dashboard (default command), the watcher (`watch ...`) and, with psycopg2 in
# it, the PostgreSQL-backed `mlflow server` of docker-compose.yml. The read side: `rldiag[app]`, no
# [vllm], [hf] or [dev] extras, and CPU torch (the read side never runs a model; the package depends on torch).
#
#   docker build -t rldiag:local .
#   docker run --rm -p 127.0.0.1:8501:8501 -e MLFLOW_TRACKING_URI=http://mlflow.internal:5000 rldiag:local
#
# The app listens on 0.0.0.0 inside the container; publish it on the host's 127.0.0.1 and put an
# authenticating proxy in front to serve it further (README, "Exposing the dashboard"). It reads only
# the store it was started with; visitors cannot type another one.
#
# Size, estimated (no Docker engine where this was written): python:3.11-slim ~125 MB + a venv of
# ~1.9 GB (108 packages, summed from an identical install): CPU torch 0.76 GB, pyarrow 0.16, scipy
# 0.14 (with scikit-learn and matplotlib: mlflow's), pandas, sympy (torch's), numpy, mlflow, plotly,
# streamlit. PyPI's default Linux torch wheel would add the CUDA libraries (several GB): that is why
# torch comes from PyTorch's CPU index first.

FROM python:3.11-slim-bookworm AS build

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH

RUN python -m venv /opt/venv \
 && pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"

WORKDIR /src
COPY pyproject.toml README.md ./
COPY rldiag/ rldiag/
COPY collectors/ collectors/
COPY app/ app/
COPY experiments/ experiments/
# The installed CPU torch satisfies the package's torch range, so pip keeps it (checked below).
RUN pip install --no-cache-dir "/src[app]" "psycopg2-binary==2.9.*" \
 && python -c "import torch; assert torch.__version__.endswith('+cpu'), torch.__version__" \
 && rldiag --help > /dev/null


FROM python:3.11-slim-bookworm

LABEL org.opencontainers.image.title="rldiag" \
      org.opencontainers.image.description="Diagnostics for LLM RL training runs on MLflow: dashboard and watcher" \
      org.opencontainers.image.licenses="Apache-2.0"

ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    MLFLOW_DISABLE_TELEMETRY=true \
    STREAMLIT_SERVER_HEADLESS=true \
    STREAMLIT_BROWSER_GATHER_USAGE_STATS=false

# A fixed non-root uid, so volumes (/data: the default SQLite store; /mlflow/artifacts: the server's
# artifact store) are writable the same way on every host.
RUN groupadd --system --gid 10001 rldiag \
 && useradd --system --no-log-init --uid 10001 --gid rldiag --create-home --home-dir /home/rldiag rldiag \
 && mkdir -p /data /mlflow/artifacts \
 && chown rldiag:rldiag /data /mlflow/artifacts

COPY --from=build /opt/venv /opt/venv

USER 10001:10001
WORKDIR /data
EXPOSE 8501

# The slim image has no curl: ask Streamlit's health endpoint with the image's own Python.
HEALTHCHECK --interval=30s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8501/_stcore/health', timeout=4)"]

ENTRYPOINT ["rldiag"]
CMD ["app", "--host", "0.0.0.0", "--port", "8501", "--no-browser"]
