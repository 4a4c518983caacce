#!/usr/bin/env bash
# The `llama-cpp` condition on the GPU machine (issue 45, item 4): llama-cpp-python built for the H200/H100
# there within a call, then one screen through `packbench submit --wait` and `packbench audit` beside
# exact expert packets and host-experts.
#   build: llama-cpp-python's sdist (trimmed to the CPU and CUDA backends, 4.4 MB: make it here with
#          `bash bench/llamacpp_screen_device.sh pack`, which writes .llama/lcp-trim.tar.gz) built into a
#          wheel with CMAKE_ARGS="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_CUDA_FA=OFF -DLLAVA_BUILD=OFF"
#          (flash attention's kernel instances are most of the compile: off, and the condition runs without
#          it) through scikit-build-core carried in .whl, into .llama-build/ (an ignored path a warm machine
#          keeps between calls);
#   run:   that wheel installed, the condition's CUDA tests (tests/engine/test_llama_cpp_cuda.py), then a
#          SHAPE checkpoint (qwen3-30b-a3b, LAYERS=12 of 48, fp16, drawn on the GPU) screened under ALLOWANCE_MIB
#          (7168: the share of the model 24 GiB is of the full one, as bench/moe_peers_device.sh): dense-stream,
#          packet (mapped gather), host-experts, llama-cpp with n_cpu_moe chosen from the allowance, and
#          llama-cpp with every layer's experts in host memory (n_cpu_moe LAYERS, llama.cpp's --cpu-moe), and
#          the chosen placement with op offload on (llama.cpp's default: a prefill copies the host experts);
#          1 warm-up + 2 prompts of PREFIX + CONT tokens each (BATCH sequences together, default 1: at 32 and
#          more a decode call crosses llama.cpp's op-offload threshold); the audit; bench.moe_peers_screen's table.
# Carry .whl (`EXTRA="gguf scikit-build-core pathspec pyproject-metadata packaging" bash ../shared/device/wheelhouse.sh`)
# and .llama; make both calls on one warm machine:
#   run(carry=[".whl", ".llama"], command="ONLY=build bash bench/llamacpp_screen_device.sh")
#   run(carry=[".whl", ".llama"], command="ONLY=run bash bench/llamacpp_screen_device.sh")
# ONLY=probe: which llama.cpp loads crash, a process each (bench/llamacpp_load_probe.py), with native frames;
# ONLY=sweep: the llama-cpp CUDA tests, then bench.moe_peers over BATCHES (default 1,8,32: what fits a call at
# the Qwen3 shape; BATCHES=64 in a second) with llama.cpp's op offload off and on beside the packets and
# host-experts (llama.cpp's own crossover).
# Logs under $OUT (or ./llamacpp-screen-out).
set -uo pipefail
t_start=$(date +%s)
DEADLINE=${DEADLINE:-560}
left() { echo $(( DEADLINE - ($(date +%s) - t_start) )); }
root=$PWD
if [ "${1:-}" = pack ]; then  # on a machine with network: the trimmed sdist
  tmp=$(mktemp -d); python3 -m pip download -q --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d "$tmp" || exit 1
  tar xzf "$tmp"/llama_cpp_python-*.tar.gz -C "$tmp"; D=llama_cpp_python-0.3.36; v=$D/vendor/llama.cpp; g=$v/ggml/src
  mkdir -p .llama
  tar czf .llama/lcp-trim.tar.gz -C "$tmp" --exclude=$D/.git --exclude=$v/.git --exclude=$v/models --exclude=$v/docs \
    --exclude=$v/tests --exclude=$v/examples --exclude=$v/pocs --exclude=$v/benches --exclude=$v/media \
    --exclude=$v/tools/ui --exclude=$v/tools/server --exclude=$v/tools/mtmd --exclude=$D/docs --exclude=$D/examples \
    --exclude=$D/tests --exclude=$D/docker $(for b in cann et hexagon hip metal musa opencl openvino rpc sycl virtgpu \
      vulkan webgpu zdnn zendnn; do echo --exclude=$g/ggml-$b; done) $D
  ls -la .llama/lcp-trim.tar.gz; rm -rf "$tmp"; exit 0
