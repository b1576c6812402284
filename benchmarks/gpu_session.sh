#!/usr/bin/env bash
# Every GPU figure of docs/benchmarks.md, in device calls that each end inside the lent machine's
# 10-minute limit, results under $OUT (or ./gpu_out). A session has 15 device-minutes in all,
# start-up included: `session` runs the most wanted parts in one call of at most 560 s of
# part limits (run it with a 585 s timeout). The machine
# has torch, timm and accelerate but not webdataset or simplejpeg, and perhaps a setuptools too old
# to build pyproject: fetch their wheels here once (`wheels`), carry `.whl` with each call.
#
#   bash benchmarks/gpu_session.sh wheels          here, once: wheels into .whl (git ignores it)
#   bash benchmarks/gpu_session.sh session         on the GPU: what the first ten sessions (docs/benchmarks.md)
#                                                  left, each under its own time limit: `trainer`, then
#                                                  Ti/4's in-memory compiled step, then `workers 14 11`,
#                                                  then `ratio`
#   bash benchmarks/gpu_session.sh ratio           after trainer and step ti4 of the same call (what session
#                                                  ends with): the trainer's median window over the in-memory
#                                                  compiled step at its batch and precision (a call: one
#                                                  `session`, or the parts of one command run with one CALL
#                                                  exported)
#   bash benchmarks/gpu_session.sh cuda-tests      the compiled-step, precision, prefetch and profile tests on CUDA
#   bash benchmarks/gpu_session.sh step ti4 s16 [--methods ...] [--no-loader]
#                                                  the step table (train_step.py --device cuda)
#   bash benchmarks/gpu_session.sh trainer         the loader alone, then Ti/4 pre-training (batch 1024,
#                                                  compiled) through the real loader: images/s and data
#                                                  wait per log window, and where 10 steady steps' time
#                                                  went (train.profile)
#   bash benchmarks/gpu_session.sh workers [N...]  after trainer (its data): its Ti/4 pre-training with N loader
#                                                  workers each in turn (8 and 11 unless named): whether
#                                                  decoding processes slow the launch-bound loop's thread
#   bash benchmarks/gpu_session.sh finetune        after trainer: a 10%-label fine-tune of its encoder,
#                                                  compiled and eager (what train.compile=auto runs at
#                                                  its length)
#   bash benchmarks/gpu_session.sh graphs          after trainer: its pre-training with CUDA graphs
#                                                  (train.compile_mode=reduce-overhead)
#   bash benchmarks/gpu_session.sh trainer-b16     B/16 pre-training at 224 px through the real loader
#   bash benchmarks/gpu_session.sh graphs-b16      the same with CUDA graphs (train.compile_mode=reduce-overhead)
#   bash benchmarks/gpu_session.sh recompiles      whether a compiled pre-training recompiles at its epochs'
#                                                  small tail batches there, as it does on CPU, and on which guard
#   bash benchmarks/gpu_session.sh deterministic   Ti/4 pre-training twice as shipped and twice with
#                                                  train.deterministic=true: whether each pair's encoders are
#                                                  the same bits, and the images/s it costs
#   bash benchmarks/gpu_session.sh mainjob         the README main job's time
#   bash benchmarks/gpu_session.sh probe-threads   after mainjob (its feature cache): the probe's L-BFGS fits
#                                                  with torch's default threads there and with 2
#   bash benchmarks/gpu_session.sh tests [K/N | FILE[::TEST]...]
#                                                  the whole suite on the GPU machine, its K-th of N parts
#                                                  (every N-th test file, in C-locale order), or the files or tests named:
#                                                  it outlasts one call there, each stage process starting CUDA
#                                                  (its times: docs/benchmarks.md)
#   bash benchmarks/gpu_session.sh --help          this text
set -euo pipefail
self="$(cd "$(dirname "$0")" && pwd)/$(basename "$0")"  # `session` runs the parts with it, after the cd
cd "$(dirname "$0")/.."
export OUT=${OUT:-gpu_out}
export CALL=${CALL:-$(date -u +%Y%m%dT%H%M%SZ)-$$}  # the parts `session` runs share it: what `ratio` sets together
parts="wheels | session | ratio | cuda-tests | step MODEL... | trainer | workers | finetune | graphs | trainer-b16 | graphs-b16 | recompiles | deterministic | mainjob | probe-threads | tests [K/N | FILE[::TEST]...]"
what=${1:?"say what: $parts"}
shift
case "$what" in
    -h|--help) sed -n '2,/^set -euo/p' "$self" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    wheels|session|ratio|cuda-tests|step|trainer|workers|finetune|graphs|trainer-b16|graphs-b16|recompiles|deterministic|mainjob|probe-threads|tests) ;;
    *) echo "unknown part '$what': $parts" >&2; exit 2 ;;
