# One device call: the shared graph pool (torch_cfm/graphs.py) checked on the GPU, then the
# many-stream CFM and tokens→waveform rows at 64 streams after Token2wavServer.warmup.
export BENCH_COMMIT=${BENCH_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)} PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null; export PYTHONPATH=$PWD:/tmp/site
[ -e torch_cfm/compile_rules ] || ln -s ../compile_rules torch_cfm/compile_rules
(cd tests && TRITON_INTERPRET=1 CUDA_VISIBLE_DEVICES= timeout 40 python3 test_graphs.py --child /tmp/x.pt 2>&1 | tail -12; echo "child rc=${PIPESTATUS[0]}")
date -u; CXX=g++ CC=gcc MAX_JOBS=16 timeout 150 python3 setup.py build_ext --inplace > $OUT/build.log 2>&1; echo build rc=$?; date -u
timeout -s INT 110 python3 -m pytest -q -p no:cacheprovider -rfE -m gpu tests/test_graphs.py tests/test_server.py tests/test_warmup.py tests/test_token2wav_vocoder.py tests/test_hift_graphs.py 2>&1 | tail -25
date -u; timeout 230 python3 bench/serving.py --stages cfm,wav --providers torch_cfm --concurrency 64 --quick --warmup --dtype fp16 --out $OUT/serving 2>&1 | grep -v "warmup \[" | tail -22
date -u
