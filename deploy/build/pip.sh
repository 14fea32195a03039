#!/bin/sh
# `python -m pip ARGS` inside an image build. Any CA certificate (*.crt) placed next to this script is
# trusted on top of pip's own bundle: a TLS-intercepting proxy's CA, say. Such files are build
# inputs on the building machine only; git ignores them (see docs/deployment/compose.md), and the
# Dockerfiles use them only in build stages that are not shipped (deploy/image_check.py checks it).
set -eu
here=$(dirname "$0")
if ls "$here"/*.crt >/dev/null 2>&1; then
  bundle=$(mktemp)
  trap 'rm -f "$bundle"' EXIT
  cat "$(python -c 'import pip._vendor.certifi as c; print(c.where())')" "$here"/*.crt > "$bundle"
  export PIP_CERT="$bundle"
fi
python -m pip --no-cache-dir --disable-pip-version-check "$@"
