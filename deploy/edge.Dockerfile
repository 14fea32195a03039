# The edge of the TLS + SuperNode-auth compose variant (deploy/compose.auth.yml): Debian's nginx with
# protofl's edge configuration (deploy/edge.py), rendered at build time for the compose network:
# it listens on 9443 and forwards to superlink:8000, with the credentials mounted in /app/credentials.
# nginx runs as the user "app" (uid 49999, the owner of the mounted credentials), with no capabilities
# (docker-compose.yml's hardening): nothing in it switches users or binds a port below 1024.
# DEBIAN_IMAGE: debian:bookworm-slim from a registry, or the debootstrapped protofl-debian:bookworm
# that deploy/compose_e2e.sh imports where no registry can be reached.
ARG DEBIAN_IMAGE=debian:bookworm-slim
FROM ${DEBIAN_IMAGE} AS render
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends python3 \
    && rm -rf /var/lib/apt/lists/*
COPY deploy/edge.py deploy/edge.conf.template /tmp/edge/
RUN python3 /tmp/edge/edge.py --out /tmp/protofl-edge.conf --listen 0.0.0.0:9443 \
        --upstream superlink:8000 --upstream-name superlink --credentials /app/credentials \
        --run-dir /var/lib/protofl-edge --access-log /dev/stdout

# the shipped image: nginx and the rendered configuration, no Python
FROM ${DEBIAN_IMAGE}
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends nginx-light \
    && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin \
    && groupadd --gid 49999 app \
    && useradd --uid 49999 --gid 49999 --home-dir /var/lib/protofl-edge --no-create-home --shell /usr/sbin/nologin app \
    && mkdir -p /var/lib/protofl-edge && chown app:app /var/lib/protofl-edge && chmod 700 /var/lib/protofl-edge
COPY --from=render /tmp/protofl-edge.conf /etc/nginx/protofl-edge.conf
USER app
EXPOSE 9443
CMD ["nginx", "-e", "stderr", "-c", "/etc/nginx/protofl-edge.conf", "-g", "daemon off;"]
