#!/usr/bin/env bash
# Every GPU figure of docs/benchmarks.md, in device calls that each end inside the lent machine's
# 10-minute limit, results under $OUT (or ./gpu_out). A session now has 15 device-minutes in all,
# start-up included: one or two parts per session, in the order of priority below. The machine has
# torch, timm and accelerate but not webdataset or simplejpeg: fetch their wheels here once
# (`wheels`), carry `.whl` with each call.
#
#   bash benchmarks/gpu_session.sh wheels          here, once: wheels into .whl (git ignores it)
#   bash benchmarks/gpu_session.sh step ti4 s16    on the GPU: the step table (train_step.py --device cuda)
#   bash benchmarks/gpu_session.sh step b16
#   bash benchmarks/gpu_session.sh trainer         Ti/4 and B/16 pre-training and a 10%-label fine-tune
#                                                  through the real loader (images/s, data wait), the
#                                                  README main job's time
#   bash benchmarks/gpu_session.sh tests           the suite on the GPU machine (its CUDA tests included)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}
what=${1:?"say what: wheels | step MODEL... | trainer | tests"}
shift
case "$what" in
    wheels|step|trainer|tests) ;;
    *) echo "unknown part '$what': wheels | step MODEL... | trainer | tests" >&2; exit 2 ;;
esac
[ "$what" != step ] || [ $# -gt 0 ] || { echo "step needs models, e.g. step ti4 s16" >&2; exit 2; }

if [ "$what" = wheels ]; then
    mkdir -p .git/info && grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .whl webdataset braceexpand simplejpeg
    ls .whl
    exit 0
fi

mkdir -p "$OUT"
# on the device: the carried wheels into the interpreter itself (not a --target folder on PYTHONPATH:
# the tests' subprocesses set PYTHONPATH to the checkout and would lose them), then this project
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir .whl/*.whl
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
python3 -c "import torch; print('torch', torch.__version__)" | tee -a "$OUT/device.txt"

perf() {  # a finished run's throughput and data wait, from its metrics.json
    python3 -c "import json, sys; m = json.load(open(sys.argv[1] + '/metrics.json')); print(sys.argv[2] + ':', \
round(m['images_per_s']), 'images/s, data wait', round(100 * m['data_wait_frac'], 1), '%')" "$1" "$2" \
        | tee -a "$OUT/trainer.txt"
}

case "$what" in
step)  # each model: eager, compiled and CUDA-graph steps against the plain timm loop, MFU, memory
    name=$(IFS=_; echo "$*")
    python3 benchmarks/train_step.py --device cuda --precision bf16 --only "$@" --loader-model "$1" --workers 12 \
        --json "$OUT/step_$name.json" 2>&1 | tee "$OUT/step_$name.log" ;;
trainer)  # the trainer with the real loader; synthetic shards (CIFAR-10's exceed what travels)
    python3 -m mpp.tools.make_synthetic /tmp/syn32 --train 50000 --test 1000 --shards 64 >/dev/null
    python3 -m mpp.tools.make_synthetic /tmp/syn256 --train 4000 --test 100 --size 256 --shards 16 >/dev/null
    for spec in "vit_ti4_32 512 syn32 300" "vit_b16 256 syn256 150"; do
        set -- $spec
        python3 -m mpp.tools.pretrain --config configs/synthetic_mpp.yaml model=$1 batch_size=$2 steps=$4 \
            data.train=/tmp/$3/train/manifest.json data.val=/tmp/$3/test/manifest.json data.num_workers=14 \
            train.log_every=50 output_dir=/tmp/runs/pre_$1 2>&1 | tail -2
        perf /tmp/runs/pre_$1 "pre-training $1 batch $2"
    done
    python3 -m mpp.tools.finetune --config configs/synthetic_finetune.yaml finetune.init=/tmp/runs/pre_vit_ti4_32 \
        data.train=/tmp/syn32/train/manifest.json data.val=/tmp/syn32/test/manifest.json data.num_workers=12 \
        finetune.label_fraction=0.1 batch_size=512 steps=300 output_dir=/tmp/runs/ft10 2>&1 | tail -2
    perf /tmp/runs/ft10 "fine-tune vit_ti4_32, 10% of 50,000 labels, batch 512"
    start=$(date +%s)
    python3 -m mpp.tools.compare --config configs/compare_synthetic.yaml > "$OUT/mainjob.log" 2>&1
    echo "main job (configs/compare_synthetic.yaml): $(( $(date +%s) - start )) s" | tee -a "$OUT/trainer.txt"
    cp runs/compare_synthetic/report.md "$OUT/mainjob_report.md" ;;
tests)
    python3 -m pytest -q -x -p no:cacheprovider 2>&1 | tee "$OUT/tests.log" ;;
esac
