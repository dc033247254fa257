#!/usr/bin/env bash
# The GPU work the last stop could not run (its device time ran out), as three device calls on one
# warm machine. Carry .whl (the upstream wheels), .upstream (minicpmo-utils) and .old (the previous
# landing's tree: `git archive 3b26b83 | tar -x -C .old`). Results land under $OUT.
#   bash bench/experiments/device_calls_next.sh tests     # ~6 min: GPU tests of what changed
#   bash bench/experiments/device_calls_next.sh compare   # ~9 min: vocoder + tokens->waveform vs 3b26b83
#   bash bench/experiments/device_calls_next.sh peers     # ~8 min: vLLM-Omni plugin bars, minicpmo stream
set -u
OUT=${OUT:-$PWD/device_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 BENCH_COMMIT=${BENCH_COMMIT:-unknown}
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=$PWD:/tmp/site
[ -e torch_cfm/compile_rules ] || ln -s ../compile_rules torch_cfm/compile_rules
if ! ls torch_cfm/_C*.so > /dev/null 2>&1; then
  CXX=g++ CC=gcc MAX_JOBS=16 timeout 150 python3 setup.py build_ext --inplace > "$OUT/build.log" 2>&1
  echo "build rc=$?"
fi
case ${1:?tests, compare or peers} in
  tests)  # one result line per file (a file cut by its limit prints its dots only)
    for f in test_vocoder_conv test_vocoder_hift test_token2wav_vocoder test_hift_graphs test_server test_graphs \
             test_warmup test_vllm_omni test_minicpmo_server test_minicpmo_utils test_prompt_pacing; do
      timeout -s INT 50 python3 -m pytest -q -p no:cacheprovider -rfE -m gpu "tests/$f.py" > "$OUT/$f.log" 2>&1
      echo "$f: $(grep -E 'passed|failed|error' "$OUT/$f.log" | tail -1)"; grep -E "^(FAILED|ERROR)" "$OUT/$f.log" | head -5
    done ;;
  compare)  # the 64-stream vocoder decode and the tokens->waveform / CFM-alone rows, old tree and new
    OLD_TREE=.old OLD_COMMIT=3b26b83 PARTS="vocoder serving-wav" LIMIT_EACH=250 SKIP_BUILD=1 \
      SERVING_WAV_ARGS="--stages cfm,wav --providers torch_cfm --concurrency 64 --quick --warmup --dtype fp16" \
      timeout 560 bash bench/compare_trees.sh > "$OUT/compare.log" 2>&1; tail -40 "$OUT/compare.log" ;;
  peers)  # issue 42's bars (BatchedToken2Wav vs the plugin) and issue 40's one minicpmo-utils stream
    timeout 330 python3 bench/serving_vllm_omni.py --quick --dtypes fp16 --out "$OUT" > "$OUT/vllm_omni.log" 2>&1
    tail -25 "$OUT/vllm_omni.log"
    STEPAUDIO2_PATH=.upstream/minicpmo-utils timeout 150 python3 bench/minicpmo_stream.py --out "$OUT" \
      > "$OUT/minicpmo_stream.log" 2>&1; tail -12 "$OUT/minicpmo_stream.log" ;;
esac
