#!/usr/bin/env bash
# The GPU measurements still owed to the open issues, as device calls on one warm machine (each
# under 600 s). Carry .whl (the upstream wheels: `pip download --no-deps vllm-omni==0.30.0
# stepaudio2-minicpmo==0.1.1 -d .whl`) and .upstream (`pip install --no-deps --target
# .upstream/minicpmo-utils minicpmo-utils==1.0.7`), and .old for `causal`. Results land under $OUT.
#   bash bench/experiments/device_calls_next.sh peers     # issue 42's bars (peers64: 64 streams, patched and front;
#                        peers_bars: 16 streams, all three, then 64, patched and front;
#                        peers_memory: 16 streams, where each provider's memory is, by pool and source line)
#   bash bench/experiments/device_calls_next.sh vocoder   # issue 43: per-layer times, bench/vocoder_tiles.py
#                        (tiles: the tile sweep alone; tiles_ab: the whole decode, table against rule)
#   bash bench/experiments/device_calls_next.sh causal    # issue 40's causal vocoder, new and previous tree
#                        (causal_fused: its decode on the fused Triton convolutions, bench/experiments/causal_fused_decode.py)
#   bash bench/experiments/device_calls_next.sh encoder   # issue 43's encoder A/B
#   bash bench/experiments/device_calls_next.sh voc       # issue 43 item 3: vocoder-only rows with the upstream HiFT as peers
#   bash bench/experiments/device_calls_next.sh peers_close  # issue 42's owed rows: fp32 flow at 16 streams, 64 streams
#   bash bench/experiments/device_calls_next.sh standing  # issue 43's bars as they stand (CFM alone, waveform; 16, 64)
#   bash bench/experiments/device_calls_next.sh encprof   # issue 43: the encoder stage at 64 / 16 streams under torch.profiler
#   bash bench/experiments/device_calls_next.sh enc_ab    # issue 43: tokens -> mel / waveform against the previous tree (.old)
#                        (enc_patch: the patch ENC_PATCH applied on the device, its tests, then enc_ab)
#   bash bench/experiments/device_calls_next.sh smem      # issue 43: the convolution's window in shared memory or L1
#                        (l1: its operand copies through L1, vocoder_conv_l1.py)
#   bash bench/experiments/device_calls_next.sh rowstats  # issue 41: the CUTLASS producer epilogue's first run
#   bash bench/experiments/device_calls_next.sh conv1d    # issue 41: the convs as CUTLASS implicit-GEMM convs
#                        (carry build_conv1d: cutlass_conv1d.build('build_conv1d/libconv1d.so') on the CPU box)
#   bash bench/experiments/device_calls_next.sh overlap   # issue 43: the vocoder under the CFM on two CUDA streams
#                        (pipeline: tokens -> waveform with the vocoder one tick behind, against the front)
#   bash bench/experiments/device_calls_next.sh restore   # issue 40: a voice hit's slot write, copy_ vs copy_wide_
#   bash bench/experiments/device_calls_next.sh ncu       # issue 43: the fused convolutions under Nsight Compute
#   bash bench/experiments/device_calls_next.sh tests     # GPU tests of the vocoder and serving files
#   bash bench/experiments/device_calls_next.sh attn_rows # issue 41: cfm_attention's tiles at 32-128 rows, sweep
#                        then the steady CFM tick, rule against the sweep's best (attention_large_rows.py)
#   bash bench/experiments/device_calls_next.sh wav_fp16  # issue 43: tokens -> waveform with the vocoder's fp16 option
#                        beside the TF32 default, 16 and 64 streams, one run
#   bash bench/experiments/device_calls_next.sh plan_ab   # issue 41: the CUTLASS plan's GPU tests, then the steady
#                        CFM tick, table against named plans (plan_tick_ab.py; carry build_cutlass)
#                        (plan_sweep: the arena step, cutlass_warp_rownorm against cuBLAS at 64-256 rows;
#                        cutlass_pdl: cutlass_pdl.patch applied, the CUTLASS plan's step under PDL sets;
#                        gemm_table: every GEMM role at 32 / 64 / 128 rows, cuBLAS and each CUTLASS config;
#                        arrivals: issue 43's tick split by stage under arrivals, --arrival-stages)
#   bash bench/experiments/device_calls_next.sh stream    # issue 40's one minicpmo-utils stream alone
#                        (causal_serving: tokens -> waveform, minicpmo-utils' causal vocoder, 16 and 64 streams)
#   bash bench/experiments/device_calls_next.sh voices    # issue 40's voice-cache bars (4 voices, arrivals)
#                        (voices_ab: CFM alone at 64 streams with the cache, this tree against .old)
#   bash bench/experiments/device_calls_next.sh free_frames  # issue 41: free_frame_arena.patch applied, its
#                        extension and tests (free_frames_ab: the steady CFM tick against the tree before, one call)
#   bash bench/experiments/device_calls_next.sh v5a       # issue 41: the fused attention kernel's arena form
#                        (GPU tests, then the arena step against the table's arena plan at 32-128 rows;
#                        v5a_ab: the A/B alone)
#   bash bench/experiments/device_calls_next.sh cutlass   # issue 41: the GEMM library's GPU tests, fc1's
#                        GELU epilogue against the previous library (carry build_cutlass, build_cutlass_prev)
# Modes run in the order given: `... tests stream` in one call. The device returns at most 8 files
# from $OUT: a call of many modes loses the rest (name few modes, or copy what matters to stdout). Pass BENCH_COMMIT as a literal hash
# computed here: a `git rev-parse` in the device command reads a stale .git there (rows got 0c1aac8).
set -u
OUT=${OUT:-$PWD/device_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 BENCH_COMMIT=${BENCH_COMMIT:-unknown}
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=$PWD:/tmp/site
[ -e torch_cfm/compile_rules ] || ln -s ../compile_rules torch_cfm/compile_rules
# A fresh machine: the CPU extension first (the package imports it), then the CUDA one in the
# background into its own folder, copied in when done; modes that time dispatch wait for it, tests of
# Triton kernels run meanwhile (their processes start without _C_cuda and take the Triton paths).
if ! ls torch_cfm/_C.*so > /dev/null 2>&1; then
  TORCH_CFM_BUILD_CUDA=0 CXX=g++ CC=gcc MAX_JOBS=16 timeout 150 python3 setup.py build_ext --inplace > "$OUT/build_cpu.log" 2>&1
  echo "build _C rc=$?"
fi
# NO_CUDA_EXT=1: no CUDA extension (the Triton paths everywhere; saves the ~65 s build on a short budget)
if [ -z "${NO_CUDA_EXT:-}" ] && ! ls torch_cfm/_C_cuda*.so > /dev/null 2>&1; then
  (CXX=g++ CC=gcc MAX_JOBS=16 timeout 200 python3 setup.py build_ext --build-lib /tmp/cudabuild > "$OUT/build.log" 2>&1
   cp /tmp/cudabuild/torch_cfm/_C_cuda*.so torch_cfm/ && echo "build _C_cuda done at ${SECONDS}s") &
  CUDA_BUILD=$!
fi
need_cuda() { [ -n "${CUDA_BUILD:-}" ] && { wait "$CUDA_BUILD"; CUDA_BUILD=; }; ls torch_cfm/_C_cuda*.so > /dev/null 2>&1 || echo "(no _C_cuda: Triton paths)"; }
MINI=.upstream/minicpmo-utils
[ $# -gt 0 ] || { echo "usage: $0 MODE... (free_frames, free_frames_ab, conv1d, arrivals, gemm_table, cutlass_pdl, plan_sweep, wav_fp16, plan_ab, attn_rows, smem, l1, overlap, pipeline, standing, encprof, enc_patch, enc_ab, voices_ab, rowstats, restore, ncu, voc, peers_close, peers, peers64, peers_bars, peers_memory, vocoder, tiles, tiles_ab, causal, causal_fused, encoder, voices, tests, stream, causal_serving, cutlass, v5a, v5a_ab)" >&2; exit 2; }
for mode in "$@"; do
echo "== $mode (${SECONDS}s)"
case $mode in tests|cutlass|restore|ncu|rowstats|enc_patch|smem) ;; *) need_cuda ;; esac
case $mode in
  peers)  # issue 42: BatchedToken2Wav vs the plugin vs the front (one voice, then four)
    timeout 290 python3 bench/serving_vllm_omni.py --quick --dtypes fp16 --out "$OUT" > "$OUT/vllm_omni.log" 2>&1
    grep -v "warmup \[" "$OUT/vllm_omni.log" | tail -16 ;;
  peers_bars)  # issue 42's bars alone: all three at 16 streams, then the plugin and the front at 64
    timeout 200 python3 bench/serving_vllm_omni.py --quick --dtypes fp16 --concurrency 16 --out "$OUT" \
      > "$OUT/vllm_omni16.log" 2>&1; grep -v "warmup \[" "$OUT/vllm_omni16.log" | tail -6
    timeout 330 python3 bench/serving_vllm_omni.py --quick --dtypes fp16 --concurrency 64 \
      --providers vllm_omni/torch_cfm,torch_cfm --out "$OUT" > "$OUT/vllm_omni64.log" 2>&1
    grep -v "warmup \[" "$OUT/vllm_omni64.log" | tail -6 ;;
  peers_memory)  # issue 42's memory bar: 16 streams, all three, each allocation's stack recorded (bench/_memory.py)
    timeout 260 python3 bench/serving_vllm_omni.py --quick --dtypes fp16 --concurrency 16 --memory-attribution \
      --out "$OUT/memory" > "$OUT/vllm_omni_memory.log" 2>&1
    grep -E "MiB|C= 16" "$OUT/vllm_omni_memory.log" | grep -v "warm-up" | head -60 ;;
  peers64)  # issue 42's "64 streams on an 80 GB card": the plugin and the front alone (unpatched runs out of memory)
    timeout 400 python3 bench/serving_vllm_omni.py --quick --dtypes fp16 --concurrency 64 \
      --providers vllm_omni/torch_cfm,torch_cfm --out "$OUT" > "$OUT/vllm_omni64.log" 2>&1
    grep -v "warmup \[" "$OUT/vllm_omni64.log" | tail -8 ;;
  vocoder|tiles)  # where the 64-stream decode goes per layer (vocoder only), then the tile sweep per table key
    if [ $mode = vocoder ]; then
      timeout 150 python3 bench/experiments/vocoder_profile.py --streams 64 --layers --out "$OUT" > "$OUT/layers.log" 2>&1
      grep -E "ms|layer" "$OUT/layers.log" | head -40
    fi
    timeout ${TILES_TIMEOUT:-380} python3 bench/vocoder_tiles.py --quick --families ${TILES_FAMILIES:-tf32,fp16} \
      --out "$OUT/vocoder_tiles" > "$OUT/vocoder_tiles.log" 2>&1; grep -vE "^compile " "$OUT/vocoder_tiles.log" | tail -45 ;;
  tiles_ab)  # issue 43: the tile table against the rule over whole decodes, one process; after `tiles` in the
    # same call, also the table its sweep makes (vocoder_table_ab.py --candidate)
    cand=; [ -f "$OUT/vocoder_tiles/vocoder_tiles.json" ] && cand="--candidate $OUT/vocoder_tiles/vocoder_tiles.json"
    timeout ${AB_TIMEOUT:-200} python3 bench/experiments/vocoder_table_ab.py --streams ${AB_STREAMS:-16,64} $cand \
      --out "$OUT" > "$OUT/vocoder_table_ab.log" 2>&1; tail -6 "$OUT/vocoder_table_ab.log" ;;
  causal)  # issue 40: the causal vocoder's steady chunk (batch 1 / 16 / 64, kernels), on the previous
    # landing's tree too when .old holds it (`git archive 6212185 | tar -x -C .old`: one decoder pass per block)
    if [ -d .old/torch_cfm ]; then
      [ -e .old/torch_cfm/compile_rules ] || ln -s ../compile_rules .old/torch_cfm/compile_rules
      ls .old/torch_cfm/_C*.so > /dev/null 2>&1 || (cd .old && CXX=g++ CC=gcc MAX_JOBS=16 timeout 150 \
        python3 setup.py build_ext --inplace > "$OUT/build_old.log" 2>&1)
      STEPAUDIO2_PATH=$MINI timeout 80 python3 bench/experiments/causal_vocoder_profile.py --repo .old \
        --out "$OUT/old" > "$OUT/causal_old.log" 2>&1; grep -E "from|'ms'" "$OUT/causal_old.log"
    fi
    STEPAUDIO2_PATH=$MINI timeout 80 python3 bench/experiments/causal_vocoder_profile.py --out "$OUT" \
      > "$OUT/causal.log" 2>&1; tail -30 "$OUT/causal.log" ;;
  causal_fused)  # issue 40: the causal decode on the fused Triton convolutions against today's (B = 1, 16, 64)
    STEPAUDIO2_PATH=$MINI timeout 200 python3 bench/experiments/causal_fused_decode.py --out "$OUT" \
      > "$OUT/causal_fused.log" 2>&1; tail -10 "$OUT/causal_fused.log" ;;
  encoder)  # issue 43 item 2: the encoder's ragged batching against equal-shape groups and per stream
    timeout 400 python3 bench/serving.py --stages mel --concurrency 16,64 --quick --warmup --dtype fp16 \
      --providers torch_cfm,torch_cfm/enc_ragged,torch_cfm/enc_per_stream --out "$OUT" > "$OUT/encoder.log" 2>&1
    tail -12 "$OUT/encoder.log" ;;
  voices)  # 4 voices, Poisson arrivals: CFM alone and tokens -> waveform at 16 and 64 streams, the front
    # with and without its voice-prompt cache in the same run (bars: arrivals >= 0.9 x steady,
    # first chunk p50 <= 1.5 x step p50, an open that hits <= 1 ms of GPU time)
    timeout ${VOICES_TIMEOUT:-560} python3 bench/serving.py --stages cfm,wav --concurrency ${VOICES_AT:-16,64} --quick --warmup --dtype fp16 \
      --voices 4 --providers torch_cfm,torch_cfm/voices --out "$OUT" > "$OUT/voices.log" 2>&1
    grep -v "warmup \[" "$OUT/voices.log" | tail -14 ;;
  v5a|v5a_ab)  # fused_attention_warp_rownorm on the arena: its GPU tests (v5a only), then the A/B in one run
    if [ $mode = v5a ]; then
      timeout -s INT 150 python3 -m pytest -q -p no:cacheprovider -rfE -m gpu tests/test_dit_attention_arena.py \
        tests/test_dit_body.py -k "arena" > "$OUT/test_v5a.log" 2>&1
      echo "v5a tests: $(grep -E 'passed|failed|error' "$OUT/test_v5a.log" | tail -1)"
    fi
    timeout 300 python3 bench/dit_step.py --no-solve --no-steps --sweep --sweep-variants arena_attention \
      --sweep-rounds 3 --shapes "32,50,400;64,50,400;128,50,400" --dtypes fp16,bf16 --out "$OUT/v5a" \
      > "$OUT/v5a.log" 2>&1; grep -E "arena_attention" "$OUT/v5a.log" | tail -12 ;;
  cutlass)  # the library's GPU tests, then qkv / fc1 / fc1_bias on it and on the previous build, one call
    TORCH_CFM_CUTLASS_SO=$PWD/build_cutlass/libtcfm_cutlass.so timeout -s INT 120 python3 -m pytest -q \
      -p no:cacheprovider -rfE -m gpu tests/test_cutlass_gemm.py > "$OUT/test_cutlass_gemm.log" 2>&1
    echo "test_cutlass_gemm: $(grep -E 'passed|failed|error' "$OUT/test_cutlass_gemm.log" | tail -1)"
    for lib in build_cutlass build_cutlass_prev; do
      [ -f $lib/libtcfm_cutlass.so ] || continue
      timeout 150 python3 bench/cutlass_gemm.py --so $lib/libtcfm_cutlass.so --quick --roles qkv,fc1,fc1_bias \
        --out "$OUT/$lib" > "$OUT/$lib.log" 2>&1; grep -E "fc1|qkv" "$OUT/$lib/cutlass_gemm.md" | head -8
    done ;;
  causal_serving)  # issue 40 / 43: tokens -> waveform through minicpmo-utils' causal vocoder at 16 and 64 streams
    timeout ${CAUSAL_TIMEOUT:-400} python3 bench/serving.py --stages cfm,wav --vocoder causal --concurrency 16,64 --quick \
      --warmup --dtype fp16 --providers torch_cfm --out "$OUT" > "$OUT/causal_serving.log" 2>&1
    grep -v "warmup \[" "$OUT/causal_serving.log" | grep -E "^\| r|C= " | tail -8 ;;
  stream)  # issue 40's one minicpmo-utils stream alone (waveform chunk <= 15 ms, no capture while timed)
    STEPAUDIO2_PATH=$MINI timeout 200 python3 bench/minicpmo_stream.py --out "$OUT" > "$OUT/minicpmo_stream.log" 2>&1
    grep -E "^\||captures|bar" "$OUT/minicpmo_stream.log" | tail -10 ;;
  voc)  # issue 43 item 3: the vocoder stage alone at 16 and 64 streams, the upstream HiFT batched per tick as peers
    timeout ${VOC_TIMEOUT:-300} python3 bench/serving.py --stages voc --concurrency 16,64 --quick --warmup \
      --providers torch_cfm,upstream_tf32,upstream_ieee --out "$OUT" > "$OUT/voc.log" 2>&1
    grep -v "warmup \[" "$OUT/voc.log" | grep -E "^\| r|C= " | tail -8 ;;
  standing)  # issue 43's bars as they stand: CFM alone and tokens -> waveform at 16 and 64 streams, one run
    timeout ${STANDING_TIMEOUT:-330} python3 bench/serving.py --stages ${STANDING_STAGES:-cfm,wav} \
      --concurrency ${STANDING_C:-16,64} --quick --warmup \
      --dtype fp16 --providers torch_cfm --out "$OUT" > "$OUT/standing.log" 2>&1
    grep -E "^\| r[0-9]" "$OUT/serving.md" | grep -E "\| (cfm|wav) \|" | cut -d'|' -f5,7-9,12,18,20 ;;
  peers_close)  # issue 42's last rows: the shipped fp32 flow at 16 streams (all three), then 64 streams (fp16, plugin and front)
    timeout 200 python3 bench/serving_vllm_omni.py --quick --dtypes fp32 --concurrency 16 --out "$OUT" \
      > "$OUT/vllm_omni_fp32.log" 2>&1; grep -E "C= 16|bar" "$OUT/vllm_omni_fp32.log" | tail -4
    timeout 330 python3 bench/serving_vllm_omni.py --quick --dtypes fp16 --concurrency 64 \
      --providers vllm_omni/torch_cfm,torch_cfm --out "$OUT" > "$OUT/vllm_omni64.log" 2>&1
    grep -E "C= 64|bar" "$OUT/vllm_omni64.log" | tail -4 ;;
  encprof)  # issue 43 item 2: where the encoder stage's time goes at 16 and 64 streams (torch.profiler)
    for c in ${ENC_STREAMS:-64 16}; do
      timeout 200 python3 bench/experiments/encoder_profile.py --streams $c --out "$OUT" > "$OUT/encprof_$c.log" 2>&1
      grep -vE "warmup \[" "$OUT/encprof_$c.log" | tail -60
    done ;;
  enc_patch)  # issue 43 item 2: a parked encoder patch (ENC_PATCH, a path in this tree) applied here,
    # this tree copied to .old first; its tests (ENC_TESTS, whole files; ENC_PYTEST_ARGS="-m gpu" for the GPU
    # ones), then enc_ab (waveform at 64 streams) against .old
    rm -rf .old && mkdir .old && cp -r torch_cfm compile_rules bench tests csrc setup.py pyproject.toml .old/
    rm -f .old/torch_cfm/compile_rules && ln -s ../compile_rules .old/torch_cfm/compile_rules
    [ -n "${ENC_PATCH:-}" ] || { echo "enc_patch: set ENC_PATCH to the patch to apply"; exit 2; }
    git apply "$ENC_PATCH" 2>/dev/null || patch -p1 -s < "$ENC_PATCH" || { echo "the patch does not apply"; exit 1; }
    for f in ${ENC_TESTS:-test_stepaudio2_server test_minicpmo_server test_conformer_attention test_vllm_omni}; do
      timeout -s INT ${TEST_TIMEOUT:-150} python3 -m pytest -q -p no:cacheprovider -rfE ${ENC_PYTEST_ARGS:-} \
        "tests/$f.py" > "$OUT/$f.log" 2>&1
      echo "$f: $(grep -E 'passed|failed|error' "$OUT/$f.log" | tail -1)"; grep -E "^(FAILED|ERROR)" "$OUT/$f.log" | head -5
    done
    need_cuda; ENC_AB_STAGES=${ENC_AB_STAGES:-wav} bash "$0" enc_ab ;;
  free_frames)  # issue 41 item 4: free_frame_arena.patch. This tree (with its CUDA extension) copied to .old,
    # the patch applied, the extension rebuilt (the patch changes the QKV epilogue's arguments), the GPU and
    # the arena's CPU tests; then `free_frames_ab` (the steady CFM tick, .old against the patched tree)
    rm -rf .old && mkdir .old && cp -r torch_cfm compile_rules bench tests csrc setup.py pyproject.toml .old/
    rm -f .old/torch_cfm/compile_rules && ln -s ../compile_rules .old/torch_cfm/compile_rules
    git apply bench/experiments/free_frame_arena.patch 2>/dev/null || patch -p1 -s < bench/experiments/free_frame_arena.patch \
      || { echo "the patch does not apply"; exit 1; }
    rm -f torch_cfm/_C_cuda*.so
    CXX=g++ CC=gcc MAX_JOBS=16 timeout 200 python3 setup.py build_ext --build-lib /tmp/cudabuild > "$OUT/build_ff.log" 2>&1
    cp /tmp/cudabuild/torch_cfm/_C_cuda*.so torch_cfm/ && echo "patched _C_cuda built at ${SECONDS}s" \
      || { tail -20 "$OUT/build_ff.log"; exit 1; }
    # the GPU tests (the CPU ones passed where the patch was made), and the free-frame driver whole
    for f in test_arena_frames test_cache_trim test_dit_linear_cuda test_dit_body test_graphs test_server \
             test_stepaudio2_server test_minicpmo_server; do
      sel="-m gpu"; [ $f = test_arena_frames ] && sel=""
      timeout -s INT ${TEST_TIMEOUT:-150} python3 -m pytest -q -p no:cacheprovider -rfE $sel "tests/$f.py" > "$OUT/$f.log" 2>&1
      echo "$f: $(grep -E 'passed|failed|error' "$OUT/$f.log" | tail -1)"; grep -E "^(FAILED|ERROR)" "$OUT/$f.log" | head -5
      rm -f "$OUT/$f.log"
    done
    if [ "${FF_MEMCHECK:-1}" = 1 ]; then  # the append tables, pre-moves and compactions under compute-sanitizer
      timeout 180 compute-sanitizer --tool memcheck --error-exitcode 3 python3 tests/gpu_memcheck.py --quick \
        > "$OUT/memcheck.log" 2>&1; echo "memcheck exit: $?"; tail -3 "$OUT/memcheck.log"; rm -f "$OUT/memcheck.log"
    fi ;;
  free_frames_ab)  # after free_frames on the same machine: CFM alone at FF_C streams, .old (its own extension) then
    # the patched tree, the steady tick and audio-s/s of each. A later call gets this tree afresh (the patched
    # extension kept as a build output): the patch is applied again where it is not
    [ -d .old ] || { echo "free_frames_ab: run free_frames first (no .old)"; exit 2; }
    git apply --check bench/experiments/free_frame_arena.patch 2>/dev/null && git apply bench/experiments/free_frame_arena.patch
    ENC_AB_OLD_SO=keep ENC_AB_STAGES=cfm ENC_AB_C=${FF_C:-16,64} bash "$0" enc_ab ;;
  enc_ab)  # issue 43 item 2: this tree against the previous one (carry .old), tokens -> mel / waveform, one call
    # (ENC_AB_OLD_SO=keep: .old keeps the extension it has, built from its own sources)
    [ -n "${ENC_AB_OLD_SO:-}" ] || cp torch_cfm/_C*.so .old/torch_cfm/
    [ -e .old/torch_cfm/compile_rules ] || ln -s ../compile_rules .old/torch_cfm/compile_rules
    for side in ${ENC_AB_SIDES:-old new}; do
      dir=$PWD; [ $side = old ] && dir=$PWD/.old
      (cd "$dir" && PYTHONPATH=$dir:/tmp/site timeout ${ENC_AB_TIMEOUT:-200} python3 bench/serving.py \
        --stages ${ENC_AB_STAGES:-mel,wav} --providers torch_cfm --concurrency ${ENC_AB_C:-64} --quick --warmup \
        --dtype fp16 --out /tmp/enc_ab_$side > "$OUT/enc_ab_$side.log" 2>&1)
      cp /tmp/enc_ab_$side/serving.jsonl "$OUT/enc_ab_$side.jsonl"
      echo "-- $side"; grep -E "^\| r[0-9]" /tmp/enc_ab_$side/serving.md | cut -d'|' -f5,7-9,12,18,20
    done ;;
  overlap)  # issue 43: the vocoder's tick issued on a second CUDA stream under the CFM's (stage_overlap.py)
    timeout ${OVERLAP_TIMEOUT:-300} python3 bench/experiments/stage_overlap.py --streams ${OVERLAP_C:-16,64} --out "$OUT" \
      > "$OUT/overlap.log" 2>&1; grep -E "hidden|Error" "$OUT/overlap.log" | tail -4 ;;
  pipeline)  # issue 43: tokens -> waveform with the vocoder one tick behind on a second CUDA stream, against the
    # sequential front, one process (bench/experiments/pipelined_vocoder.py)
    need_cuda
    timeout ${PIPE_TIMEOUT:-300} python3 bench/experiments/pipelined_vocoder.py --stages wav --concurrency ${PIPE_C:-64} \
      --quick --warmup --dtype fp16 --providers torch_cfm,torch_cfm/pipelined --out /tmp/pipe > "$OUT/pipeline.log" 2>&1
    cp /tmp/pipe/serving.jsonl "$OUT/pipeline.jsonl"; grep -E "Error|audio-s/s" "$OUT/pipeline.log" | grep -v warmup | tail -6
    grep -E "^\| r[0-9]" /tmp/pipe/serving.md | cut -d'|' -f5,7-9,12,18,20 ;;
  wav_fp16)  # issue 43: the front with vocoder_precision="fp16" beside the default (TF32 vocoder), one run
    timeout ${WAV_TIMEOUT:-400} python3 bench/serving.py --stages wav --concurrency ${WAV_C:-16,64} --quick --warmup \
      --dtype fp16 --providers torch_cfm,torch_cfm/voc_fp16 --out "$OUT" > "$OUT/wav_fp16.log" 2>&1
    grep -E "^\| r[0-9]" "$OUT/serving.md" | cut -d'|' -f5-9,12,18,20 ;;
  plan_ab)  # issue 41: the CUTLASS body plan's GPU tests, then the steady tick at 16 / 32 / 64 streams against the table
    export TORCH_CFM_CUTLASS_SO=${TORCH_CFM_CUTLASS_SO:-$PWD/build_cutlass/libtcfm_cutlass.so}
    timeout -s INT ${TEST_TIMEOUT:-150} python3 -m pytest -q -p no:cacheprovider -rfE -m gpu tests/test_cutlass_gemm.py \
      tests/test_dit_body.py -k "cutlass or arena_plans" > "$OUT/test_plan_ab.log" 2>&1
    echo "plan tests: $(grep -E 'passed|failed|error' "$OUT/test_plan_ab.log" | tail -1)"
    grep -E "^(FAILED|ERROR)" "$OUT/test_plan_ab.log" | head -5
    timeout ${PLAN_TIMEOUT:-300} python3 bench/experiments/plan_tick_ab.py --streams ${PLAN_STREAMS:-16,32,64} \
      --out "$OUT" > "$OUT/plan_ab.log" 2>&1; echo "rc=$?"; grep -vE "warmup" "$OUT/plan_ab.log" | tail -8 ;;
  plan_sweep)  # issue 41: the arena step on the table's plan and on cutlass_warp_rownorm at 64-256 rows (the table's evidence)
    export TORCH_CFM_CUTLASS_SO=${TORCH_CFM_CUTLASS_SO:-$PWD/build_cutlass/libtcfm_cutlass.so}
    timeout ${SWEEP_TIMEOUT:-300} python3 bench/dit_step.py --no-solve --no-steps --sweep --sweep-variants cutlass \
      --sweep-rounds 3 --shapes "${SWEEP_SHAPES:-64,50,400;128,50,400;256,50,400}" --dtypes fp16,bf16 --out "$OUT/plan_sweep" \
      > "$OUT/plan_sweep.log" 2>&1; echo "rc=$?"; grep -E "^sweep" "$OUT/plan_sweep.log" | tail -12 ;;
  cutlass_pdl)  # issue 41: cutlass_pdl.patch applied (the CUTLASS GEMMs launched under the plan's "linear" PDL), its
    # GPU test, then the arena step of cutlass_warp_rownorm under PDL sets at 128 / 256 rows (dit_step sweep cutlass_pdl)
    export TORCH_CFM_CUTLASS_SO=${TORCH_CFM_CUTLASS_SO:-$PWD/build_cutlass/libtcfm_cutlass.so}
    git apply bench/experiments/cutlass_pdl.patch 2>/dev/null || patch -p1 -s -N < bench/experiments/cutlass_pdl.patch \
      || echo "cutlass_pdl.patch does not apply (already applied?)"
    timeout -s INT 150 python3 -m pytest -q -p no:cacheprovider -rfE -m gpu tests/test_dit_body.py -k cutlass \
      > "$OUT/test_cutlass_pdl.log" 2>&1
    echo "cutlass_pdl tests: $(grep -E 'passed|failed|error' "$OUT/test_cutlass_pdl.log" | tail -1)"
    grep -E "^(FAILED|ERROR)" "$OUT/test_cutlass_pdl.log" | head -5
    timeout ${SWEEP_TIMEOUT:-300} python3 bench/dit_step.py --no-solve --no-steps --sweep --sweep-variants cutlass_pdl \
      --sweep-rounds 3 --shapes "${SWEEP_SHAPES:-128,50,400;256,50,400}" --dtypes ${SWEEP_DTYPES:-fp16,bf16} \
      --out "$OUT/cutlass_pdl" > "$OUT/cutlass_pdl.log" 2>&1; echo "rc=$?"; grep -E "^sweep" "$OUT/cutlass_pdl.log" | tail -20 ;;
  arrivals)  # issue 43: where a steady tick goes under arrivals (bench/serving.py --arrival-stages): per-stage ms
    # per tick with the cache-length mix arrivals make, and the step's time outside the three stages
    timeout ${ARR_TIMEOUT:-450} python3 bench/serving.py --stages ${ARR_STAGES:-wav} --concurrency ${ARR_C:-16,64} --quick \
      --warmup --dtype fp16 --providers torch_cfm --arrival-stages --out "$OUT" > "$OUT/arrivals.log" 2>&1; echo "rc=$?"
    python3 -c "import json,sys; [print(r['stage'], r['concurrency'], r['steady_audio_s_per_s'], r['step_ms_mean'],
      {k: v for k, v in r.items() if k.startswith(('ms_', 'arrival_'))}) for r in map(json.loads, open(sys.argv[1]))]" \
      "$OUT/serving.jsonl" ;;
  gemm_table)  # issue 41's GEMM bar: every role at 32 / 64 / 128 rows, cuBLAS and every CUTLASS config, % of peak, one run
    timeout ${GEMM_TIMEOUT:-400} python3 bench/cutlass_gemm.py --so $PWD/build_cutlass/libtcfm_cutlass.so \
      --dtypes ${GEMM_DTYPES:-fp16} --rows 32,64,128 --out "$OUT/gemm_table" > "$OUT/gemm_table.log" 2>&1
    echo "rc=$?"; grep -E "^\| (qkv|proj|conv|fc1|fc1_bias|fc2) " "$OUT/gemm_table/cutlass_gemm.md" | cut -d'|' -f2-7 ;;
  attn_rows)  # issue 41: the attention sweep at the server's large batches, then the whole tick A/B
    timeout ${ATTN_TIMEOUT:-330} python3 bench/experiments/attention_large_rows.py --streams ${ATTN_STREAMS:-16,32,64} \
      --out "$OUT" > "$OUT/attn_rows.log" 2>&1; echo "rc=$?"; grep -vE "warmup|^  " "$OUT/attn_rows.log" | tail -20 ;;
  l1)  # issue 43: the convolution's operand copies through L1 (8-byte cp.async.ca), per key and whole decode
    timeout ${L1_TIMEOUT:-300} python3 bench/experiments/vocoder_conv_l1.py --families ${L1_FAMILIES:-tf32} \
      --out "$OUT" > "$OUT/l1.log" 2>&1; echo "rc=$?"; grep -E "decode|x(6|12) " "$OUT/l1.log" | tail -40 ;;
  smem)  # issue 43: the convolution with its input window in shared memory (Gluon) or L1 (vocoder_conv_smem.py)
    # carry build_convw (libconvw.so built here, else nvcc builds it there)
    lib=; [ -f build_convw/libconvw.so ] && lib="--lib build_convw/libconvw.so"
    timeout ${SMEM_TIMEOUT:-300} python3 bench/experiments/vocoder_conv_smem.py ${SMEM_ARGS:---quick} $lib --out "$OUT" \
      > "$OUT/smem.log" 2>&1; echo "rc=$?"; grep -E "^C=|Error" "$OUT/smem.log" | tail -40 ;;
  conv1d)  # issue 41: the block's convs as CUTLASS implicit-GEMM convs against the shipped GEMM + TAPS row-norm
    # (cutlass_conv1d.py); carry build_conv1d (the .so built on the CPU box: the device cannot fetch the headers)
    lib=; [ -f build_conv1d/libconv1d.so ] && lib="--lib build_conv1d/libconv1d.so"
    timeout 300 python3 bench/experiments/cutlass_conv1d.py $lib --out "$OUT" > "$OUT/conv1d.log" 2>&1
    tail -8 "$OUT/conv1d.log" | cut -c1-2000 ;;
  rowstats)  # issue 41: the producer epilogue (GEMM + gated residual + centred row sums) against float64 and the unfused path
    # carry build_rowstats (the .so built here: the device cannot fetch the CUTLASS headers)
    lib=; [ -f build_rowstats/librowstats.so ] && lib="--lib build_rowstats/librowstats.so"
    timeout 300 python3 bench/experiments/cutlass_residual_rowstats.py $lib --out "$OUT" > "$OUT/rowstats.log" 2>&1
    tail -12 "$OUT/rowstats.log" ;;
  voices_ab)  # issue 40: CFM alone, 4 voices, arrivals at 64 streams, with the voice cache: this tree against .old
    # (a checkout of the commit before CFMServer.open_voices), one call; the bar is arrivals >= 0.9 x steady
    cp torch_cfm/_C*.so .old/torch_cfm/; [ -e .old/torch_cfm/compile_rules ] || ln -s ../compile_rules .old/torch_cfm/compile_rules
    for side in old new; do
      dir=$PWD; [ $side = old ] && dir=$PWD/.old
      (cd "$dir" && PYTHONPATH=$dir:/tmp/site timeout ${VOICES_TIMEOUT:-200} python3 bench/serving.py --stages cfm \
        --concurrency ${VOICES_AT:-64} --quick --warmup --dtype fp16 --voices 4 --providers torch_cfm/voices \
        --out /tmp/voices_ab_$side > "$OUT/voices_ab_$side.log" 2>&1)
      cp /tmp/voices_ab_$side/serving.jsonl "$OUT/voices_ab_$side.jsonl"
      echo "-- $side"; grep -E "^\| r[0-9]" /tmp/voices_ab_$side/serving.md | cut -d'|' -f6-9,14,16,21
    done ;;
  restore)  # issue 40: a voice-cache hit's slot write, PyTorch's strided copy against copy_wide_ (one run)
    timeout 120 python3 bench/experiments/voice_restore_copy.py --out "$OUT" > "$OUT/restore.log" 2>&1
    tail -3 "$OUT/restore.log" ;;
  ncu)  # issue 43: one 64-stream decode's fused convolutions under Nsight Compute, TF32 then fp16
    NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
    for prec in tf32 fp16; do
      timeout ${NCU_TIMEOUT:-150} "$NCU" --clock-control none --profile-from-start off -k regex:vocoder_conv \
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
        --section WarpStateStats --section Occupancy --section LaunchStats -f -o "$OUT/ncu_$prec" \
        python3 bench/experiments/vocoder_conv_ncu.py --precision $prec > "$OUT/ncu_$prec.log" 2>&1
      "$NCU" --import "$OUT/ncu_$prec.ncu-rep" --csv --page details > "$OUT/ncu_$prec.csv" 2>> "$OUT/ncu_$prec.log"
      rm -f "$OUT/ncu_$prec.ncu-rep"; tail -2 "$OUT/ncu_$prec.log"; wc -l "$OUT/ncu_$prec.csv"
    done
    python3 bench/experiments/vocoder_conv_ncu.py --summarize "$OUT"/ncu_*.csv > "$OUT/vocoder_conv_ncu.md"
    grep -E "merge|launches" "$OUT/vocoder_conv_ncu.md" ;;
  tests)  # one result line per file (TESTS: a subset, e.g. "test_minicpmo_utils test_vocoder_hift";
    # TEST_TIMEOUT per file, default 150 s: test_vocoder_hift's torch.compile test alone takes ~60 s)
    for f in ${TESTS:-test_vocoder_conv test_vocoder_hift test_hift_graphs test_server test_graphs test_warmup \
             test_vllm_omni test_minicpmo_server test_minicpmo_utils test_prompt_pacing}; do
      case $f in test_vocoder_hift|test_vocoder_conv|test_vocoder_elementwise|test_dit_attention_arena) ;; *) need_cuda ;; esac
      timeout -s INT ${TEST_TIMEOUT:-150} python3 -m pytest -q -p no:cacheprovider -rfE -m gpu "tests/$f.py" > "$OUT/$f.log" 2>&1
      echo "$f: $(grep -E 'passed|failed|error' "$OUT/$f.log" | tail -1)"; grep -E "^(FAILED|ERROR)" "$OUT/$f.log" | head -5
    done ;;
  *) echo "unknown mode $mode" >&2; exit 2 ;;
esac
done
