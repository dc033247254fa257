# One device call: GPU tests of the serving/graph/vocoder files (the review mends), the minicpmo-utils
# GPU tests, a vocoder profile at 16/64 streams, the minicpmo-utils one-stream bench (#40 bar).
export BENCH_COMMIT=${BENCH_COMMIT:-unknown} PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=$PWD:/tmp/site
[ -e torch_cfm/compile_rules ] || ln -s ../compile_rules torch_cfm/compile_rules
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
date -u; CXX=g++ CC=gcc MAX_JOBS=16 timeout 150 python3 setup.py build_ext --inplace > $OUT/build.log 2>&1; echo build rc=$?; date -u
timeout 100 python3 bench/experiments/vocoder_profile.py --out $OUT 2>&1 | grep -v Warning | tail -45
date -u
timeout -s INT 170 python3 -m pytest -q -p no:cacheprovider -rfE -m gpu tests/test_graphs.py tests/test_server.py tests/test_warmup.py tests/test_token2wav_vocoder.py tests/test_hift_graphs.py tests/test_vocoder_hift.py tests/test_vocoder_conv.py tests/test_minicpmo_utils.py tests/test_minicpmo_server.py tests/test_prompt_pacing.py 2>&1 | tail -25
date -u
STEPAUDIO2_PATH=.upstream/minicpmo-utils timeout 150 python3 bench/minicpmo_stream.py --out $OUT > $OUT/minicpmo_stream.log 2>&1; tail -15 $OUT/minicpmo_stream.log
date -u
