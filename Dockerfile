# One image for every service of docker-compose.yml (broker, merger, islands, the prepare job).
# The islands' default corpus is this image's Python standard library sources, as on a laptop.
# BASE: any image with Python 3.11+ and pip (scripts/compose-smoke builds one locally, without a registry).
ARG BASE=python:3.11-slim
FROM ${BASE}
WORKDIR /app
COPY pyproject.toml README.md ./
COPY protocol ./protocol
COPY bus ./bus
COPY telemetry ./telemetry
COPY cliargs ./cliargs
COPY broker ./broker
COPY merger ./merger
COPY island ./island
COPY cluster ./cluster
COPY analysis ./analysis
COPY suites ./suites
COPY dloco ./dloco
COPY benchmarks ./benchmarks
COPY sim ./sim
RUN pip install --no-cache-dir .