esac
[ "$what" != step ] || [ $# -gt 0 ] || { echo "step needs models, e.g. step ti4 s16" >&2; exit 2; }
if [ "$what" = tests ] && [ "${1:-}" = "${1#tests/}" ]; then  # K/N: the files whose place in the list is K modulo N
    part=${1:-1/1}
    [[ "$part" =~ ^([1-9][0-9]*)/([1-9][0-9]*)$ ]] && [ "${BASH_REMATCH[1]}" -le "${BASH_REMATCH[2]}" ] ||
        { echo "tests takes K/N with 1 <= K <= N, e.g. tests 1/2, or test files; got '$part'" >&2; exit 2; }
elif [ "$what" = tests ]; then
    for f in "$@"; do [ -f "${f%%::*}" ] || { echo "no test file '${f%%::*}' (give paths under tests/)" >&2; exit 2; }; done
fi

if [ "$what" = wheels ]; then
    mkdir -p .git/info && grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .whl webdataset braceexpand simplejpeg 'setuptools>=77'
    ls .whl
    exit 0
fi

mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ! python3 -c "import webdataset, simplejpeg, mpp" 2>/dev/null; then
    # the carried wheels into the interpreter itself (not a --target folder on PYTHONPATH: the
    # tests' subprocesses set PYTHONPATH to the checkout and would lose them), then this project
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir .whl/*.whl
    # pyproject's license is an SPDX string (PEP 639), which setuptools builds from 77 on; the
    # image's may be older, and --no-build-isolation builds with it: the carried one is 77+
    python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
    python3 -c "import torch; print('torch', torch.__version__)" | tee -a "$OUT/device.txt"
    # the CPUs the data workers really get: affinity and a cgroup quota can be fewer than nproc says
    { grep -m1 "model name" /proc/cpuinfo || true; echo "nproc $(nproc), affinity $(python3 -c 'import os; print(len(os.sched_getaffinity(0)))'),"\
        "cgroup cpu.max $(cat /sys/fs/cgroup/cpu.max 2>/dev/null || echo none)"; } | tee -a "$OUT/device.txt" || true
fi

windows() {  # a finished run's images/s and data wait per log window (TensorBoard), and in all
    python3 - "$1" "$2" <<'PY' | tee -a "$OUT/trainer.txt"
import json, os, statistics, sys
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
run, what = sys.argv[1:]
ea = EventAccumulator(run + "/tensorboard", size_guidance={"scalars": 0})
ea.Reload()
ips = [e.value for e in ea.Scalars("perf/images_per_s")]
wait = [e.value for e in ea.Scalars("perf/data_wait_frac")]
m = json.load(open(run + "/metrics.json"))
mid = slice(1, -1) if len(ips) > 2 else slice(1, None)  # not the compile's window, nor the profile's and the end's
print(f"{what}: windows after the first (compile) and before the last (profile, end): median "
      f"{statistics.median(ips[mid]):.0f} images/s ({min(ips[mid]):.0f}-{max(ips[mid]):.0f}), "
      f"data wait median {100 * statistics.median(wait[mid]):.1f}%, max {100 * max(wait[mid]):.1f}%; "
      f"whole run {m['images_per_s']:.0f} images/s, wait {100 * m['data_wait_frac']:.1f}%, {m['wall_time_s']:.0f} s")
with open(os.environ["OUT"] + "/windows.jsonl", "a") as f:  # what `ratio` sets against the in-memory step
    f.write(json.dumps({"run": run, "what": what, "call": os.environ["CALL"], "batch": m["batch_size"],
                        "precision": {"no": "fp32"}.get(m["precision"], m["precision"]),  # train_step.py's names
                        "median_images_per_s": statistics.median(ips[mid])}) + "\n")
print("  per window images/s:", " ".join(f"{x:.0f}" for x in ips))
print("  per window wait %:  ", " ".join(f"{100 * x:.1f}" for x in wait))
PY
}

profiled() {  # RUN: the run's train.profile line into trainer.txt, its files into $OUT/profiles.tgz
    [ -d "$1/profile" ] || { echo "no profile in $1" | tee -a "$OUT/trainer.txt"; return 0; }
    head -1 "$1/profile/rank0.txt" | tee -a "$OUT/trainer.txt" || true
    rm -rf "/tmp/profiles/$(basename "$1")" && mkdir -p /tmp/profiles && cp -r "$1/profile" "/tmp/profiles/$(basename "$1")"
    tar czf "$OUT/profiles.tgz" -C /tmp profiles
}

pretrain() {  # MODEL BATCH DATA STEPS MODE [SETTING...]: MPP pre-training through the real loader, 14 workers,
              # compiled in torch.compile's MODE, 10 steps of the last log window profiled
    local run=/tmp/runs/pre_$1_$5${TAG:-}  # TAG: another run of the same model and mode
    rm -rf "$run"  # a finished run left by an earlier call would resume, and its old windows be read
    python3 -m mpp.tools.pretrain --config configs/synthetic_mpp.yaml model=$1 batch_size=$2 steps=$4 \
        data.train=/tmp/$3/train/manifest.json data.val=/tmp/$3/test/manifest.json data.num_workers=14 \
        train.log_every=20 train.ckpt_every=100000 train.compile=always train.compile_mode=$5 \
        "train.profile=[$(($4 - ($4 - 1) % 20)),10]" output_dir=$run "${@:6}" 2>&1 | tr '\r' '\n' | { grep -v "it/s" || true; } | tail -3
    windows $run "pre-training $1 batch $2, $4 steps, compile mode $5${TAG:+ ($TAG)}"
    profiled $run
}

finetune() {  # COMPILE [SETTING...]: the 10%-label fine-tune of the trainer part's encoder, 12 workers, profiled
    local run=/tmp/runs/ft10_$1
    rm -rf "$run"
    python3 -m mpp.tools.finetune --config configs/synthetic_finetune.yaml finetune.init=/tmp/runs/pre_vit_ti4_32_default \
        data.train=/tmp/syn32/train/manifest.json data.val=/tmp/syn32/test/manifest.json data.num_workers=12 \
        finetune.label_fraction=0.1 batch_size=256 steps=160 train.log_every=16 train.ckpt_every=100000 \
        train.compile=$1 "train.profile=[145,10]" output_dir=$run "${@:2}" 2>&1 | tr '\r' '\n' | { grep -v "it/s" || true; } | tail -3
    windows $run "fine-tune vit_ti4_32, 10% of 20,000 labels (an epoch every ~8 steps), batch 256, compile $1"
    profiled $run
}

case "$what" in
session)  # one lent session's worth, most wanted first, each part under its own limit
    for spec in "260 trainer" "110 step ti4 --methods mpp+compile --no-loader" "180 workers 14 11"; do
        set -- $spec
        timeout "$1" bash "$self" "${@:2}" || echo "part '${*:2}' ended with status $?" | tee -a "$OUT/session.txt"
    done
    bash "$self" ratio || echo "part 'ratio' ended with status $?" | tee -a "$OUT/session.txt" ;;
ratio)  # the trainer's Ti/4 windows against the in-memory compiled step, both measured in this call
    python3 - <<'PY' | tee -a "$OUT/session.txt"
import json, os, sys
out, call = os.environ["OUT"], os.environ["CALL"]
try:  # this call's only: an OUT used by earlier calls (another card, perhaps) holds theirs too
    trainer = [r for r in map(json.loads, open(f"{out}/windows.jsonl"))
               if r["run"] == "/tmp/runs/pre_vit_ti4_32_default" and r.get("call") == call][-1]
    table = json.load(open(f"{out}/step_ti4.json"))
    if table.get("call") != call:
        raise ValueError(f"the step table is call {table.get('call')}'s")
except (OSError, IndexError, KeyError, ValueError) as e:
    sys.exit(f"ratio: no Ti/4 trainer window or compiled step of call {call} in {out} ({type(e).__name__}: {e}); "
             "did trainer or step ti4 time out?")
steps = [r for r in table["rows"] if r["method"] == "mpp+compile"]
step = next((r for r in steps if (r["batch"], r["precision"]) == (trainer["batch"], trainer["precision"])), None)
if step is None:
    sys.exit(f"ratio: the trainer ran batch {trainer['batch']} {trainer['precision']}, the compiled step only "
             + (", ".join(f"batch {r['batch']} {r['precision']}" for r in steps) or "not at all")
             + f"; run step ti4 --batch-size {trainer['batch']}")
print(f"Ti/4 batch {step['batch']} {step['precision']}: trainer {trainer['median_images_per_s']:.0f} images/s (median "
      f"window) / in-memory compiled step {step['images_per_s']:.0f} images/s = "
      f"{trainer['median_images_per_s'] / step['images_per_s']:.2f} (target >= 0.90)")
PY
    ;;
cuda-tests)
    python3 -m pytest -q -p no:cacheprovider tests/test_compiled.py tests/test_precision.py tests/test_prefetch.py tests/test_profiling.py 2>&1 | tee "$OUT/cuda_tests.log" ;;
step)  # eager, compiled and CUDA-graph steps against the plain timm loop, MFU, memory
    models=(); while [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; do models+=("$1"); shift; done
    name=$(IFS=_; echo "${models[*]}")
    rm -f "$OUT/step_$name.json"  # cut off, this call must leave no table (an earlier call's would stand for it)
    python3 benchmarks/train_step.py --device cuda --precision bf16 --only "${models[@]}" --loader-model "${models[0]}" \
        --workers 12 --json "$OUT/step_$name.json" "$@" 2>&1 | tee "$OUT/step_$name.log"
    python3 - "$OUT/step_$name.json" <<'PY'  # the call that measured it, for `ratio`
import json, os, sys
table = json.load(open(sys.argv[1]))
json.dump({**table, "call": os.environ["CALL"]}, open(sys.argv[1], "w"), indent=1)
PY
    ;;
trainer)  # synthetic shards (CIFAR-10's exceed what travels); 20,000 images: an epoch every ~20 steps
    python3 -m mpp.tools.make_synthetic /tmp/syn32 --train 20000 --test 1000 --shards 32 >/dev/null 2>&1
    rate() { python3 benchmarks/loader_rate.py --data /tmp/syn32/train/manifest.json "$@" | tee -a "$OUT/trainer.txt"; }
    rate --batch-size 1024 --workers 1  # one worker: what a core of this machine does
    for device in cpu cuda; do  # with no step to feed, the data settings of the runs below
        rate --batch-size 1024 --workers 14 --epochs 4 --device $device
        rate --batch-size 256 --workers 12 --fraction 0.1 --epochs 24 --device $device
    done
    pretrain vit_ti4_32 1024 syn32 240 default ;;
workers)  # after trainer (its data): fewer decoding processes beside the loop's thread
    ws=("$@"); [ $# -gt 0 ] || ws=(8 11); i=0
    for w in "${ws[@]}"; do i=$((i+1)); TAG=_w${w}_$i pretrain vit_ti4_32 1024 syn32 240 default data.num_workers=$w; done ;;
graphs)  # after trainer (its data): the same pre-training replayed as CUDA graphs
    pretrain vit_ti4_32 1024 syn32 240 reduce-overhead ;;
finetune)  # after trainer (its encoder and data)
    finetune always
    finetune never ;;
trainer-b16|graphs-b16)
    # few images: the generator writes 256 px JPEGs on one core, slowly enough to eat the part's limit
    [ -f /tmp/syn256/train/manifest.json ] ||
        python3 -m mpp.tools.make_synthetic /tmp/syn256 --train 1500 --test 100 --size 256 --shards 16 >/dev/null 2>&1
    mode=default; [ "$what" = trainer-b16 ] || mode=reduce-overhead
    pretrain vit_b16 256 syn256 120 $mode ;;
recompiles)
    # 19,800 images at batch 1024 (Ti/4: 65 tokens an image): each epoch of 20 batches ends in one of
    # 344 images, small enough to cross the sizes inductor's kernels may guard on (on CPU a sum over
    # 4,096 rows); TORCH_LOGS=recompiles names the guard of every recompile
    [ -f /tmp/syn198/train/manifest.json ] ||
        python3 -m mpp.tools.make_synthetic /tmp/syn198 --train 19800 --test 200 --shards 16 >/dev/null 2>&1
    rm -rf /tmp/runs/recompiles  # an earlier call's finished run would resume: no steps, no recompiles
    TORCH_LOGS=recompiles python3 -m mpp.tools.pretrain --config configs/synthetic_mpp.yaml model=vit_ti4_32 \
        batch_size=1024 steps=45 data.train=/tmp/syn198/train/manifest.json data.val=/tmp/syn198/test/manifest.json \
        data.num_workers=14 train.log_every=5 train.ckpt_every=100000 train.compile=always \
        output_dir=/tmp/runs/recompiles 2>&1 | tr '\r' '\n' | { grep -v "it/s" || true; } > "$OUT/recompiles.log"
    echo "recompiles in 45 compiled steps over two epoch ends: $(grep -c 'triggered by' "$OUT/recompiles.log")" |
        tee -a "$OUT/trainer.txt"
    grep -A2 "triggered by" "$OUT/recompiles.log" | tee -a "$OUT/trainer.txt" || true ;;
deterministic)  # a and b as shipped, c and d under train.deterministic=true; eager (short runs are)
    [ -f /tmp/syn5k/train/manifest.json ] ||
        python3 -m mpp.tools.make_synthetic /tmp/syn5k --train 5000 --test 200 --shards 8 >/dev/null 2>&1
    for run in a:false b:false c:true d:true; do
        rm -rf /tmp/runs/det_${run%:*}  # an earlier call's finished run would resume and be compared
        python3 -m mpp.tools.pretrain --config configs/synthetic_mpp.yaml model=vit_ti4_32 batch_size=1024 \
            steps=60 data.train=/tmp/syn5k/train/manifest.json data.val=/tmp/syn5k/test/manifest.json \
            data.num_workers=14 train.log_every=20 train.ckpt_every=100000 train.compile=never \
            train.deterministic=${run#*:} output_dir=/tmp/runs/det_${run%:*} 2>&1 | tr '\r' '\n' |
            { grep -v "it/s" || true; } | tail -3 >> "$OUT/deterministic.log"
        [ -f /tmp/runs/det_${run%:*}/metrics.json ] || echo "run ${run%:*} (deterministic ${run#*:}) failed" | tee -a "$OUT/trainer.txt"
    done
    python3 - <<'PY' | tee -a "$OUT/trainer.txt"
import hashlib, json, os
def look(r):
    d = f"/tmp/runs/det_{r}"
    if not os.path.exists(d + "/metrics.json"):
        return None, None
    return hashlib.sha256(open(d + "/encoder.safetensors", "rb").read()).hexdigest()[:16], round(json.load(open(d + "/metrics.json"))["images_per_s"])
(a, ra), (b, rb), (c, rc), (d, rd) = (look(r) for r in "abcd")
print(f"deterministic: as shipped the two encoders are {'the same bits' if a and a == b else 'different'} "
      f"({a}, {b}; {ra} and {rb} images/s); train.deterministic=true: {'the same bits' if c and c == d else 'different'} "
      f"({c}, {d}; {rc} and {rd} images/s)")
PY
    ;;
mainjob)
    rm -rf runs/compare_synthetic  # an earlier call's finished stages would be skipped, its report read
    start=$(date +%s)  # its own limit inside the part's, so that what follows runs even when it is cut off
    timeout 350 python3 -m mpp.tools.compare --config configs/compare_synthetic.yaml > "$OUT/mainjob.log" 2>&1 ||
        echo "main job ended with status $? (124: stopped at 350 s)" | tee -a "$OUT/trainer.txt"
    echo "main job (configs/compare_synthetic.yaml): $(( $(date +%s) - start )) s" | tee -a "$OUT/trainer.txt"
    [ ! -f runs/compare_synthetic/report.md ] || cp runs/compare_synthetic/report.md "$OUT/mainjob_report.md"
    grep "stages trained now took" "$OUT/mainjob.log" | tee -a "$OUT/trainer.txt" || true ;;  # not there if cut off
probe-threads)  # the main job's probe-head fits looked slower there than on 2 cores (docs/benchmarks.md)
    files=$(ls runs/compare_synthetic/feature_cache/features-*.safetensors | head -2)
    for threads in "-u OMP_NUM_THREADS" "OMP_NUM_THREADS=2"; do  # torch's default (one per core), then 2
        env $threads python3 benchmarks/probe_fit.py --features $files 2>&1 | tee -a "$OUT/probe_threads.txt"
    done ;;
tests)  # each test's name as it passes (a part cut off by its limit still says how far it got), the slowest at the end
    if [ -n "${part:-}" ]; then
        k=${part%/*} n=${part#*/} log=tests_${k}of$n.log
        files=$(LC_ALL=C ls tests/test_*.py | awk -v k="$k" -v n="$n" '(NR - k) % n == 0')
    else
        # one log per call, named after its first file or test (a session makes two)
        files="$*" log=tests_from_$(basename "$1" | sed 's/\.py//; s/[^A-Za-z0-9_]\+/_/g').log
    fi
    # each test's time as it passes (a call cut off by its limit keeps them), and a test still
    # running after 100 s prints every thread's stack (the sixth session's stopped in one)
    python3 -m pytest -v -p no:cacheprovider --durations=15 -o console_output_style=times -o faulthandler_timeout=100 \
        $files 2>&1 | tee "$OUT/$log" | grep -v " PASSED " ;;
esac
