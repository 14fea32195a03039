#!/usr/bin/env bash
# A method's accuracy per round: HtFLlib (TsingZ0/HtFLlib, its own code run as is) against protofl,
# on the same clients' data: by default FedProto in FedSA's Table 2 rerun on Fashion-MNIST
# (presets/fmnist-fedsa-table2.toml, HtFE2 column: 10 clients, 5 a round, 3 % of the data, Dirichlet
# 0.1 PFLlib-style split with partition-seed 1, 25 % test split per client, 8 rounds of 1 epoch,
# batch 10, lr 0.01). METHOD is protofl's method, ALGO HtFLlib's -algo and ALGO_FLAGS its own flags
# (FedSA's scripts' values, docs/results/fedsa-table.md), e.g.
#   METHOD=lgfedavg ALGO=LG-FedAvg ALGO_FLAGS=          METHOD=local ALGO=Local ALGO_FLAGS=
#   METHOD=fedproto ALGO=FedProto ALGO_FLAGS="-lam 10"  (the default)
#   METHOD=fedgh ALGO=FedGH ALGO_FLAGS="-slr 0.01 -se 1"
# HtFLlib's own defaults are not its scripts' (its -se is 100 server epochs, FedGH's scripts run 1):
# give every flag the scripts give.
# PFLlib (TsingZ0/PFLlib, HtFLlib's parent: the same main.py flags, data files and server hooks) runs
# the same way with REFERENCE=PFLlib, HTFLLIB a PFLlib checkout, and its table's setting, e.g.
# FedCoSR's Table II (20 clients, all every round, PFLlib's CNN):
#   REFERENCE=PFLlib HTFLLIB=<PFLlib checkout> PRESET=presets/fmnist-fedcosr-table2.toml
#   NAME=FMNIST-fedcosr-table2 FAMILY=CNN CLIENTS=20 JOIN=1.0 MIN_CLIENTS=20 ROUNDS=20
#   METHOD=fedavg ALGO=FedAvg ALGO_FLAGS=
# PFLlib's Ditto and pFedMe keep a personal model beside the one its test_metrics scores: SCORE=personalized
# records theirs. FedSA's own code (lokinko/FedSA 75bf106, an older HtFLlib fork) runs with
# HTFLLIB=<its checkout> FAMILY=HtFE2 CLASSES_FLAG=-nb METHOD=fedsa ALGO=FedSA ALGO_FLAGS="-lam 10 -mcl 1.0 -cc 1.0".
#
# From the project root, on a CPU (each run ~1.5-3 min on 2 cores):
#   HTFLLIB=<HtFLlib checkout> OUT=<folder> bash benchmarks/htfllib_compare.sh
# Writes $OUT/htfllib.md (the per-round table; rewritten by the report step) and keeps the runs:
# $OUT/dataset/ (the data), $OUT/htfllib/seed-<s>.json and .log (HtFLlib's scores and output),
# $OUT/protofl/<label>/seed-<s>/results.json (benchmarks/compare.py's runs). Steps (STEPS, in order):
#   data    benchmarks/pfllib_data.py --preset: protofl's clients of the preset (the very samples and
#           tensors each client trains and tests on, 1 x 28 x 28, normalised (x - 0.5) / 0.5) written
#           as HtFLlib's dataset/$NAME/{train,test}/<client>.npz, each split in a seeded random order
#           (HtFLlib's loaders do not shuffle; PFLlib's generated files come shuffled)
#   htfl    HtFLlib's system/main.py through benchmarks/htfllib_run.py (see its docstring for what it
#           sets around HtFLlib: torch.load's weights_only, stand-ins for unused imports, the
#           grey-scale CNN / ResNet stems), ALGO on $FAMILY (default HtFE-img-2: CNN, ResNet-18),
#           one run per seed of SEEDS: each round's clients are protofl's of that seed and round
#           (--replay-seed)
#   pro     protofl: benchmarks/compare.py --preset $PRESET --methods $METHOD --seeds $SEEDS, and
#           PRO_VARIANTS ("LABEL=OVERRIDES;LABEL=OVERRIDES", each naming its method), e.g.
#           "fp32=method='fedproto' amp='off' channels-last=false"
#   report  the table: per round, each side's sample-weighted accuracy over all $CLIENTS clients
#           (HtFLlib's "Averaged Test Accuracy", protofl's personalized_accuracy) and the unweighted mean of the
#           clients' accuracies (HtFLlib: from its per-client lines; protofl: personalized_accuracy_mean)
#
# What each side scores, and when: HtFLlib evaluates every client at the start of each round, after
# the server's broadcast and before that round's training; its evaluation k (k = 1..8, of -gr 8's
# nine rounds 0..8; the ninth round's training is never scored) scores the clients' models (and, for
# FedProto, the global prototypes, by the nearest one) after k rounds, with model.eval(). protofl
# scores every client (evaluate-clients='all') after round k's aggregation, with what the round
# broadcast: the same state. Both count accuracy as sum correct / sum tested over the $CLIENTS clients.
set -uo pipefail
HTFLLIB=${HTFLLIB:?set HTFLLIB to an HtFLlib checkout (e.g. commit e959261)}
PRESET=${PRESET:-presets/fmnist-fedsa-table2.toml}
NAME=${NAME:-FMNIST-fedsa-table2}
METHOD=${METHOD:-fedproto}
ALGO=${ALGO:-FedProto}
ALGO_FLAGS=${ALGO_FLAGS--lam 10}    # set and empty: no flags of its own
OUT=${OUT:-/tmp/htfllib-$METHOD}
SEEDS=${SEEDS:-0 1 2}
STEPS=${STEPS:-data htfl pro report}
FAMILY=${FAMILY:-HtFE-img-2}        # HtFLlib's -m for the preset's model='htfe2'
REFERENCE=${REFERENCE:-HtFLlib}     # the reference's name in the report (HtFLlib or PFLlib)
CLIENTS=${CLIENTS:-10}              # the preset's num-supernodes, -nc
JOIN=${JOIN:-0.5}                   # the preset's fraction-fit, -jr
MIN_CLIENTS=${MIN_CLIENTS:-5}       # the preset's min-fit-clients
LR=${LR:-0.01}                      # the preset's lr, -lr
ROUNDS=${ROUNDS:-8}
CLASSES_FLAG=${CLASSES_FLAG:--ncl}  # the reference's flag for the number of classes (FedSA's fork of HtFLlib: -nb)
SCORE=${SCORE:-model}               # which evaluation of the reference is recorded (htfllib_run.py --score)
REF_THREADS=${REF_THREADS:-1}       # the reference's torch threads (OMP_NUM_THREADS): runs side by side share the cores
PRO_EXTRA=${PRO_EXTRA:-}            # more run-config overrides for every protofl run
PRO_VARIANTS=${PRO_VARIANTS:-}
export FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=${FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION:-1}
mkdir -p "$OUT/htfllib" "$OUT/protofl"
HTFL_ARGS="-data $NAME -m $FAMILY -algo $ALGO -gr $ROUNDS -jr $JOIN -nc $CLIENTS $CLASSES_FLAG 10 -fd 512 -lbs 10 -lr $LR $ALGO_FLAGS -ls 1 -eg 1 -dev cpu"

