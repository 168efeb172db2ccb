# kvbridge: `kvbridge run` (the bridge) and `kvbridge simulate` (simulated vLLM pods).
#   docker build -t kvbridge .   and see docker-compose.yml for a complete setup.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore

WORKDIR /src
COPY pyproject.toml README.md ./
COPY bridge/ bridge/
COPY schemas/ schemas/
# The Avro schemas go beside the installed package (bridge.records.schema_dir looks there).
RUN pip install . \
    && cp -r schemas "$(python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')/bridge/" \
    && cd / && rm -rf /src \
    && python -c 'from bridge.records import schema_dir; print("schemas:", schema_dir())' \
    && useradd --system --uid 10001 --user-group --no-create-home --home-dir /nonexistent kvbridge

USER kvbridge
WORKDIR /tmp
EXPOSE 9400

# The bridge serves Prometheus metrics on --metrics-port (KVBRIDGE_METRICS_PORT), default 9400.
HEALTHCHECK --interval=15s --timeout=5s --start-period=30s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/metrics' % os.environ.get('KVBRIDGE_METRICS_PORT', '9400'), timeout=4).read()"]

ENTRYPOINT ["kvbridge"]
CMD ["--help"]
