#!/usr/bin/env bash
# The measurements of docs/results/gpu.md on a CUDA machine, from the project root:
#   tests:      pytest -m gpu tests/test_capture.py tests/test_training_worker.py (captured steps on every backbone,
#               kept across clients, against eager ones; clients captured at once in a training worker against one
#               at a time; a resumed captured run), then every method's captured run against its eager run
#               (METHOD_MATRIX=no skips it)
#   throughput: tv-resnet18 (batch 64 and 10), the CIFAR ResNet-18 and the CNN (batch 64) on CIFAR-10's
#               shapes, fp32 eager against the defaults; tv-resnet18 at batch 64 again with every
#               client capturing its own step (--kept-steps 0), and 1, 2, 4 clients in flight at
#               once; 1,875 training samples per client (CIFAR-10 over 20 clients, less the test
#               split), 8 clients (2 at batch 10 with fp32 eager steps)
#   fedproto:   FedProto with tv-resnet18 beside PFLlib's, same data (benchmarks/pfllib_fedproto.sh)
#   inflight:   K = 1, 2, 4, 8 clients at once in one process (throughput.py --in-flight) on tv-resnet18, the
#               CIFAR ResNet-18 and the CNN at batch 64 and 10; then FedProto beside PFLlib through the
#               training worker: STEPS of benchmarks/pfllib_fedproto.sh (INFLIGHT_STEPS, default
#               "data pfl64 pro64 pro64k4 pro64k8"; the batch-10 half: "pro10 pro10k4 pro10k8 pfl10")
#   profile:    where a FedProto client message's time goes (benchmarks/message_profile.py): tv-resnet18 on
#               the PFLlib comparison's data, 20 clients one after the other in one process, batch 64 and 10
#               (without that data in $DATA it makes it: .pfllib/ must be carried, as for fedproto)
#   sweep:      every backbone at batch 64, fp32 eager against bf16 captured, NCHW and channels-last
# Usage: OUT=<folder> bash benchmarks/gpu.sh [tests|throughput|inflight|fedproto|profile|sweep|all]  (tables and logs under $OUT)
set -uo pipefail
what=${1:-all}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
# an offline GPU machine: the wheels and set-up brought along (see DEVELOPERS.md)
[ -f .gpu/setup_env.sh ] && [ "${SETUP:-yes}" != skip ] && source .gpu/setup_env.sh .gpu-wheels
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
  lscpu | grep -E "Model name|^CPU\(s\)"; df -h /tmp | tail -1; findmnt -n -o SOURCE,FSTYPE,OPTIONS --target /tmp; } > "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"
variants=(--variant "fp32-eager=amp='off' channels-last=false cuda-graphs='off'" --variant "defaults=")
measure() {  # batch size, clients, data fraction, rounds, models, extra arguments
  for model in $5; do
    timeout ${MODEL_TIMEOUT:-60} python3 benchmarks/throughput.py \
      --run-config "dataset='cifar10' partition='iid' data-fraction=$3" --num-clients "$2" \
      --batch-sizes "$1" --rounds "$4" --models "$model" "${variants[@]}" ${6:-} --out "/tmp/tp/$1-$model${6:+-x}" 2>&1 \
      | grep -v " round [0-9]" | grep -v "^written" | tee -a "$OUT/throughput-bs$1.md"
    cat "/tmp/tp/$1-$model${6:+-x}/throughput.json" >> "$OUT/throughput.jsonl" 2>/dev/null
  done
}
if [ "$what" = tests ] || [ "$what" = all ]; then  # the every-method matrix (32 methods x 4 runs) after the rest
  timeout ${TESTS_TIMEOUT:-150} python3 -m pytest -m gpu tests/test_capture.py tests/test_training_worker.py -k "not every_methods" \
    -q -p no:cacheprovider --durations=12 > "$OUT/gpu-tests.txt" 2>&1
  echo "pytest exit $?" >> "$OUT/gpu-tests.txt"; grep -E "passed|failed|error|exit|Fatal|Error" "$OUT/gpu-tests.txt" | head -20
  if [ "${METHOD_MATRIX:-yes}" = yes ]; then
    timeout ${MATRIX_TIMEOUT:-400} python3 -m pytest -m gpu tests/test_capture.py -k every_methods -q -p no:cacheprovider \
      --durations=5 > "$OUT/gpu-tests-methods.txt" 2>&1
    echo "pytest exit $?" >> "$OUT/gpu-tests-methods.txt"; tail -3 "$OUT/gpu-tests-methods.txt"
  fi
