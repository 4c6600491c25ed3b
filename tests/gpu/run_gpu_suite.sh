#!/usr/bin/env bash
# One run on a GPU machine: print the stack, run the GPU tests and the chosen benchmarks.
# Usage (repo root, with the cuda and test extras installed): bash tests/gpu/run_gpu_suite.sh [pytest args...]
# Logs go to the folder $OUT names (default ./out).
# Switches (environment): SKIP_TESTS=1, PART=1/2 (one GPU: every second test file from the first on, the op
# suite's cuda targets in the last part only; the whole suite takes more than one 600 s call on one H200),
# WORKERS=8 (pytest-xdist), TEST_TIMEOUT=300 (per test), SKIP_BENCH=1 (gpu_ops), MODELS=sd,convnext,wan (gpu_models),
# COMPILE=1 (gpu_models with torch.compile),
# STREAM=1 (Wan streaming), BREAKDOWN=1 (stage times of one graphed forward), FIRSTCALL=1 (profile of a new
# shape's first call), SERVICE=1|sd|enc (service vs raw: SD-VAE decode in every format, ConvNeXt encode one image a request, raw-socket clients unless ENC_CLIENT=httpx; SERVICE_ARGS
# e.g. '--workers 6 --devices 0,1'), COLD=1 (cold vs warm start),
# WANSVC=1 (Wan through the service vs raw), MULTI='0;0,1;0,1,2,3' (SD-VAE decode over 1, 2, 4 GPUs),
# AB=1 (ConvNeXt fusion switches on/off, benchmarks/gpu/convnext_fusion_ab.py), FIRSTCHUNK=1 (where a streamed
# Wan decode's first frame group spends its time, benchmarks/gpu/wan_first_chunk.py), FAMILIES=taesd,flux2,qwen,wan22
# (benchmarks/gpu/gpu_families.py), FAMILIES26=all or hv15,ltx2,dcae,hyimage,qwen21 (the five newest families,
# benchmarks/gpu/gpu_families_2026.py; FAMILIES26_ARGS e.g. '--tiny'), SHARDED='--size 4096 --gpus 1,2,4'
# (benchmarks/gpu/sharded_decode.py).
set -o pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
# a machine without network: wheels placed in .whl/ (git-ignored) are installed aside first
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PYTHONPATH || exit 3
fi
export PYTHONPATH=$PWD:$PYTHONPATH PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 | tee "$OUT/env.txt"
python3 - <<'PY' 2>&1 | tee -a "$OUT/env.txt"
import cupy, cudnn, torch, sys
print("python", sys.version.split()[0], "cupy", cupy.__version__, "cuda runtime", cupy.cuda.runtime.runtimeGetVersion(),
      "cudnn-frontend", cudnn.__version__, "cudnn backend", cudnn.backend_version(), "torch", torch.__version__)
PY
status=0
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  # tests/gpu, then the op suite's cuda targets (its numpy/mlx targets are CI's) and the CUDA backend against the typed
  # contract (tests/test_backend_protocol.py needs CuPy to import it). Each failure lands in
  # $OUT/failures.txt as it happens, each test's time into timings.txt (tests/gpu/conftest.py): a call
  # cut off at its limit still names them. 2026-11-26: tests/gpu did not finish within 330 s on one
  # H200 (-n 8) nor within 357 s on 2x H200 (-n 10): its tail was the full-size CPU references, since
  # moved to the GPU; the cuda op targets take 74 s on one H100.
  # --dist load (not pyproject's loadfile): each test to the next free worker; a large file's many
  # parametrized full-size cases would otherwise queue on one worker, and the suite is near a call's limit.
  # On a machine of several GPUs the one-GPU files spread over all of them (CONVSERVE_TEST_GPU_SPREAD,
  # tests/conftest.py), then the files that need two GPUs run on their own.
  NG=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | wc -l)
  MULTI_FILES="tests/gpu/test_sharded_decode_gpus.py tests/gpu/test_service_shards_gpu.py tests/gpu/test_service_multi_gpu.py"
  if [ "$NG" -gt 1 ]; then
    ONE=$(ls tests/gpu/test_*.py | grep -v -e sharded_decode_gpus -e service_shards_gpu -e service_multi_gpu)
    CONVSERVE_TEST_GPU_SPREAD=$NG python3 -m pytest -q -p no:cacheprovider -p no:benchmark $ONE \
      --timeout ${TEST_TIMEOUT:-300} -rfE --durations 15 -n ${WORKERS:-$((4 * NG))} --dist load "$@" 2>&1 | tee "$OUT/pytest.log" | tail -n 30
    status=$?
    python3 -m pytest -q -p no:cacheprovider -p no:benchmark $MULTI_FILES --timeout ${TEST_TIMEOUT:-300} -rfE -n 3 --dist load \
      2>&1 | tee "$OUT/pytest_multi.log" | tail -n 12
    multi_status=$?
    [ $status = 0 ] && status=$multi_status
  else
    FILES=tests/gpu
    if [ -n "${PART:-}" ]; then  # PART=i/n: the files whose index (from 0, sorted) is i - 1 modulo n
      FILES=$(ls tests/gpu/test_*.py | awk -v i="${PART%/*}" -v n="${PART#*/}" '(NR - 1) % n == i - 1')
    fi
    python3 -m pytest -q -p no:cacheprovider -p no:benchmark $FILES --timeout ${TEST_TIMEOUT:-300} -rfE \
      --durations 15 -n ${WORKERS:-8} --dist load \
      --log-file="$OUT/cuda.log" --log-file-level=INFO "$@" 2>&1 | tee "$OUT/pytest.log" | tail -n 40
    status=$?
  fi
  ops_status=0
  if [ -z "${PART:-}" ] || [ "${PART%/*}" = "${PART#*/}" ]; then
    python3 -m pytest -q -p no:cacheprovider -p no:benchmark tests/test_ops.py tests/test_ops_conv.py \
      tests/test_backend_protocol.py -k cuda \
      --timeout ${TEST_TIMEOUT:-300} -rfE -n ${WORKERS:-8} --dist load 2>&1 | tee "$OUT/pytest_ops.log" | tail -n 15
    ops_status=$?  # the pipeline's (pipefail): pytest's
  fi
  [ $status = 0 ] && status=$ops_status
  [ -s "$OUT/failures.txt" ] && { echo "== failures as they happened:"; grep "^====" "$OUT/failures.txt"; }
