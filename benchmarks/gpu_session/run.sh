#!/bin/bash
# GPU session (issue 22): setup, probe, the streams against their steps, bench_scale, S_MaxImage at 5K,
# Flickr30K-size fragment and N-pair epochs, MirroredStrategy.
set -u
T0=$(date +%s); DEADLINE=$((T0 + ${BUDGET:-480}))
exec > >(tee "$OUT/run.log") 2>&1
mark() { echo "== $(date '+%Y/%m/%d %H:%M:%S.%N') $*"; }
STAGES=",${STAGES:-probe,fed,scale,gallery,real,mirrored},"   # a subset splits the work over two calls
want() { [[ $STAGES == *",$1,"* ]]; }
stage() {  # stage NAME MAX_SECONDS command...
  local name=$1 max=$2; shift 2
  local left=$((DEADLINE - $(date +%s))); local t=$(( max < left ? max : left ))
  if [ "$t" -lt 20 ]; then mark "$name skipped ($left s left)"; return; fi
  mark "$name start (limit $t s)"; timeout -k 5 "$t" "$@"; mark "$name end rc=$?"
}
mark setup; source benchmarks/gpu_session/setup_env.sh; mark "setup done ($(( $(date +%s) - T0 )) s)"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used,power.draw --format=csv,noheader,nounits -lms 250 > "$OUT/smi.csv" &
SMI=$!
vmstat -n 1 > "$OUT/vmstat.txt" 2>/dev/null &
VM=$!
lscpu | grep -E "Model name|^CPU\(s\)" | cut -c1-200
want probe && stage probe 60 $PY benchmarks/gpu_session/probe.py
# on the CPU while the small sizes run: the real-size folders (one pass over the training sentences in 5 epochs:
# fragments 5 x 298 steps of 100, N-pair 5 x 466 steps of 64)
# (the two writers side by side: each is one core's random numbers and float16 casts)
want real && ( $PY benchmarks/gpu_session/drive.py write fragments ${N30K:-29783} 1000 float16 ${FRAG_STEPS:-298} > "$WORK/write_fragments.log" 2>&1 &
  $PY benchmarks/gpu_session/drive.py write npair ${N30K:-29783} 1000 float16 ${NPAIR_STEPS:-466} > "$WORK/write_npair.log" 2>&1; wait ) &
WRITERS=$!
# MirroredStrategy on the GPU beside bench_scale (its figures are metrics, not time)
want mirrored && ( $PY -c "
import json, os, pathlib; from benchmarks import bench_scale
f = pathlib.Path(os.environ['BENCH_WORK']); f.mkdir(parents=True, exist_ok=True)
cmd = bench_scale.two_branch(f / 'tb_2000', 2000, 1000, 'float32', f / 'tb_run', 0, verbose=2)
(f / 'two_branch_2000.cmd.json').write_text(json.dumps({'command': cmd}))"
  RUN_TIMEOUT=90 $PY benchmarks/gpu_session/drive.py run two_branch 2000 --strategy=default --run_dir=$BENCH_WORK/tb_default
  RUN_TIMEOUT=90 $PY benchmarks/gpu_session/drive.py run two_branch 2000 --strategy=mirrored --run_dir=$BENCH_WORK/tb_mirrored
) > "$WORK/mirrored.log" 2>&1 &
MIRRORED=$!
# does each stream keep up with its step on this machine? (run_all's input rows, 3,000 images, longer on a GPU)
want fed && stage fed ${FED_MAX:-150} $PY -c "
import json, os
from benchmarks import bench_input_pipelines
for system in ('fragments', 'npair'):
    row = bench_input_pipelines.fed_child(system, ${FED_IMAGES:-3000}, os.environ['BENCH_WORK'] + '/fed_' + system, 200, 100, 10)
    print('fed', json.dumps(row), flush=True)"
# two bench_scale processes side by side (peak RSS is per process; their times share the machine)
SCALE="$PY -m benchmarks.bench_scale --timeout 80"
want scale && stage bench_scale ${SCALE_MAX:-170} bash -c "$SCALE --systems ${SCALE_A:-dual_path,two_branch} \
  --sizes ${SIZES_A:-1000,4000} --work_dir $WORK/scale_a --out_json $OUT/scale_a.json & $SCALE \
  --systems ${SCALE_B:-fragments,npair} --sizes ${SIZES_B:-1000,4000} --work_dir $WORK/scale_b --out_json $OUT/scale_b.json; wait"
# S_MaxImage at COCO 5K's 5,000 images (a fifth of the captions, extrapolated) and the N-pair step's matmul ratio
want gallery && stage gallery ${GALLERY_MAX:-150} $PY -m benchmarks.bench_npair --steps 3 --gallery_images 5000 \
  --gallery_captions 25000 --scale ${GALLERY_SCALE:-0.2} --out_json "$OUT/npair.json"
mark "waiting for the writers"; [ -n "${WRITERS:-}" ] && wait $WRITERS; cat "$WORK"/write_*.log; mark "written"
export RUN_TIMEOUT=${RUN_LIMIT:-170}
want real && stage fragments_30k 175 $PY benchmarks/gpu_session/drive.py run fragments ${N30K:-29783} --epochs=5
want real && stage npair_30k 175 $PY benchmarks/gpu_session/drive.py run npair ${N30K:-29783} --epochs=5
[ -n "${MIRRORED:-}" ] && wait $MIRRORED; cat "$WORK/mirrored.log" 2>/dev/null | grep -v "^I0000\|^W0000\|^E0000\|WARNING: All"
mark "all done ($(( $(date +%s) - T0 )) s)"
kill $SMI $VM 2>/dev/null
(cd "$WORK" && tar -czf "$OUT/logs.tgz" $(ls -d bench/*.log scale_*/*.log *.log 2>/dev/null))
grep -h -E "ms/step|s/step|rsum|collapsed|Error|error" "$WORK"/bench/*.log | cut -c1-300 | tail -40