run_data() {
  python benchmarks/pfllib_data.py --preset "$PRESET" --run-config "method='$METHOD' $PRO_EXTRA" \
    --out "$OUT" --name "$NAME" --seed 1 2>&1 | tee "$OUT/data.log" | tail -3
}

run_htfl() {
  for s in $SEEDS; do
    local t0=$SECONDS
    OMP_NUM_THREADS=$REF_THREADS python benchmarks/htfllib_run.py --htfllib "$HTFLLIB" --work "$OUT" \
      --out "$OUT/htfllib/seed-$s.json" --replay-seed "$s" --score "$SCORE" --fraction "$JOIN" --min-clients "$MIN_CLIENTS" -- $HTFL_ARGS -go "seed$s" > "$OUT/htfllib/seed-$s.log" 2>&1
    echo "$REFERENCE seed $s: exit $?, $((SECONDS - t0)) s; $(grep -c '^Averaged Test Accura' "$OUT/htfllib/seed-$s.log") evaluations"
  done
}

run_pro() {
  local variants=()
  if [ -n "$PRO_VARIANTS" ]; then
    IFS=';' read -ra parts <<< "$PRO_VARIANTS"
    for v in "${parts[@]}"; do variants+=(--variant "$v"); done
  fi
  python benchmarks/compare.py --preset "$PRESET" --methods "$METHOD" "${variants[@]}" --run-config "$PRO_EXTRA" \
    --seeds $SEEDS --out "$OUT/protofl" > "$OUT/protofl/compare.log" 2>&1
  echo "protofl: exit $? ($(grep -c . "$OUT/protofl/compare.log") lines of log)"
}

