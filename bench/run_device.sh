#!/usr/bin/env bash
# GPU session script (run on the H200 through the device tool, from the repo root). Builds the
# extension in place, prints the dispatch decisions, then runs the stages asked for, in order.
# Every stage writes its whole log under $OUT (default ./device_out); result tables/rows too.
#
# Usage: BENCH_COMMIT=<git hash> bash bench/run_device.sh [stage ...]
#   tests          the whole suite with CUDA (GPU-marked tests included), hypothesis "ci" profile
#   tests-gpu      the GPU-marked tests of the ops, graphs and compile rules only (GPU_TESTS="file ..."
#                  picks files, GPU_TESTS_K="expr" a pytest -k filter). The whole set no longer fits one
#                  device call (250 s ran 176 tests of the attention files, 200 s ran 131 of
#                  the body/graph files, neither finished): run it as two calls, GPU_TESTS= the three
#                  test_cfm_attention_{triton,numerics,contract}.py files, then the rest (LIMIT_TESTS_GPU=540)
#   tests-cpu-ops  the CPU tests of the op contract and failure files on this box's build (the C++
#                  CPU kernel's error paths with this compiler/torch pair)
#   props          the property suite under the hypothesis "gpu" profile, with case counts
#   memcheck       compute-sanitizer memcheck over tests/gpu_memcheck.py (MEMCHECK_ARGS=--quick)
#   attention      bench/attention.py: every SPEC §7 shape, dtype and peer (one run; ATTENTION_ARGS narrows
#                  it, e.g. "--shapes 8,50,450 --dtypes fp16")
#   sweep          bench/attention.py --sweep (kernel variants; SWEEP_ARGS adds e.g. "--shapes 8,50,450")
#   dit            bench/dit_step.py --quick (steps + the 10-step solve, peers without torch.compile)
#   dit-full       bench/dit_step.py (every shape/dtype, torch.compile peer included: long;
#                  DIT_ARGS narrows it, e.g. "--no-solve --variants none --providers torch_cfm")
#   dit-compile    the torch.compile max-autotune peer at (8,50,400) fp16 with torch_cfm and the
#                  reference graph in the same run (~3 min of compilation)
#   cuda-ablation  bench/cuda_attention_ablation.py: every config of the CUDA attention kernel, next to
#                  a one-kernel floor (CUDA_ABLATION_ARGS)
#   serving-tick   bench/serving_tick.py: CFMServer(graphs=True) steady tick at 16 and 64 streams (fp16,
#                  300-frame prompts, 50-frame chunks, caches at 400; SERVING_TICK_ARGS); the same benchmarks on
#                  the previous commit's tree in the same call: bench/compare_trees.sh
#   serving        bench/serving.py: the many-stream token2wav front against the upstream per-request path and
#                  whole-solve graph (SERVING_ARGS, default "--quick --ticks 40 --warmup"); stepaudio2-stream:
#                  bench/stepaudio2_stream.py, one stream (STEPAUDIO2_ARGS). Both need stepaudio2
#                  importable (pip install --no-deps stepaudio2-minicpmo, or its files on PYTHONPATH)
#   graph-launch   bench/graph_launch.py: host µs of the solve graphs' launch and of CFMServer.solve_chunk
#                  (GRAPH_LAUNCH_ARGS, e.g. "--plain-graphs")
#   ncu-attention  Nsight Compute (full set, SASS source counters) of the attention kernel at
#                  (8,50,450) fp16 and fp32-tf32 (bench/profile_attention.py), when ncu exists
#   sm-ingest      bench/sm_ingest.py: bytes per µs one SM takes in (ld.global / cp.async / bulk copies, L2 and
#                  HBM, 1-132 CTAs; SM_INGEST_ARGS); JIT-builds bench/sm_ingest.cu (≈ 1 min)
#   wgmma-gemm     bench/wgmma_gemm.py: the wgmma + TMA GEMM (csrc/cuda/dit_linear*) vs cuBLAS at the
#                  block's K = 512 shapes
#                  (check, repeated calls, per-role dependent chains with and without PDL; WGMMA_ARGS)
#   large-batch    bench/experiments/large_batch_probe.py: the 32-128-row body's GEMMs (cuBLAS, FP8, Triton tiles),
#                  attention on the arena layout and a profiled steady tick (LARGE_BATCH_ARGS, default
#                  "--parts gemm,attn,tick"); its JSON under $OUT/large_batch
#   cutlass        bench/cutlass_gemm.py: the CUTLASS GEMMs (build_cutlass/libtcfm_cutlass.so, built on the CPU machine by
#                  csrc/cutlass/build.sh and carried) against cuBLAS per role at 32/64/128 rows (CUTLASS_ARGS)
#   vocoder        bench/vocoder.py: the many-stream HiFT vocoder's decode of 64 chunks vs the upstream HiFT (VOCODER_ARGS)
#   vllm-omni      bench/serving_vllm_omni.py: vLLM-Omni's BatchedToken2Wav as shipped, patched, and Token2wavServer
#                  (VLLM_ARGS; needs the vllm-omni wheel: carry .whl)
#   minicpmo-stream  bench/minicpmo_stream.py: one minicpmo-utils Token2wav stream after apply_torch_cfm vs upstream
#                  (needs .upstream/minicpmo-utils carried)
#   compare        bench/compare_trees.sh against OLD_TREE (carried checkout of the previous commit; PARTS)
# 'all': tests memcheck attention dit-full; no stage: an error. The device copy has no .git: pass BENCH_COMMIT.
# Wheels under .whl/ (carried) are installed first (--no-deps); SKIP_BUILD=1 keeps a warm machine's build.
# Each stage has its own time limit (LIMIT_<STAGE> seconds, e.g. LIMIT_TESTS=400).
set -uo pipefail
OUT=${OUT:-$PWD/device_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# No stage named: refuse (a whole device call is easily spent on the old default by mistake); "all" runs
# the full set.
STAGES=("$@")
if [ ${#STAGES[@]} -eq 0 ]; then echo "run_device.sh: name the stages (or 'all' for tests memcheck attention dit-full)"; exit 2; fi
[ "${STAGES[*]}" = "all" ] && STAGES=(tests memcheck attention dit-full)
# xdist workers: one per core of the GPU box (16). Most of the
# GPU tests' time is Triton compiling on the host (≈ 20 s per attention variant test)
PYTEST_ONE="python3 -m pytest -q -p no:cacheprovider -p no:benchmark -rfE --tb=short --durations=30"
PYTEST="$PYTEST_ONE -n ${PYTEST_WORKERS:-16}"
GPU_TESTS=${GPU_TESTS:-"tests/test_cfm_attention_contract.py tests/test_failures.py tests/test_compile_rules.py tests/test_aoti.py
  tests/test_cfm_attention_triton.py tests/test_cfm_attention_graphs.py tests/test_cfm_attention_numerics.py
  tests/test_dit_body.py tests/test_dit_body_graphs.py tests/test_graphs.py tests/test_server.py tests/test_warmup.py
  tests/test_integration_stepaudio2.py tests/test_stepaudio2_server.py tests/test_hift_graphs.py"}

limit() { local v="LIMIT_${1//-/_}"; v=${v^^}; echo "${!v:-$2}"; }
summary() { tail -3 "$1"; grep -E "^(FAILED|ERROR) " "$1" | head -40; }
# Tests marked "timing" assert a time ratio, which 16 workers sharing one GPU and its host inflate (one such
# test: 1.455x under xdist against a 1.25x bound, passing alone). The stages that run GPU tests leave them out of
# the parallel run and run them after it, in one process: timing_tests <log name> <pytest selection...>
timing_tests() {
  local log="$OUT/$1"; shift
  timeout -s INT "$(limit timing 150)" $PYTEST_ONE -p no:xdist -m "gpu and timing" "$@" > "$log" 2>&1
  echo "timing tests (one process):"; summary "$log"
}

# The H200 box's default CXX (/opt/gcc/bin/g++) links libstdc++ statically: the extension and the
# AOTInductor packages built with it crash the process whenever their C++ code throws (setup.py
# now refuses such a build). Use the system compiler, the one torch was built with (GCC 13).
export CXX=${TORCH_CFM_CXX:-g++} CC=${TORCH_CFM_CC:-gcc}
# The optional CUDA extension (csrc/cuda/) for the H200 only, its sources compiled in parallel.
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0a} MAX_JOBS=${MAX_JOBS:-16}
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > /dev/null 2>&1 \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
{
  echo "== build"; date -u; $CXX --version | head -1
  # pip's editable install re-runs pip with build isolation under setuptools 81 (no network there):
  # build the extension in place instead.
  if [ "${SKIP_BUILD:-0}" != 1 ] || ! ls torch_cfm/_C*.so > /dev/null 2>&1; then
    python3 setup.py build_ext --inplace > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
  fi
  # a bare checkout has no installer to map compile_rules/ to torch_cfm.compile_rules (pyproject's package-dir)
  [ -e torch_cfm/compile_rules ] || ln -s ../compile_rules torch_cfm/compile_rules
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
  python3 -m torch_cfm > "$OUT/explain.txt" 2>&1; cat "$OUT/explain.txt"
  for stage in "${STAGES[@]}"; do
    echo "== $stage"; date -u
    case "$stage" in
      tests)  # SIGINT at the limit so pytest still prints its summary of what ran
        timeout -s INT "$(limit tests 420)" $PYTEST -m "not timing" > "$OUT/tests.log" 2>&1; summary "$OUT/tests.log"
        timing_tests tests_timing.log tests ;;
      tests-gpu)
        timeout -s INT "$(limit tests-gpu 200)" $PYTEST -m "gpu and not timing" ${GPU_TESTS_K:+-k "$GPU_TESTS_K"} $GPU_TESTS \
          > "$OUT/tests_gpu.log" 2>&1
        summary "$OUT/tests_gpu.log"
        timing_tests tests_gpu_timing.log ${GPU_TESTS_K:+-k "$GPU_TESTS_K"} $GPU_TESTS ;;
      tests-cpu-ops)
        timeout -s INT "$(limit tests-cpu-ops 120)" $PYTEST -m "not gpu" tests/test_cfm_attention_contract.py \
          tests/test_failures.py > "$OUT/tests_cpu_ops.log" 2>&1
        summary "$OUT/tests_cpu_ops.log" ;;
      props)
        HYPOTHESIS_PROFILE=gpu timeout -s INT "$(limit props 150)" $PYTEST -m gpu tests/test_properties.py \
          tests/test_properties_model.py > "$OUT/props.log" 2>&1
        summary "$OUT/props.log"; sed -n '/property cases tried/,/^total/p' "$OUT/props.log" ;;
      memcheck)
        timeout "$(limit memcheck 180)" compute-sanitizer --tool memcheck --error-exitcode 3 \
          python3 tests/gpu_memcheck.py ${MEMCHECK_ARGS:-} > "$OUT/memcheck.log" 2>&1
        echo "memcheck exit: $?"; tail -6 "$OUT/memcheck.log" ;;
      attention)
        timeout "$(limit attention 240)" python3 bench/attention.py --dtypes fp16,fp32-tf32,bf16,fp32-ieee \
          --repeats 20 ${ATTENTION_ARGS:-} --out "$OUT" > "$OUT/attention.log" 2>&1; tail -40 "$OUT/attention.log" ;;
      sweep)
        timeout "$(limit sweep 120)" python3 bench/attention.py --sweep --sweep-repeats 20 ${SWEEP_ARGS:-} --out "$OUT" \
          > "$OUT/sweep.log" 2>&1; tail -12 "$OUT/sweep.log" ;;
      dit)
        timeout "$(limit dit 180)" python3 bench/dit_step.py --quick --out "$OUT" > "$OUT/dit.log" 2>&1
        grep -E "^(dit_step|solve)" "$OUT/dit.log" | tail -40 ;;
      dit-full)
        timeout "$(limit dit-full 1500)" python3 bench/dit_step.py ${DIT_ARGS:-} --out "$OUT" > "$OUT/dit.log" 2>&1
        grep -E "^(dit_step|solve)" "$OUT/dit.log" | tail -60 ;;
      dit-compile)
        timeout "$(limit dit-compile 300)" python3 bench/dit_step.py --shapes 8,50,400 --dtypes fp16 --no-solve \
          --variants none --providers torch_cfm,reference_graph,torch_compile_graph --out "$OUT" \
          > "$OUT/dit_compile.log" 2>&1
        grep -E "^dit_step" "$OUT/dit_compile.log" ;;
      cuda-ablation)  # every config of the CUDA attention kernel (CUDA_ABLATION_ARGS)
        timeout "$(limit cuda-ablation 150)" python3 bench/cuda_attention_ablation.py ${CUDA_ABLATION_ARGS:-} --out "$OUT" \
          > "$OUT/cuda_ablation.log" 2>&1; cat "$OUT/cuda_ablation.log" | tail -40 ;;
      sm-ingest)
        timeout "$(limit sm-ingest 300)" python3 bench/sm_ingest.py ${SM_INGEST_ARGS:-} --out "$OUT" > "$OUT/sm_ingest.log" 2>&1
        tail -40 "$OUT/sm_ingest.log" ;;
      wgmma-gemm)  # the body's wgmma + TMA GEMM against cuBLAS (WGMMA_ARGS, e.g. "--parts check,repeat")
        timeout "$(limit wgmma-gemm 300)" python3 bench/wgmma_gemm.py ${WGMMA_ARGS:-} --out "$OUT" > "$OUT/wgmma_gemm.log" 2>&1
        tail -60 "$OUT/wgmma_gemm.log" ;;
      large-batch)
        timeout "$(limit large-batch 400)" python3 bench/experiments/large_batch_probe.py \
          ${LARGE_BATCH_ARGS:---parts gemm,attn,tick} --out "$OUT/large_batch" > "$OUT/large_batch.log" 2>&1
        grep -E '^\{' "$OUT/large_batch.log" | cut -c1-400 | tail -40 ;;
      serving-tick)  # CFMServer(graphs=True) steady tick, 16 and 64 streams (old vs new: bench/compare_trees.sh)
        timeout "$(limit serving-tick 300)" python3 bench/serving_tick.py --out "$OUT" \
          ${SERVING_TICK_ARGS:-} > "$OUT/serving_tick.log" 2>&1; tail -8 "$OUT/serving_tick.log" ;;
      serving)
        timeout "$(limit serving 500)" python3 bench/serving.py --out "$OUT" ${SERVING_ARGS:---quick --ticks 40 --warmup} \
          > "$OUT/serving.log" 2>&1; grep -E "audio-s/s|Error" "$OUT/serving.log" | head -40 ;;
      stepaudio2-stream)
        timeout "$(limit stepaudio2-stream 200)" python3 bench/stepaudio2_stream.py --out "$OUT" ${STEPAUDIO2_ARGS:-} \
          > "$OUT/stepaudio2_stream.log" 2>&1; grep -A12 "^| provider" "$OUT/stepaudio2_stream.log" ;;
      graph-launch)  # host cost of the solve graphs' launch and of CFMServer.solve_chunk
        timeout "$(limit graph-launch 150)" python3 bench/graph_launch.py --out "$OUT" ${GRAPH_LAUNCH_ARGS:-} \
          > "$OUT/graph_launch.log" 2>&1
        grep "^{" "$OUT/graph_launch.log" ;;
      ncu-attention)
        NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
        if [ -z "$NCU" ]; then echo "no ncu on this machine"; continue; fi
        for d in ${NCU_DTYPES:-fp16 fp32-tf32}; do  # NCU_PROFILE_ARGS e.g. "--cuda-config 32,2,8,2" (CUDA kernel)
          timeout "$(limit ncu-attention 120)" "$NCU" --clock-control none -k regex:cfm_attention_fwd --launch-skip 3 --launch-count 1 \
            --set full --import-source yes -f -o "$OUT/ncu_attention_$d" \
            python3 bench/profile_attention.py --shape 8,50,450 --dtype $d ${NCU_PROFILE_ARGS:-} > "$OUT/ncu_run_$d.txt" 2>&1
          tail -3 "$OUT/ncu_run_$d.txt"
          "$NCU" -i "$OUT/ncu_attention_$d.ncu-rep" --page details > "$OUT/ncu_attention_${d}_details.txt" 2>&1
          "$NCU" -i "$OUT/ncu_attention_$d.ncu-rep" --page source --csv --print-source sass \
            > "$OUT/ncu_attention_${d}_sass.txt" 2>&1
          grep -E "Duration|Registers|Achieved Occupancy|Theoretical Occupancy" "$OUT/ncu_attention_${d}_details.txt" | head -8
          rm -f "$OUT/ncu_attention_$d.ncu-rep"  # the text exports come back (results.tgz); the report is large
        done ;;
      cutlass)
        timeout "$(limit cutlass 200)" python3 bench/cutlass_gemm.py --so build_cutlass/libtcfm_cutlass.so \
          ${CUTLASS_ARGS:-} --out "$OUT/cutlass" > "$OUT/cutlass.log" 2>&1; tail -45 "$OUT/cutlass.log" ;;
      vocoder)
        timeout "$(limit vocoder 240)" python3 bench/vocoder.py ${VOCODER_ARGS:-} --out "$OUT" > "$OUT/vocoder.log" 2>&1
        tail -30 "$OUT/vocoder.log" ;;
      vllm-omni)
        timeout "$(limit vllm-omni 480)" python3 bench/serving_vllm_omni.py ${VLLM_ARGS:---quick --dtypes fp16} \
          --out "$OUT" > "$OUT/vllm_omni.log" 2>&1; tail -30 "$OUT/vllm_omni.log" ;;
      minicpmo-stream)
        STEPAUDIO2_PATH=.upstream/minicpmo-utils timeout "$(limit minicpmo-stream 200)" python3 bench/minicpmo_stream.py \
          ${MINICPMO_ARGS:-} --out "$OUT" > "$OUT/minicpmo_stream.log" 2>&1; tail -20 "$OUT/minicpmo_stream.log" ;;
      compare)
        OLD_TREE=${OLD_TREE:-.old} LIMIT_EACH=${LIMIT_EACH:-240} timeout "$(limit compare 560)" bash bench/compare_trees.sh \
          > "$OUT/compare.log" 2>&1; tail -30 "$OUT/compare.log" ;;
      *) echo "unknown stage $stage" ;;
    esac
  done
  echo "== done"; date -u
} 2>&1 | tee "$OUT/run.log"
# the device tool brings back at most 8 files: logs stay loose, everything else goes in one archive
# (the archive is written outside $OUT first: tar exits 1 when its own output changes the folder)
tar czf /tmp/results.tgz -C "$OUT" --exclude='*.log' --exclude=explain.txt . 2>/dev/null
mv /tmp/results.tgz "$OUT/results.tgz"
find "$OUT" -maxdepth 1 -type f ! -name '*.log' ! -name results.tgz ! -name explain.txt -delete
