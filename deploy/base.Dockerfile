# Flower's images rebuilt from a plain Debian image, for hosts that cannot pull from an image
# registry: Python, a virtual environment with flwr, and the layout of Flower's published images
# (user "app", uid/gid 49999, home and working directory /app). deploy/compose_e2e.sh builds it from
# a debootstrapped bookworm and tags it <FLOWER_IMAGES>/superlink, /supernode and /superexec, which
# deploy/Dockerfile then builds on. With a registry, DEBIAN_IMAGE=debian:bookworm-slim works too.
# Unlike Flower's images, the virtual environment belongs to root: the user that runs cannot change it.
ARG DEBIAN_IMAGE=debian:bookworm-slim
FROM ${DEBIAN_IMAGE} AS python
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin \
    && groupadd --gid 49999 app \
    && useradd --uid 49999 --gid 49999 --home-dir /app --create-home --shell /bin/sh app

# The virtual environment is made in a stage that is not shipped: the CA bundle a build may trust
# (deploy/build/*.crt, see deploy/build/pip.sh) is in none of the image's layers.
FROM python AS venv
ARG FLWR_VERSION=1.42.0
COPY deploy/build/ /tmp/build/
RUN python3 -m venv /python/venv \
    && PATH=/python/venv/bin:$PATH sh /tmp/build/pip.sh install "flwr==${FLWR_VERSION}"

FROM python
COPY --from=venv /python /python
ENV PATH=/python/venv/bin:$PATH HOME=/app PYTHONDONTWRITEBYTECODE=1
USER app
WORKDIR /app
