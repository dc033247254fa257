#!/usr/bin/env bash
# Iteration call on the H200 (device tool): build in place; the GPU tests of what changed with
# full failure text; the GPU property profile; the attention sweep; the quick DiT-step rows.
# Logs and a results.tgz land under $OUT.  Usage: BENCH_COMMIT=<hash> bash bench/device_probe.sh
set -uo pipefail
OUT=${OUT:-$PWD/device_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 setup.py build_ext --inplace > /tmp/build.log 2>&1 || { tail -40 /tmp/build.log; exit 1; }
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
PYTEST="python3 -m pytest -q -p no:cacheprovider -p no:benchmark -n 12 -rfE"
{
  echo "== tests (failing last run + kernels changed)"; date -u
  timeout -s INT 170 $PYTEST --tb=short tests/test_cfm_attention_contract.py tests/test_failures.py \
    tests/test_compile_rules.py tests/test_aoti.py tests/test_cfm_attention_triton.py \
    tests/test_cfm_attention_graphs.py tests/test_dit_body.py tests/test_dit_body_graphs.py tests/test_graphs.py \
    > "$OUT/tests.log" 2>&1
  tail -3 "$OUT/tests.log"; grep -E "^(FAILED|ERROR) " "$OUT/tests.log" | head -40
  echo "== properties (gpu profile)"; date -u
  HYPOTHESIS_PROFILE=gpu timeout -s INT 130 $PYTEST --tb=short -m gpu tests/test_properties.py \
    tests/test_properties_model.py > "$OUT/props.log" 2>&1
  tail -3 "$OUT/props.log"; grep -E "^(FAILED|ERROR) " "$OUT/props.log" | head -20
  sed -n '/property cases tried/,/^total/p' "$OUT/props.log"
  echo "== attention sweep"; date -u
  timeout 100 python3 bench/attention.py --sweep --shapes "2,50,450;8,50,450;32,50,450" \
    --dtypes fp16,fp32-tf32 --sweep-repeats 20 --out "$OUT" 2>&1 | tail -8
  echo "== dit step"; date -u
  timeout 130 python3 bench/dit_step.py --quick --providers torch_cfm --solve-dtypes fp16 --out "$OUT" 2>&1 \
    | grep -E "^(dit_step|solve)" | tail -30
  echo "== done"; date -u
} 2>&1 | tee "$OUT/probe.log"
cd "$OUT" && tar czf results.tgz --exclude='*.log' --exclude=results.tgz . 2>/dev/null
find "$OUT" -maxdepth 1 -type f ! -name '*.log' ! -name results.tgz -delete