fi
if [ "$what" = throughput ] || [ "$what" = all ]; then
  measure 64 8 0.4 2 tv-resnet18
  measure 10 2 0.1 1 tv-resnet18
  measure 64 8 0.4 2 tv-resnet18 "--kept-steps 0"
  variants=(--variant "defaults=")  # several clients at once, one process: 1, 2 and 4 threads and streams
  measure 64 8 0.4 2 tv-resnet18 "--in-flight 1,2,4"
  measure 10 8 0.4 1 tv-resnet18 "--in-flight 1,2,4"
  variants=(--variant "fp32-eager=amp='off' channels-last=false cuda-graphs='off'" --variant "defaults=")
  measure 64 8 0.4 2 "${MODELS-resnet18 cnn}"
fi
if [ "$what" = inflight ]; then  # not in "all": it is the clients-in-flight default's own measurement
  variants=(--variant "defaults=")
  for model in ${INFLIGHT_MODELS:-tv-resnet18 resnet18 cnn}; do
    measure 64 8 0.4 1 "$model" "--in-flight 1,2,4,8"
    measure 10 8 0.4 1 "$model" "--in-flight 1,2,4,8"
  done
  [ -n "${INFLIGHT_STEPS-x}" ] && SETUP=skip STEPS="${INFLIGHT_STEPS:-data pfl64 pro64 pro64k4 pro64k8}" PRO64_ROUNDS=2 \
    bash benchmarks/pfllib_fedproto.sh
fi
if [ "$what" = fedproto ] || [ "$what" = all ]; then
  SETUP=skip bash benchmarks/pfllib_fedproto.sh
fi
if [ "$what" = profile ] || [ "$what" = all ]; then
  DATA=${DATA:-/tmp/pflbench}
  [ -s "$DATA/sizes.json" ] || timeout 90 python3 benchmarks/pfllib_data.py --out "$DATA" --samples 60000 --clients 20 \
    --alpha 0.1 --seed 1 > "$OUT/profile-data.txt" 2>&1
  for batch in ${PROFILE_BATCHES:-64 10}; do  # PROFILE_ARGS: more arguments, e.g. --no-fsync --cprofile 30
    command="python3 -u benchmarks/message_profile.py --num-nodes 20 ${PROFILE_ARGS:-} --run-config \"method='fedproto'
      model='tv-resnet18' dataset='cifar10' data-dir='$DATA/cifar' pool='train+test' partition='dirichlet-pfllib' alpha=0.1
      partition-seed=1 num-server-rounds=2 batch-size=$batch lr=0.005 eval-every=1000 checkpoint-every=0\" --out /tmp/profile/$batch"
    echo "## $command" >> "$OUT/profile.md"
    eval timeout -s INT "${PROFILE_TIMEOUT:-100}" $command 2>&1 | grep -vE "INFO|WARNING" | tail -52 >> "$OUT/profile.md"
    tail -13 "$OUT/profile.md"
  done
fi
if [ "$what" = sweep ] || [ "$what" = all ]; then  # every backbone at batch 64, 4 clients of 2,500 samples
  variants=(--variant "fp32-eager=amp='off' channels-last=false cuda-graphs='off'"
            --variant "fp32-cl-eager=amp='off' channels-last=true cuda-graphs='off'"
            --variant "bf16-nchw-captured=amp='bf16' channels-last=false"
            --variant "bf16-cl-captured=amp='bf16' channels-last=true")
  for model in ${SWEEP:-tv-resnet18 resnet18 cnn fednh-cnn resnet10 resnet8-x4 resnet18-gn tv-resnet10 tv-resnet34 tv-googlenet tv-mobilenetv2 tv-resnet50 tv-resnet101 tv-resnet152}; do
    timeout ${SWEEP_TIMEOUT:-45} python3 benchmarks/throughput.py --run-config "dataset='cifar10' partition='iid' data-fraction=0.2" \
      --num-clients 4 --batch-sizes 64 --rounds 1 --models "$model" "${variants[@]}" --out "/tmp/sweep/$model" 2>&1 \
      | grep "^| $model" | tee -a "$OUT/sweep-bs64.md"
    cat "/tmp/sweep/$model/throughput.json" >> "$OUT/sweep.jsonl" 2>/dev/null
  done
fi