run_report() {
  python - "$OUT" "$SEEDS" "$HTFLLIB" "$ROUNDS" "$ALGO" "$REFERENCE" "$CLIENTS" > "$OUT/htfllib.md" <<'EOF'
import json, subprocess, sys
from pathlib import Path
import numpy as np
out, seeds, htfllib, rounds = Path(sys.argv[1]), [int(s) for s in sys.argv[2].split()], sys.argv[3], int(sys.argv[4])
algo, ref, clients = sys.argv[5], sys.argv[6], int(sys.argv[7])
commit = subprocess.run(["git", "-C", htfllib, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
curves, notes = {}, []  # label -> seed -> {"w": [...], "m": [...], "std": [...]} for rounds 1..rounds
for s in seeds:
    path = out / "htfllib" / f"seed-{s}.json"
    if not path.exists():
        notes.append(f"{ref} seed {s}: no scores"); continue
    h = json.loads(path.read_text())
    ev = {e["trained_rounds"]: e for e in h["evaluations"]}
    curves.setdefault(ref, {})[s] = {k: [ev[r][f] if r in ev else None for r in range(1, rounds + 1)]
                                          for k, f in (("w", "accuracy"), ("m", "mean"), ("std", "std"))}
    curves[ref][s]["selected"] = h["selected"][:rounds]
for label_dir in sorted(p for p in (out / "protofl").iterdir() if p.is_dir()):
    for s in seeds:
        path = label_dir / f"seed-{s}" / "results.json"
        if not path.exists():
            continue
        rs = {r["round"]: r for r in json.loads(path.read_text())["rounds"]}
        if max(rs, default=0) < rounds:
            notes.append(f"protofl {label_dir.name} seed {s}: unfinished ({max(rs, default=0)} rounds)"); continue
        get = lambda r, f: rs.get(r, {}).get(f)
        c = {k: [get(r, f) for r in range(1, rounds + 1)] for k, f in
             (("w", "personalized_accuracy"), ("m", "personalized_accuracy_mean"), ("std", "personalized_std"),
              ("head", "personalized_accuracy_head"))}
        c["selected"] = [get(r, "clients") for r in range(1, rounds + 1)]
        curves.setdefault(f"protofl {label_dir.name}", {})[s] = c
        h = curves.get(ref, {}).get(s)
        if h and h["selected"] != c["selected"]:
            notes.append(f"seed {s}: {ref}'s clients {h['selected']} differ from protofl {label_dir.name}'s {c['selected']}")
pct = lambda v: "–" if v is None else f"{100 * v:.1f}"
def mean(values):
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None
print(f"# {algo} per round: {ref} {commit} against protofl, {out}\n")
print(f"Accuracy over all {clients} clients after each round, in %: sample-weighted (sum correct / sum tested; "
      f"{ref}'s \"Averaged Test Accuracy\", protofl's PM) and, in brackets, the unweighted mean of the "
      "clients' accuracies. Best and final: of the sample-weighted curve.\n")
labels = list(curves)
print("| side | seed | " + " | ".join(f"r{r}" for r in range(1, rounds + 1)) + " | best | final |")
print("|---|---|" + "---|" * (rounds + 2))
for label in labels:
    for s in seeds + ["mean"]:
        runs = curves[label]
        if s == "mean":
            if len(runs) < 2: continue
            w = [mean([runs[x]["w"][i] for x in runs]) for i in range(rounds)]
            m = [mean([runs[x]["m"][i] for x in runs]) for i in range(rounds)]
            best = mean([max(v for v in runs[x]["w"] if v is not None) for x in runs])
            final = mean([runs[x]["w"][-1] for x in runs])
        elif s in runs:
            w, m = runs[s]["w"], runs[s]["m"]
            best, final = max(v for v in w if v is not None), w[-1]
        else:
            continue
        cells = [f"{pct(a)} ({pct(b)})" for a, b in zip(w, m)]
        print(f"| {label} | {s} | " + " | ".join(cells) + f" | {pct(best)} | {pct(final)} |")
print()
spread = lambda runs: ", ".join(f"s{s} {100 * r['std'][-1]:.1f}" for s, r in runs.items() if r["std"][-1] is not None)
print("Spread across clients (std of the clients' accuracies, points) in the last round: " +
      "; ".join(f"{label} {spread(curves[label])}" for label in labels))
for label in labels:
    if any("head" in r and r["head"][-1] is not None for r in curves[label].values()):
        print(f"\n{label}, the head's argmax instead of the nearest prototype (sample-weighted, %): " + "; ".join(
            f"s{s} " + " ".join(pct(v) for v in r["head"]) for s, r in curves[label].items()))
for n in notes:
    print(f"\n- {n}")
EOF
  cat "$OUT/htfllib.md"
}

for step in $STEPS; do
  echo "=== $step ($(date -u +%T))"
  case $step in
    data) run_data ;;
    htfl) run_htfl ;;
    pro) run_pro ;;
    report) run_report ;;
    *) echo "unknown step $step" ;;
  esac
done
echo "=== done ($(date -u +%T)): $OUT/htfllib.md"
