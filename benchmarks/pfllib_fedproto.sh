#!/usr/bin/env bash
# FedProto seconds per round: PFLlib (TsingZ0/PFLlib, its own code run as is) against protofl, on
# the same data: 60,000 random CIFAR-10-shaped images (6,000 per class), PFLlib's Dirichlet(0.1)
# split over 20 clients (protofl: partition='dirichlet-pfllib' partition-seed=1 pool='train+test'),
# each client's data 75/25 train/test (~45,000 training samples a round), 1 local epoch, SGD lr 0.005,
# torchvision's ResNet-18 (PFLlib -m ResNet18, protofl model='tv-resnet18'), every client every round.
#
# On a GPU machine, from the project root, with .gpu/ .gpu-wheels/ and .pfllib/ carried along
# (.pfllib/: PFLlib's system/ and dataset/utils/ at the commit in .pfllib/UPSTREAM_COMMIT, and
# .pfllib/stubs/ for h5py, cvxpy, calmsize, ujson, which PFLlib imports but FedProto does not use):
#   OUT=<folder> bash benchmarks/pfllib_fedproto.sh      (SETUP=skip when setup_env.sh was sourced)
# Appends a table to $OUT/pfllib.md after every step (partial results survive a timeout); logs in
# $OUT/pfllib-logs/. Steps (STEPS, in order) and their expected time on an H100 (~300 s in all,
# plus ~20-30 s for the set-up):
#   data      ~15 s  benchmarks/pfllib_data.py: the images in torchvision's CIFAR-10 files (protofl) and
#                    PFLlib's Cifar10/{train,test}/<client>.npz (savez_compressed, as PFLlib writes them)
#   pfl64     ~40 s  PFLlib, batch 64, PFL64_ROUNDS=2 rounds (~10 s start, ~10 s a round + ~5 s eval in round 0)
#   pfl10     ~80 s  PFLlib, batch 10, PFL10_ROUNDS=1 round (~56 s of training + ~10 s eval in round 0)
#   pro64     ~75 s  protofl defaults, batch 64, PRO64_ROUNDS=3 rounds (~30 s before round 1, ~30 s after)
#   pro10     ~85 s  protofl defaults, batch 10, PRO10_ROUNDS=2 rounds
#   pro64fp32, pro10fp32 (not in the default list, ~75 / ~100 s): the same with
#                    cuda-graphs='off' amp='off' channels-last=false (the old float32 eager steps)
#   pro64k<K>, pro10k<K> (not in the default list, e.g. pro64k4): the defaults with clients-in-flight=K,
#                    each GPU's clients trained K at a time in one training worker (the 10 ClientApps forward)
# Per-step limits (seconds, ~1.5x the expected): T_DATA=60, T_PFL64=75, T_PFL10=120, T_PRO64=120,
# T_PRO10=130 (150 for pro10fp32): ~505 s at most; give the device command timeout_s >= 540.
# "protofl defaults": FedProto's default options (prototypes from an eval pass after training,
# count-weighted means) and amp / channels-last / cuda-graphs "auto". PROTOFL_EXTRA: more
# run-config overrides for every protofl step, e.g. "fedproto.prototype-pass='during-train'
# fedproto.weighting='uniform'" (PFLlib's work exactly: prototypes from the training passes, no
# separate eval pass over the training split; unweighted prototype means). DATA: the data folder.
# DATA_ARGS: more arguments for pfllib_data.py, e.g. --uncompressed (np.savez: faster to write,
# but PFLlib's own files are compressed and its rounds re-read them).
# A trial without a GPU: DEVICE=cpu SAMPLES=6000 MODEL_PFL=CNN MODEL_PRO=cnn (PFLlib's and protofl's CNNs).
#
# What each library counts as a round's seconds:
#   PFLlib (serverproto.py FedProto.train): each round prints "-"*50 and time.time() - s_t, where s_t
#     is taken before select_clients; it covers the evaluation when i % eval_gap == 0 (always in
#     round 0: -eg only thins the later rounds), every client's train() (which re-reads and
#     decompresses its .npz and builds a DataLoader each time), the prototype upload, aggregation
#     and send. It prints the mean of rounds 1.. at the end ("Best accuracy." then the best accuracy,
#     then that mean); "Average time cost" is the whole run with setting up the clients. Its -gr N
#     runs N + 1 rounds (0..N). With one round (-gr 0) it ends with ZeroDivisionError in that mean,
#     after the round's line (exit 1, expected). In round 0 no client has global prototypes yet
#     (no prototype loss), and its evaluation is a no-grad pass over every client's training data
#     (the test pass is skipped without prototypes); its length is timed here from the log's
#     timestamps ("Evaluate personalized models" to "Std Test Accuracy") and taken off.
#   protofl (results.json rounds[]): fit_seconds = round start to the aggregated fit replies (the
#     training part), seconds = the round's wall time with its evaluation (eval-every=1000 here:
#     only the last round evaluates, in an evaluate message after the fit). Round 1 includes each
#     ClientApp's data loading, CUDA set-up and step capture.
set -uo pipefail
OUT=${OUT:-/tmp/out}
DATA=${DATA:-/tmp/pflbench}
STEPS=${STEPS:-data pfl64 pfl10 pro64 pro10}
LOGS="$OUT/pfllib-logs"
MD="$OUT/pfllib.md"
ROOT=$PWD
mkdir -p "$OUT" "$LOGS"
[ -f .gpu/setup_env.sh ] && [ "${SETUP:-yes}" != skip ] && source .gpu/setup_env.sh .gpu-wheels
DEVICE=${DEVICE:-cuda}             # PFLlib's -dev (cpu for a trial without a GPU)
MODEL_PFL=${MODEL_PFL:-ResNet18}   # PFLlib's -m
MODEL_PRO=${MODEL_PRO:-tv-resnet18}
CLIENTS=${CLIENTS:-20}
SAMPLES=${SAMPLES:-60000}
GPU_SHARE=${GPU_SHARE:-0.0999}     # 10 ClientApps on the GPU (python -m protofl.task.resources 10)
FP32="cuda-graphs='off' amp='off' channels-last=false"