fi
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  timeout 240 python3 benchmarks/gpu/gpu_ops.py ${OPS_ARGS:-} 2>&1 | tee "$OUT/gpu_ops.log" | tail -n ${OPS_TAIL:-20}
fi
if [ -n "${MODELS:-}" ]; then
  timeout ${MODELS_TIMEOUT:-300} python3 benchmarks/gpu/gpu_models.py --only "$MODELS" ${MODELS_ARGS:-} 2>&1 \
    | tee "$OUT/gpu_models.log" | tail -n 30
fi
if [ "${COMPILE:-0}" = 1 ]; then  # the same table with torch.compile beside (adds its compile time per shape)
  timeout ${COMPILE_TIMEOUT:-600} python3 benchmarks/gpu/gpu_models.py --only "${MODELS:-sd,convnext}" --compile \
    ${MODELS_ARGS:-} 2>&1 | tee "$OUT/gpu_models_compile.log" | tail -n 30
fi
if [ "${BREAKDOWN:-0}" = 1 ]; then  # where one graphed forward's wall time goes, stage by stage
  timeout ${BREAKDOWN_TIMEOUT:-240} python3 benchmarks/gpu/gpu_breakdown.py 2>&1 | tee "$OUT/gpu_breakdown.log" | tail -n 8
fi
if [ "${FIRSTCALL:-0}" = 1 ]; then  # where a new shape's first call spends its time (cProfile)
  timeout ${FIRSTCALL_TIMEOUT:-300} python3 benchmarks/gpu/first_call_profile.py 2>&1 | tee "$OUT/first_call.log" \
    | grep -E "=====|first decode|second decode" | tail -n 12
fi
if [ "${STREAM:-0}" = 1 ]; then  # the streamed decode's GPU row: streamed Wan 2.1 decode, real config
  timeout ${STREAM_TIMEOUT:-300} python3 benchmarks/service/streaming.py --models wan=wan2.1-vae --backend cuda \
    --shapes ${STREAM_SHAPES:-21x60x104} --reps 2 2>&1 | tee "$OUT/streaming.log" | tail -n 8
fi
if [ "${FIRSTCHUNK:-0}" = 1 ]; then  # the streamed decode's first group: host queueing vs kernels
  timeout ${FIRSTCHUNK_TIMEOUT:-200} python3 benchmarks/gpu/wan_first_chunk.py 2>&1 | tee "$OUT/wan_first_chunk.log" \
    | grep -v -i warn | tail -n 18
fi
if [ "${SERVICE:-0}" = 1 ] || [ "${SERVICE:-0}" = sd ]; then  # the multi-process service: through it vs the raw model
  timeout ${SERVICE_TIMEOUT:-200} python3 benchmarks/service/service_throughput.py --workload decode --backend cuda \
    --preset sd-vae --latent 64 --format ${SD_FORMATS:-png,jpeg,webp,npy} --batch 8 --concurrency 64 \
    --client-procs ${CLIENTS:-6} ${SERVICE_ARGS:-} --requests ${SD_REQUESTS:-1536} --reps 3 \
    --log "$OUT/service_sd_server.log" 2>&1 | tee -a "$OUT/service_sd.log" | grep -v -i warn | tail -n 9
