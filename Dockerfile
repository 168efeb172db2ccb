# kvbridge: `kvbridge run` (the bridge) and `kvbridge simulate` (simulated vLLM pods).
#   docker build -t kvbridge .   and see docker-compose.yml and deploy/ for complete setups.
#
# Two stages: the first installs the package into a virtualenv, the second copies only that
# virtualenv onto a fresh slim image (no pip cache, no sources, no build files) and runs it as
# an unprivileged user. The image writes nothing at run time, so a read-only root filesystem
# works (deploy/ mounts an emptyDir on /tmp for good measure).

FROM python:3.11-slim AS build

ENV PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore

RUN python -m venv /opt/kvbridge
ENV PATH=/opt/kvbridge/bin:$PATH

WORKDIR /src
COPY pyproject.toml README.md ./
COPY bridge/ bridge/
COPY schemas/ schemas/
# The Avro schemas go beside the installed package (bridge.log.records.schema_dir looks there).
RUN pip install ".[k8s]" \
    && cp -r schemas "$(python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')/bridge/" \
    && cd / \
    && python -c 'from bridge.log.records import schema_dir; print("schemas:", schema_dir())' \
    && python -c 'import bridge.ops.discovery.k8swatch, bridge.log.registry, confluent_kafka.schema_registry' \
    && kvbridge --version


FROM python:3.11-slim

# The bridge serves /metrics on 127.0.0.1 by default; in a container it must listen on every
# interface for Prometheus and the probes (KVBRIDGE_METRICS_HOST, docs/operations.md).
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    KVBRIDGE_METRICS_HOST=0.0.0.0 \
    PATH=/opt/kvbridge/bin:$PATH

COPY --from=build /opt/kvbridge /opt/kvbridge
RUN groupadd --system --gid 10001 kvbridge \
    && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent kvbridge \
    && kvbridge --version

# Numeric, so Kubernetes' runAsNonRoot can verify it without looking the name up.
USER 10001:10001
WORKDIR /tmp
EXPOSE 9400

# /healthz on the metrics port (KVBRIDGE_METRICS_PORT, 9400) answers 200 while the bridge's
# event loop is alive. The slim image has no curl: Python's urllib does the request. Simulated
# pods (`kvbridge simulate`) serve no metrics: docker-compose.yml disables the check for them.
HEALTHCHECK --interval=15s --timeout=5s --start-period=30s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ.get('KVBRIDGE_METRICS_PORT', '9400'), timeout=4).read()"]

ENTRYPOINT ["kvbridge"]
CMD ["--help"]