fi
out=${OUT:-$root/llamacpp-screen-out}; mkdir -p "$out"
source bench/device_common.sh
wheel_dir=$root/.llama-build
llama_wheel() {  # the CUDA wheel ONLY=build made on this (warm) machine, and what it imports, into /tmp/site
  ls "$wheel_dir"/llama_cpp_python-*.whl > /dev/null 2>&1 || { echo "no wheel in $wheel_dir: run ONLY=build first on this (warm) machine"; exit 1; }
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site --upgrade "$wheel_dir"/llama_cpp_python-*.whl .whl/diskcache-*.whl .whl/gguf-*.whl
}
if [ "${ONLY:-build}" = build ]; then
  install_wheels
  echo "cmake: $(cmake --version | head -1); nvcc: $(nvcc --version | tail -1); cores: $(nproc)"
  src=$(mktemp -d); tar xzf .llama/lcp-trim.tar.gz -C "$src" || exit 1
  t0=$(date +%s); mkdir -p "$wheel_dir"
  CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) CMAKE_ARGS="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_CUDA_FA=OFF \
-DLLAVA_BUILD=OFF" timeout $(( $(left) - 10 )) python3 -m pip wheel -q --no-build-isolation --no-deps --no-cache-dir \
    "$src"/llama_cpp_python-0.3.36 -w "$wheel_dir" > "$out/build.log" 2>&1
  echo "== llama-cpp-python CUDA wheel: rc $? in $(( $(date +%s) - t0 )) s"; ls -la "$wheel_dir"
  grep -iE "error|CMake Error" "$out/build.log" | head -8; rm -rf "$src"
