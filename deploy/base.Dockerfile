# Flower's images rebuilt from a plain Debian image, for hosts that cannot pull from an image
# registry: Python, a virtual environment with flwr, and the layout of Flower's published images
# (user "app", uid/gid 49999, home and working directory /app). deploy/compose_e2e.sh builds it from
# a debootstrapped bookworm and tags it <FLOWER_IMAGES>/superlink, /supernode and /superexec, which
# deploy/Dockerfile then builds on. With a registry, DEBIAN_IMAGE=debian:bookworm-slim works too.
ARG DEBIAN_IMAGE=debian:bookworm-slim
FROM ${DEBIAN_IMAGE}
ARG FLWR_VERSION=1.41.0
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --gid 49999 app \
    && useradd --uid 49999 --gid 49999 --home-dir /app --create-home --shell /bin/sh app \
    && python3 -m venv /python/venv \
    && chown -R app:app /python
ENV PATH=/python/venv/bin:$PATH HOME=/app
USER app
WORKDIR /app
COPY --chown=app:app deploy/build/ /tmp/build/
RUN sh /tmp/build/pip-install.sh "flwr==${FLWR_VERSION}" && rm -rf /tmp/build