fi
if [ "${SERVICE:-0}" = 1 ] || [ "${SERVICE:-0}" = enc ]; then
  # raw-socket clients (ENC_CLIENT=httpx for the real client): 8 httpx processes took 5-7 of the H200 host's
  # 16 cores and held the raw model itself to 5-6k img/s; 4 raw ones take under one core (2026-11-30)
  timeout ${SERVICE_TIMEOUT:-200} python3 benchmarks/service/service_throughput.py --workload encode --backend cuda \
    --preset convnext-tiny --size 224 --format ${ENC_FORMATS:-jpeg,npy} --batch 32 --concurrency 256 \
    --client ${ENC_CLIENT:-raw} --client-procs ${CLIENTS:-4} ${SERVICE_ARGS:-} --requests ${ENC_REQUESTS:-16384} --reps 3 \
    --log "$OUT/service_enc_server.log" 2>&1 | tee -a "$OUT/service_enc.log" | grep -v -i warn | tail -n 7
fi
if [ "${WANSVC:-0}" = 1 ]; then  # the multi-process service: Wan 2.1 81x480x832 through the service vs the raw decode
  timeout ${WANSVC_TIMEOUT:-400} python3 benchmarks/service/streaming.py --models wan=wan2.1-vae --backend cuda \
    --shapes ${WANSVC_SHAPES:-21x60x104} --reps ${WANSVC_REPS:-2} --raw 2>&1 | tee "$OUT/service_wan.log" \
    | grep -v -i warn | tail -n 8
fi
if [ -n "${MULTI:-}" ]; then  # the multi-process service: SD-VAE decode through one endpoint on 1, 2, 4 GPUs (MULTI=0,0,1,0,1,2,3 style list)
  raw=""  # the raw model (one GPU) is measured with the first device list only
  for devs in ${MULTI//;/ }; do
    timeout ${MULTI_TIMEOUT:-240} python3 benchmarks/service/service_throughput.py --workload decode --backend cuda \
      --preset sd-vae --latent 64 --format ${MULTI_FORMATS:-png,jpeg} --batch 8 --concurrency ${MULTI_CONC:-128} \
      --client-procs ${CLIENTS:-8} --requests ${MULTI_REQUESTS:-3072} --reps 3 --devices "$devs" $raw \
      ${SERVICE_ARGS:-} --log "$OUT/service_multi_server.log" 2>&1 | tee -a "$OUT/service_multi.log" \
      | grep -v -i warn | tail -n 5
    raw="--no-raw"
  done
fi
if [ "${COLD:-0}" = 1 ]; then  # cold vs warm start on one plan-cache directory
  timeout ${COLD_TIMEOUT:-400} python3 benchmarks/service/cold_start.py --backend cuda --models sd=sd-vae --size 512 \
    --log "$OUT/cold_start_server.log" 2>&1 | tee "$OUT/cold_start.log" | tail -n 8
fi
if [ -n "${FAMILIES:-}" ]; then  # the 2026 VAE families vs diffusers (FAMILIES=taesd,flux2,qwen,wan22)
  timeout ${FAMILIES_TIMEOUT:-300} python3 benchmarks/gpu/gpu_families.py --only "$FAMILIES" --compile 2>&1 \
    | tee "$OUT/gpu_families.log" | grep -v -i warn | tail -n 12
fi
if [ -n "${FAMILIES26:-}" ]; then  # the five newest VAE families vs diffusers, eager and torch.compile (FAMILIES26=all)
  [ "$FAMILIES26" = all ] && FAMILIES26=hv15,ltx2,dcae,hyimage,qwen21
  timeout ${FAMILIES26_TIMEOUT:-600} python3 benchmarks/gpu/gpu_families_2026.py --only "$FAMILIES26" \
    ${FAMILIES26_ARGS:-} 2>&1 | tee "$OUT/gpu_families_2026.log" | grep -v -i warn | tail -n 16
fi
if [ -n "${KPROFILE:-}" ]; then  # where the device time goes, kernel by kernel, ours beside diffusers (KPROFILE=dcae or taesd,wan22)
  timeout ${KPROFILE_TIMEOUT:-300} python3 benchmarks/gpu/gpu_kernel_profile.py --only "$KPROFILE" 2>&1 \
    | tee "$OUT/kernel_profile.log" | grep -v -i warn | tail -n 60
fi
if [ -n "${SHARDED:-}" ]; then  # the sharded decode: one decode over 1, 2, 4 GPUs (SHARDED='--size 4096' or a Wan latent)
  timeout ${SHARDED_TIMEOUT:-300} python3 benchmarks/gpu/sharded_decode.py $SHARDED 2>&1 \
    | tee -a "$OUT/sharded_decode.log" | grep -v -i warn | tail -n 10
fi
if [ "${AB:-0}" = 1 ]; then  # the ConvNeXt block fusions: each switch on and off vs PyTorch eager
  timeout ${AB_TIMEOUT:-300} python3 benchmarks/gpu/convnext_fusion_ab.py 2>&1 | tee "$OUT/convnext_fusion_ab.log" | tail -n 30
fi
exit $status
