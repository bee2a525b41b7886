# spanguard: `spanguard worker` (the default command), `spanguard topics create`, `spanguard replay`.
#
#   docker build -t spanguard .                               # worker image: .[worker]
#   docker build --build-arg EXTRAS=worker,demo -t spanguard-demo .    # + the demo agents' deps
#
# Every dependency at the version the tests ran with: pip install -c constraints.txt.
#
# Settings come from SPANGUARD_* variables (`spanguard worker --help`); the signing key only from
# SPANGUARD_SIGNING_KEY or a mounted file named by SPANGUARD_SIGNING_KEY_FILE.

FROM python:3.11-slim AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/spanguard
WORKDIR /src
# .dockerignore keeps the venv, caches, tests and deploy files out of the context.
COPY . .
# Optional dependency groups of pyproject.toml, comma-separated.
ARG EXTRAS=worker
# The detection core compiled by mypyc (setup.py): the same source, about 1.5x the spans/s. The
# compiler is needed only here, and leaves the image with this stage. A C compiler comes first.
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
RUN /opt/spanguard/bin/pip install --upgrade pip setuptools wheel \
 && /opt/spanguard/bin/pip install -c constraints.txt "mypy[mypyc]" \
 && SPANGUARD_COMPILE=1 /opt/spanguard/bin/pip install -c constraints.txt ".[${EXTRAS}]" --no-build-isolation \
 && /opt/spanguard/bin/pip uninstall --yes mypy librt pathspec ast-serialize

FROM python:3.11-slim
# The same uid/gid as the Helm chart's securityContext (runAsUser/runAsGroup/fsGroup 10001).
RUN groupadd --system --gid 10001 spanguard \
 && useradd --system --uid 10001 --gid 10001 --home-dir /var/lib/spanguard --no-create-home \
      --shell /usr/sbin/nologin spanguard \
 && mkdir -p /var/lib/spanguard \
 && chown 10001:10001 /var/lib/spanguard
COPY --from=build /opt/spanguard /opt/spanguard
ENV PATH=/opt/spanguard/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    SPANGUARD_DATA_DIR=/var/lib/spanguard \
    SPANGUARD_METRICS_HOST=0.0.0.0
WORKDIR /var/lib/spanguard
# Prometheus /metrics (SPANGUARD_METRICS_PORT).
EXPOSE 9464
# Numeric, so Kubernetes' runAsNonRoot can verify it.
USER 10001:10001
ENTRYPOINT ["spanguard"]
CMD ["worker"]
