# The runwatch image for workers, the sink and the remediator: `pip install ".[server]"`, the server side's
# extra (worker, sink, remediate, report, grafana generate), so no torch (the training side brings its own)
# and no grafana-client (docs/install.md). Build from the repository root:
#   docker build -t runwatch:local .
# deploy/compose.yaml builds and runs it; deploy/README.md explains the rest.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /src
# Only what the wheel is built from (.dockerignore keeps the rest of the tree out of the context).
COPY pyproject.toml README.md ./
COPY contract/ contract/
COPY producer/ producer/
COPY detectors/ detectors/
COPY worker/ worker/
COPY sinks/ sinks/
COPY cli/ cli/
COPY local/ local/
COPY demo/ demo/
COPY scenarios/ scenarios/
RUN pip install ".[server]" && rm -rf /src

# Faust keeps its data directory (<app id>-data) in the working directory: give it one the user owns.
RUN useradd --system --uid 10001 --create-home --home-dir /var/lib/runwatch runwatch
USER runwatch
WORKDIR /var/lib/runwatch

ENTRYPOINT ["runwatch"]
CMD ["--help"]