now() { echo "${EPOCHREALTIME:-$(date +%s.%N)}"; }
stamp() { while IFS= read -r line; do printf '%s %s\n' "$(now)" "$line"; done; }
if [ ! -s "$MD" ]; then
  { echo "# FedProto seconds per round: PFLlib against protofl"
    echo
    echo "$(date -u '+%F %T UTC'); $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | head -1); $(nproc) CPUs;" \
         "$(python3 -c 'import torch; print("torch", torch.__version__)' 2>/dev/null); PFLlib $(cut -c1-12 .pfllib/UPSTREAM_COMMIT 2>/dev/null)"
    echo
    echo "$SAMPLES random CIFAR-10-shaped images, $CLIENTS clients, Dirichlet(0.1) (PFLlib's split), 75/25 local train/test," \
         "1 local epoch, lr 0.005, PFLlib $MODEL_PFL / protofl $MODEL_PRO. Training part: the round less its evaluation" \
         "(PFLlib round 0: timed from its log; protofl: fit_seconds). Samples/s: training samples of the round (last partial batch dropped) / training part."
    echo
    echo "| step | batch | round | seconds (own measure) | evaluation | training part | train samples/s | notes |"
    echo "|---|---|---|---|---|---|---|---|"
  } > "$MD"
fi

report() {  # kind (pfllib|protofl), step, batch, log or results.json, wall seconds, exit code, command
  python3 - "$@" "$DATA/sizes.json" >> "$MD" <<'EOF'
import json, re, sys
kind, step, batch, source, wall, rc, command, sizes_path = sys.argv[1:9]
batch, rows, notes = int(batch), [], []
try:
    sizes = json.load(open(sizes_path))
    samples = sum(n // batch * batch for n in sizes["pfllib_train" if kind == "pfllib" else "protofl_train"])
except (OSError, KeyError, ValueError):
    samples = None
rate = lambda s: f"{samples / s:,.0f}" if samples and s else "–"
if kind == "pfllib":
    lines = [l.split(" ", 1) for l in open(source, errors="replace").read().splitlines() if " " in l]
    budgets, evals, start = [], {}, None
    for t, text in lines:
        if text.startswith("Evaluate personalized models"):
            start = float(t)
        elif text.startswith("Std Test Accuracy") and start is not None:
            evals[len(budgets)] = float(t) - start
            start = None
        elif m := re.fullmatch(r"-{50} ([0-9.eE+-]+)", text):
            budgets.append(float(m.group(1)))
    for r, b in enumerate(budgets):
        e = evals.get(r, 0.0)
        rows.append((r, b, e, b - e))
    if len(budgets) > 1:
        notes.append(f"PFLlib's mean of rounds 1..: {sum(budgets[1:]) / len(budgets[1:]):.2f} s")
    if budgets and budgets[0]:
        notes.append("round 0: no global prototypes yet (no prototype loss), its evaluation always on")
    if not budgets:
        notes.append("no round finished")
    for t, text in lines:
        if m := re.match(r"Average time cost: ([0-9.]+)s", text):
            notes.append(f"PFLlib's 'Average time cost' (set-up and all rounds) {m.group(1)} s")
    if len(budgets) == 1 and any("ZeroDivisionError" in text for _, text in lines):
        notes.append("ZeroDivisionError after its only round (its mean of rounds 1..): expected")
else:
    try:
        results = json.load(open(source))
        for rec in results["rounds"]:
            s, f = rec.get("seconds"), rec.get("fit_seconds")
            rows.append((rec["round"], s, (s - f) if s is not None and f is not None else None, f))
        notes.append(f"flwr total_seconds {results['total_seconds']:.1f}" if results.get('total_seconds') else 'run unfinished (no total_seconds)')
        if results.get("stopped"):
            notes.append(f"stopped: {results['stopped']}")
        c = results.get("compute") or {}
        notes.append(f"server: {c.get('device_name', c.get('device'))}, autocast {c.get('autocast')}")
    except (OSError, ValueError, KeyError) as err:
        notes.append(f"no results.json ({type(err).__name__})")
fmt = lambda v: "–" if v is None else f"{v:.2f}"
for r, s, e, t in rows:
    print(f"| {step} | {batch} | {r} | {fmt(s)} | {fmt(e)} | {fmt(t)} | {rate(t)} | |")
notes.append(f"wall {float(wall):.0f} s, exit {rc}")
print(f"| {step} | {batch} | all | | | | | {'; '.join(notes)} |")
print(f"<!-- {step}: {command} -->")
EOF
  tail -n +1 "$MD" | grep "^| $2 " | tail -n 5
}

run_data() {
  rm -rf "$DATA/cifar" "$DATA/dataset" "$DATA/system" "$DATA/results" "$DATA/runs" "$DATA/sizes.json"; mkdir -p "$DATA"
  local cmd="python3 benchmarks/pfllib_data.py --out $DATA --samples $SAMPLES --clients $CLIENTS --alpha 0.1 --seed 1 ${DATA_ARGS:-}"
  local t0; t0=$(now)
  timeout "${T_DATA:-60}" $cmd > "$LOGS/data.txt" 2>&1; local rc=$?
  head -2 "$LOGS/data.txt"; grep -E "^all|^training sizes|WARNING|Error" "$LOGS/data.txt"
  { echo "| data | | | | | | | $(python3 -c "print(round($(now) - $t0))") s, exit $rc; $(grep -E '^training sizes' "$LOGS/data.txt" | head -1) |"
    echo "<!-- data: $cmd -->"; } >> "$MD"
}

run_pfllib() {  # step, batch, rounds
  local rounds=$3 t0 rc
  local cmd="python3 -u main.py -data Cifar10 -ncl 10 -m $MODEL_PFL -algo FedProto -dev $DEVICE -nc $CLIENTS -lr 0.005 -jr 1 -ls 1 -lbs $2 -gr $((rounds - 1)) -eg 1000 -go $1"
  [ -d "$DATA/system" ] || cp -r "$ROOT/.pfllib/system" "$DATA/system"  # it reads ../dataset/Cifar10
  t0=$(now)
  (cd "$DATA/system" && PYTHONPATH="$ROOT/.pfllib/stubs${PYTHONPATH:+:$PYTHONPATH}" \
     timeout -k 5 "$4" $cmd 2>&1) | stamp > "$LOGS/$1.log"; rc=${PIPESTATUS[0]}
  report pfllib "$1" "$2" "$LOGS/$1.log" "$(python3 -c "print($(now) - $t0)")" "$rc" "cd $DATA/system && $cmd"
}

run_protofl() {  # step, batch, rounds, limit, extra overrides
  local t0 rc
  local rc_="method='fedproto' model='$MODEL_PRO' dataset='cifar10' data-dir='$DATA/cifar' pool='train+test' partition='dirichlet-pfllib' alpha=0.1 partition-seed=1 num-server-rounds=$3 local-epochs=1 batch-size=$2 lr=0.005 eval-every=1000 checkpoint-every=0 output-dir='$DATA/runs' run-name='$1' overwrite=true $5 ${PROTOFL_EXTRA:-}"
  local fc="num-supernodes=$CLIENTS client-resources-num-cpus=1 client-resources-num-gpus=$GPU_SHARE"
  [ "$DEVICE" = cpu ] && fc="num-supernodes=$CLIENTS client-resources-num-cpus=1"
  rm -rf "${DATA:?}/runs/$1"  # no results.json of an earlier try
  t0=$(now)
  timeout -k 10 "$4" protofl run . --run-config "$rc_" --federation-config "$fc" > "$LOGS/$1.log" 2>&1; rc=$?
  if [ "$rc" -ge 124 ]; then  # killed by timeout: the simulation goes on in the SuperLink, stop it
    local run_id; run_id=$(grep -o "Successfully started run [0-9]*" "$LOGS/$1.log" | grep -o "[0-9]*$")
    [ -n "$run_id" ] && timeout 30 flwr stop "$run_id" >> "$LOGS/$1.log" 2>&1 && sleep 5
  fi
  report protofl "$1" "$2" "$DATA/runs/$1/results.json" "$(python3 -c "print($(now) - $t0)")" "$rc" \
    "protofl run . --run-config \"$rc_\" --federation-config \"$fc\""
}

for step in $STEPS; do
  echo "=== $step ($(date -u +%T))"
  case $step in
    data)      run_data ;;
    pfl64)     run_pfllib pfl64 64 "${PFL64_ROUNDS:-2}" "${T_PFL64:-75}" ;;
    pfl10)     run_pfllib pfl10 10 "${PFL10_ROUNDS:-1}" "${T_PFL10:-120}" ;;
    pro64)     run_protofl pro64 64 "${PRO64_ROUNDS:-3}" "${T_PRO64:-120}" "" ;;
    pro10)     run_protofl pro10 10 "${PRO10_ROUNDS:-2}" "${T_PRO10:-130}" "" ;;
    pro64fp32) run_protofl pro64fp32 64 "${PRO64_ROUNDS:-3}" "${T_PRO64:-120}" "$FP32" ;;
    pro10fp32) run_protofl pro10fp32 10 "${PRO10_ROUNDS:-2}" "${T_PRO10:-150}" "$FP32" ;;
    pro64k*)   run_protofl "$step" 64 "${PRO64_ROUNDS:-3}" "${T_PRO64:-120}" "clients-in-flight=${step#pro64k}" ;;
    pro10k*)   run_protofl "$step" 10 "${PRO10_ROUNDS:-2}" "${T_PRO10:-130}" "clients-in-flight=${step#pro10k}" ;;
    *) echo "unknown step $step" ;;
  esac
done
# the local SuperLink that `flwr run` started stays up: stop it (by its PID, found by this run's port)
if [ -n "${FLWR_LOCAL_CONTROL_API_PORT:-}" ] && [ "${STOP_SUPERLINK:-yes}" = yes ]; then
  for pid in $(pgrep -f -- "flower-superlink .*--control-api-address 127.0.0.1:${FLWR_LOCAL_CONTROL_API_PORT}( |$)" 2>/dev/null); do
    kill "$pid" 2>/dev/null
  done
fi
echo "=== done ($(date -u +%T)): $MD"
