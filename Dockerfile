# One image for every service of docker-compose.yml (broker, merger, islands, the prepare job).
# The islands' default corpus is this image's Python standard library sources, as on a laptop.
# BASE: any image with Python 3.11+, pip and venv (scripts/compose-smoke builds one locally,
# without a registry).
ARG BASE=python:3.11-slim

# Stage 1: the wheel, built from the sources, installed with its dependencies into a virtual
# environment of its own.
FROM ${BASE} AS build
WORKDIR /src
COPY . .
RUN python3 -m venv /opt/dloco \
    && /opt/dloco/bin/pip wheel --no-cache-dir --no-deps --wheel-dir /wheels . \
    && /opt/dloco/bin/pip install --no-cache-dir /wheels/dloco-*.whl \
    && /opt/dloco/bin/pip uninstall --yes --quiet pip setuptools

# Stage 2: that environment alone.  No source tree, no wheel, no build tools: `dloco` and
# `python -m dloco` find the installed package from any directory.  The working directory is the
# one the compose file mounts the run volume under, and holds no package folder.
FROM ${BASE}
COPY --from=build /opt/dloco /opt/dloco
ENV PATH=/opt/dloco/bin:$PATH
WORKDIR /dloco