fi
if [ "${ONLY:-}" = probe ]; then  # which loads crash: bench/llamacpp_load_probe.py, one process a variant, each
  # with bench/segv_trace.c preloaded (a crash prints its native frames, named here by addr2line); a variant
  # ending +quiet runs without llama.cpp's log, +omp1 with OMP_NUM_THREADS=1 CUDA_VISIBLE_DEVICES=0 (as Ray sets them)
  install_wheels
  llama_wheel
  work_dir
  gcc -shared -fPIC -O1 -o /tmp/segv_trace.so bench/segv_trace.c || exit 1
  echo "gdb: $(command -v gdb || echo none); addr2line: $(command -v addr2line || echo none); $(ldd --version | head -1)"
  cuda_lib=$(ls /tmp/site/llama_cpp/lib/libggml-cuda.so* | head -1)
  echo "libggml-cuda's exported C++ runtime symbols: $(nm -D --defined-only "$cuda_lib" | c++filt | grep -cE ' std::(basic_ostream|locale|basic_ios|__cxx11::basic_string)') (e.g. $(nm -D --defined-only "$cuda_lib" | c++filt | grep -m1 -oE 'std::basic_ostream.*_M_insert<long>.*'))"
  for v in ${VARIANTS:-qwen3-moe-tiny:3:0 qwen3-moe-tiny:3:0:local qwen3-moe-tiny:3:1 qwen3-moe-tiny:3:0:first qwen3-moe-tiny:3:0:bare qwen3-30b-a3b:12:0 mixtral-tiny:3:3}; do
    base=${v%+*}; log="$out/probe-${v//[:+]/_}.log"; envs=(PACKBENCH_LLAMA_LOG=1)
    [[ $v == *+quiet ]] && envs=(PACKBENCH_LLAMA_LOG=)
    [[ $v == *+omp1 ]] && envs+=(OMP_NUM_THREADS=1 CUDA_VISIBLE_DEVICES=0)
    env "${envs[@]}" LD_PRELOAD=/tmp/segv_trace.so timeout 150 python3 -m bench.llamacpp_load_probe "$base" "$work" > "$log" 2>&1
    rc=$?; echo "   $v: rc $rc: $(grep -E "^$base: (ok|the Ray)" "$log" | tail -1)"
    [[ $v == qwen3-moe-tiny:3:0 || $v == *:ray ]] && grep -E ": mapped " "$log" | sed 's/^/      /'
    if [ $rc != 0 ] || grep -q "segv_trace:" "$log"; then
      grep -B3 -m1 "segv_trace:" "$log" | grep -vE "^(Fatal|Current|Thread|  File)" | cut -c1-160 | sed 's/^/      before: /'
      grep -A40 -m1 "segv_trace:" "$log" | grep -E "^/.*lib(llama|ggml|stdc)" | head -14 | while read -r f; do
        so=${f%%(*}; inner=${f#*(}; inner=${inner%%)*}
        if [[ $inner == +* ]]; then echo "      ${so##*/} $(addr2line -f -C -e "$so" "${inner#+}" | head -1)"
        else echo "      ${so##*/} $(echo "${inner%%+*}" | c++filt)"; fi
      done
    fi
  done
fi
if [ "${ONLY:-}" = sweep ]; then  # llama.cpp's crossover: bench.moe_peers over BATCHES, llama.cpp's op offload
  # off (its CPU computes the host experts) and on (from 32 tokens a call it copies them to the GPU) beside
  # the packets and host-experts, every layer's experts in host memory; the llama-cpp CUDA tests first
  product_env
  llama_wheel
  device_header
  echo "== CUDA tests (llama-cpp)"
  timeout 150 python3 -m pytest -q -m "gpu and llamacpp" -p no:cacheprovider tests/engine/test_llama_cpp_cuda.py \
    > "$out/pytest.log" 2>&1; echo "pytest rc $?"; grep -E "passed|failed|Error|assert" "$out/pytest.log" | tail -6
  SHAPE=${SHAPE:-qwen3-30b-a3b}; LAYERS=${LAYERS:-12}; DEV=cuda; dir=$work/$SHAPE
  moe_synth "$SHAPE" "$LAYERS" "$dir"
  limit=$(( $(left) - 15 )); [ "$limit" -ge 30 ] || limit=1
  timeout "$limit" python3 -m bench.moe_peers --model "$dir" --dtype float16 --batches "${BATCHES:-1,8,32}" \
    --prefix "${PREFIX:-32}" --continuation "${CONT:-8}" --rounds 2 --cache "$work/mc" \
    --conditions packet,packet-mapped,host-experts,llama-cpp,llama-cpp-po > "$out/sweep.log" 2>&1
  echo "-- sweep rc $? (limit $limit s)"; grep -E "^ *([0-9]+|B) |crossover|/ " "$out/sweep.log" | tail -50 | cut -c1-220
  rm -rf "$dir"
fi
if [ "${ONLY:-run}" = run ]; then
  product_env
  llama_wheel
  device_header
  python3 -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__, 'gpu offload', llama_cpp.llama_supports_gpu_offload())"
  echo "== llama.cpp loads each tiny GGUF on the GPU (a process each: a crash is one line here)"
  for shape in qwen3-moe-tiny mixtral-tiny; do for dt in float16 float32; do
    timeout 60 python3 - "$shape" "$dt" "$work" > "$out/load-$shape-$dt.log" 2>&1 <<'PY'
import sys, torch
from pathlib import Path
from packbench.engine.moe.synth import synth_moe
from packbench.engine.llama_cpp import LlamaCppModel
from packbench.engine.episode import run_episode
shape, dt, work = sys.argv[1], sys.argv[2], Path(sys.argv[3])
d = synth_moe(work / f"{shape}-{dt}", shape=shape, seed=3, dtype=dt, device="cuda")
for n in (0, 3):
    m = LlamaCppModel(d, dtype=getattr(torch, dt), device=torch.device("cuda"), params={"n_cpu_moe": n},
                      allowance_bytes=1 << 31, context_bytes=0, capacity=64, batch=1, cache=work / "mc")
    out = run_episode(m, [list(range(7, 47))], continuation=3)
    print(f"{shape} {dt} n_cpu_moe {n}: ok, tokens {out.tokens[0]}, device {m.stats.device_bytes >> 20} MiB")
    m.release()
PY
    echo "   $shape $dt: rc $? $(grep -h "ok," "$out/load-$shape-$dt.log" | tr '\n' ' ')"
  done; done
  echo "== CUDA tests (llama-cpp)"
  timeout 150 python3 -m pytest -q -m "gpu and llamacpp" -p no:cacheprovider tests/engine/test_llama_cpp_cuda.py \
    > "$out/pytest.log" 2>&1; echo "pytest rc $?"; grep -E "passed|failed|Error|assert" "$out/pytest.log" | tail -6
  SHAPE=${SHAPE:-qwen3-30b-a3b}; LAYERS=${LAYERS:-12}; ALLOW=${ALLOWANCE_MIB:-7168}; P=${PREFIX:-128}; C=${CONT:-16}
  BATCH=${BATCH:-1}  # sequences decoded together: llama.cpp's op offload copies experts from 32 tokens a call
  DEV=cuda; dir=$work/$SHAPE
  moe_synth "$SHAPE" "$LAYERS" "$dir"
  cat > "$work/llama.yaml" <<YAML
name: llama-cpp-$SHAPE-$LAYERS
model: {path: $dir}
dtype: float16
prompts: {generator: {seed: 0, count: $(( BATCH > 2 ? BATCH : 2 ))}}
prefix_tokens: $P
continuation_tokens: $C
batch: $BATCH
scored_prompts: 2
conditions:
  - {policy: dense-stream}
  - {name: packet-mapped, policy: packet, params: {gather: mapped}}
  - {policy: host-experts}
  - {name: llama-cpp, policy: llama-cpp}
  - {name: llama-cpp-host, policy: llama-cpp, params: {n_cpu_moe: $LAYERS}}
  - {name: llama-cpp-po, policy: llama-cpp, params: {op_offload: "on"}}
reference: dense-stream
warmups: 1
allowance_mib: $ALLOW
gates: {faithfulness: {}, fidelity: {max_mean_kl: 0.002, min_top1: 0.98}}
YAML
  pb protocol plan "$work/llama.yaml" 2>&1 | tail -8
  t0=$(date +%s); limit=$(( $(left) - 45 )); [ "$limit" -ge 30 ] || limit=1
  timeout "$limit" python3 -m packbench submit "$work/llama.yaml" --wait > "$out/submit.log" 2>&1
  echo "-- submit rc $? in $(( $(date +%s) - t0 )) s (limit $limit s)"; tail -3 "$out/submit.log"
  pb audit latest > "$out/audit.log" 2>&1; echo "   audit rc $?"; verdict "$out/audit.log"
  archive=$(ls -t "$work"/archives/*.zip "$work"/archives/*/*.zip 2>/dev/null | head -1)
  [ -n "$archive" ] && python3 -m bench.moe_peers_screen "$archive" > "$out/screen.txt" 2>&1; cat "$out/screen.txt"
  [ -n "$archive" ] && python3 - "$archive" <<'PY'
import json, sys, zipfile
z = zipfile.ZipFile(sys.argv[1])
for name in sorted(n for n in z.namelist() if n.startswith("episodes/") and n.endswith(".json")):
    r = json.loads(z.read(name))
    o = r.get("offload") or {}
    if r.get("policy") == "llama-cpp" and r.get("role") == "warmup":
        keys = ("load_s", "convert_s", "gguf_bytes", "device_bytes", "threads", "op_offload")
        print(f"   {r.get('condition')}: placement {json.dumps(o.get('placement'))} {json.dumps({k: o.get(k) for k in keys})}")
    if r.get("status") != "ok":
        tail = " | ".join((r.get("traceback") or r.get("error") or "").strip().splitlines()[-4:])
        print(f"   failed {r.get('condition')} episode {r.get('plan_index')}: {tail[:600]}")
PY
  rm -rf "$dir"
fi
