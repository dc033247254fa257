#!/usr/bin/env bash
# One full GPU session (run on the H200 through the device tool, from the repo root):
#   build in place, explain, the whole test suite with CUDA (GPU-marked tests included,
#   hypothesis "gpu" profile), the compute-sanitizer check, then the benchmarks.
# Everything lands under $OUT (default ./device_out): run.log, explain.txt, *.json, *.md.
# Usage: BENCH_COMMIT=<git hash> bash bench/run_device.sh [--quick] [--tests-only] [--bench-only]
# (the device copy has no .git: pass the commit the rows should record)
set -uo pipefail
OUT=${OUT:-$PWD/device_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
QUICK=""; TESTS=1; BENCH=1
for a in "$@"; do
  case "$a" in
    --quick) QUICK="--quick" ;;
    --tests-only) BENCH=0 ;;
    --bench-only) TESTS=0 ;;
  esac
done
log="$OUT/run.log"
{
  echo "== build"; date -u
  # pip's editable install re-runs pip with build isolation under setuptools 81 (no network there):
  # build the extension in place instead.
  python3 setup.py build_ext --inplace > /tmp/build.log 2>&1 || { tail -40 /tmp/build.log; exit 1; }
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
  python3 -m torch_cfm | tee "$OUT/explain.txt"
  if [ "$TESTS" = 1 ]; then
    echo "== tests"; date -u
    # SIGINT at the limit so pytest still prints its summary of what ran.
    HYPOTHESIS_PROFILE=gpu timeout -s INT 420 python3 -m pytest -q -p no:cacheprovider -p no:benchmark -n 12 --tb=line -rf 2>&1 | tail -80
    if command -v compute-sanitizer >/dev/null && [ -f tests/gpu_memcheck.py ]; then
      echo "== compute-sanitizer memcheck"; date -u
      timeout 180 compute-sanitizer --tool memcheck --error-exitcode 3 python3 tests/gpu_memcheck.py 2>&1 | tail -15
      echo "memcheck exit: ${PIPESTATUS[0]}"
    fi
  fi
  if [ "$BENCH" = 1 ]; then
    echo "== bench attention"; date -u
    python3 bench/attention.py $QUICK --out "$OUT" 2>&1 | tail -60
    if [ -f bench/dit_step.py ]; then
      echo "== bench dit_step"; date -u
      python3 bench/dit_step.py $QUICK --out "$OUT" 2>&1 | tail -80
    fi
  fi
  echo "== done"; date -u
} 2>&1 | tee "$log"
