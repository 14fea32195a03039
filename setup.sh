#!/usr/bin/env bash
# One-time set-up: a virtual environment with pinned dependencies, and a project-local Flower
# home whose default simulation has 10 SuperNodes, served by a local SuperLink on ports of this
# checkout's own. Usage: ./setup.sh [python]; ./setup.sh --ports prints those ports.
set -euo pipefail
cd "$(dirname "$0")"
root=$PWD

# `flwr run .` starts a local SuperLink on fixed ports (39091, 39093) and reuses whatever answers
# there, with the environment it was started in: another checkout's would run this one's app with
# that checkout's FLWR_HOME, variables and packages. Each checkout gets ports of its own instead,
# from its path: an even port in 20000-31998 (below Linux's ephemeral ports, above Ray's worker
# ports) and the control port 2 above it.
http_port=$((20000 + 2 * ($(printf %s "$root" | cksum | cut -d" " -f1) % 6000)))
control_port=$((http_port + 2))
if [ "${1:-}" = --ports ]; then
  echo "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT=$http_port FLWR_LOCAL_CONTROL_API_PORT=$control_port"
  exit 0
fi
PYTHON=${1:-python3}

# The virtual environment lives outside the checkout, as Poetry's do, and .venv links to it: to
# build the app bundle, `flwr run .` walks every file under the project directory (links excepted),
# and a venv's 70,000 files there cost each run about 10 s on 2 cores (docs/results/main-job.md).
# PROTOFL_VENV chooses another place; a .venv/ directory made earlier is used as it is.
if [ ! -d .venv ]; then  # absent, or a link whose venv is gone
  venv=${PROTOFL_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/protofl/venvs/$(basename "$root")-$(printf %s "$root" | cksum | cut -d" " -f1)}
  "$PYTHON" -m venv "$venv"
  ln -sfn "$venv" .venv
elif [ ! -L .venv ]; then
  echo "setup.sh: .venv/ is inside the checkout, where every 'flwr run .' walks it (about 10 s a run on 2 cores);" \
       "'rm -rf .venv && ./setup.sh' moves it out." >&2
fi
.venv/bin/python -m pip install --quiet --upgrade pip
# pip compiles every installed module to bytecode one file at a time (about 70 of its 130 CPU-seconds
# here); compileall does the same on every core
.venv/bin/python -m pip install --quiet --no-compile -c constraints.txt -e ".[test]"
site_packages=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
# as pip does, it skips what does not compile (a few files are templates or test data, not Python 3.11)
.venv/bin/python -m compileall -qq -j 0 "$site_packages" || true

# Activating the venv also points Flower at this project's own home (.flwr/) and local SuperLink
# ports, turns off Flower's per-run dependency installation (it would download CUDA torch into
# a fresh venv), and runs Ray's workers, a simulation's ClientApps, at the niceness of the shell
# (Ray's default, 15, left them only the CPU other processes leave: on a busy machine every ClientApp
# timed out at discovery and the run stopped); a RAY_worker_niceness set before activating is kept.
# The block is rewritten on every set-up (it is the activate script's last).
marker="# protofl environment"
sed -i "/^$marker/,\$d" .venv/bin/activate
cat >> .venv/bin/activate <<ACTIVATE
$marker
export FLWR_HOME="$root/.flwr"
export FLWR_LOCAL_SUPERLINK_HTTP_API_PORT=$http_port FLWR_LOCAL_CONTROL_API_PORT=$control_port
export FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1
export RAY_worker_niceness=\${RAY_worker_niceness:-0}
ACTIVATE

mkdir -p .flwr
if [ ! -f .flwr/config.toml ]; then
  cat > .flwr/config.toml <<'TOML'
# Flower configuration for this checkout (FLWR_HOME=.flwr, set by .venv/bin/activate).
[superlink]
default = "local"

[superlink.local]
address = ":local:"
# `flwr run .` simulates 10 clients on the CPU. Flower 1.41+ prints a deprecation note for
# `options.*`; per run, `--federation-config "num-supernodes=..."` overrides these values.
options.num-supernodes = 10
options.backend.client-resources.num-cpus = 1
options.backend.client-resources.num-gpus = 0.0
TOML
fi
# A local SuperLink still serving these ports from an earlier clone at this path started from a
# directory that is gone: every run it takes dies before round 1 (`import ray` needs the working
# directory). It is ended here; one of another environment is named, with how to end it.
FLWR_HOME="$root/.flwr" FLWR_LOCAL_SUPERLINK_HTTP_API_PORT=$http_port FLWR_LOCAL_CONTROL_API_PORT=$control_port \
  .venv/bin/python -m protofl.local_superlink || true
echo "protofl is set up: run 'source .venv/bin/activate', then 'flwr run .' or 'pytest'" \
     "(this checkout's local SuperLink: 127.0.0.1:$http_port, control API $control_port)."
