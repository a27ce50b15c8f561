# One image for every service of docker-compose.yml (broker, merger, islands, the prepare job).
# The islands' default corpus is this image's Python standard library sources, as on a laptop.
FROM python:3.11-slim
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
RUN pip install --no-cache-dir .
