#!/usr/bin/env bash
# No-regression run on the GPU box: the same benchmarks on two source trees in one device call.
#
# Usage (from the new tree's root, on the device):
#   OLD_TREE=.old OLD_COMMIT=<hash> BENCH_COMMIT=<hash> bash bench/compare_trees.sh
# OLD_TREE is a checkout of the previous commit (e.g. `git archive <hash> | tar -x -C .old`, carried to
# the device as an ignored path). Both trees are built at once, then each benchmark runs on the old
# tree and on the new one back to back (same machine, same minute), and bench/compare_rows.py prints
# new/old per row. Rows land in $OUT/old and $OUT/new (the benchmarks' own upserted files).
set -uo pipefail
OUT=${OUT:-$PWD/device_out}; mkdir -p "$OUT/old" "$OUT/new"
OLD_TREE=$(cd "${OLD_TREE:?set OLD_TREE to the tree of the previous commit}" && pwd); NEW_TREE=$PWD
export PYTHONUNBUFFERED=1 CXX=${TORCH_CFM_CXX:-g++} CC=${TORCH_CFM_CC:-gcc}
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0a}
# The shapes of the comparison: attention at the steady streaming shapes, the estimator step, the
# whole-solve row and the server's steady tick (B streams = 2B rows). PARTS picks and orders them.
ATTN_ARGS=${ATTN_ARGS:-"--shapes 8,50,450;32,50,450 --dtypes fp16,fp32-tf32 --providers torch_cfm --no-eager --repeats 30"}
STEP_ARGS=${STEP_ARGS:-"--shapes 8,50,400;32,50,400 --dtypes fp16,fp32-tf32 --providers torch_cfm --variants none,arena --no-solve"}
SOLVE_ARGS=${SOLVE_ARGS:-"--shapes 8,50,400 --dtypes fp16 --providers torch_cfm --variants none --no-steps"}
SERVER_ARGS=${SERVER_ARGS:-"--streams 16,64 --dtype fp16 --label steady"}
# the many-stream front, CFM alone (bench/serving.py), and one Token2wav stream (bench/stepaudio2_stream.py)
SERVING_CFM_ARGS=${SERVING_CFM_ARGS:-"--stages cfm --providers torch_cfm --concurrency 1,16,64 --quick --warmup --dtype fp16"}
STREAM_ARGS=${STREAM_ARGS:-"--quick"}
# tokens -> waveform (CFM alone and with the encoder and vocoder) and the vocoder decode alone
SERVING_WAV_ARGS=${SERVING_WAV_ARGS:-"--stages cfm,wav --providers torch_cfm --concurrency 16,64 --quick --warmup --dtype fp16"}
VOCODER_ARGS=${VOCODER_ARGS:-"--streams 64 --upstream tf32 --precisions tf32,fp16 --compiled= --slab= --repeats 5 --calls 2"}

build() {  # build <tree> <log> (in place; a warm machine keeps the last call's build: SKIP_BUILD=1 reuses it)
  if [ "${SKIP_BUILD:-0}" = 1 ] && ls "$1"/torch_cfm/_C*.so > /dev/null 2>&1; then return 0; fi
  (cd "$1" && MAX_JOBS=8 python3 setup.py build_ext --inplace > "$2" 2>&1) || { tail -30 "$2"; return 1; }
  # a bare checkout: compile_rules/ reached as torch_cfm.compile_rules (what pyproject's package-dir does)
  [ -e "$1/torch_cfm/compile_rules" ] || [ -e "$1/torch_cfm/_source_layout.py" ] || ln -s ../compile_rules "$1/torch_cfm/compile_rules"
}
echo "== build both trees"; date -u
build "$OLD_TREE" "$OUT/build_old.log" & p1=$!
build "$NEW_TREE" "$OUT/build_new.log" & p2=$!
wait $p1 || exit 1; wait $p2 || exit 1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv

run_side() {  # run_side <old|new> <script relative to the tree> <args...>
  local side=$1 script=$2; shift 2
  local tree=$NEW_TREE commit=${BENCH_COMMIT:-new}
  [ "$side" = old ] && tree=$OLD_TREE commit=${OLD_COMMIT:-old}
  # a script the old tree lacks (serving_tick.py) runs from the new tree against the old one (--repo):
  # it uses only the public API both trees have
  local repo=()
  [ -f "$tree/$script" ] || { script=$NEW_TREE/$script; repo=(--repo "$tree"); }
  (cd "$tree" && PYTHONPATH=$tree${PYTHONPATH:+:$PYTHONPATH} BENCH_COMMIT=$commit timeout "${LIMIT_EACH:-200}" python3 "$script" "$@" \
    "${repo[@]}" --out "$OUT/$side" >> "$OUT/$side.log" 2>&1) || echo "$side $script: exit $?"
}
both() { echo "== $*"; date -u; run_side old "$@"; run_side new "$@"; }
for part in ${PARTS:-serving steps solve attention}; do
  case $part in
    serving) both bench/serving_tick.py $SERVER_ARGS ;;
    serving-cfm) both bench/serving.py $SERVING_CFM_ARGS ;;
    stream) both bench/stepaudio2_stream.py $STREAM_ARGS ;;
    serving-wav) both bench/serving.py $SERVING_WAV_ARGS ;;
    vocoder) both bench/vocoder.py $VOCODER_ARGS ;;
    steps) both bench/dit_step.py $STEP_ARGS ;;
    solve) both bench/dit_step.py $SOLVE_ARGS ;;
    attention) both bench/attention.py $ATTN_ARGS ;;
  esac
done
echo "== compare"; date -u
python3 bench/compare_rows.py "$OUT/old" "$OUT/new" | tee "$OUT/compare.md"
# the device tool brings back at most 8 files: the rows of both trees in one archive
tar czf /tmp/compare_rows.tgz -C "$OUT" old new && rm -rf "$OUT/old" "$OUT/new" && mv /tmp/compare_rows.tgz "$OUT/"
