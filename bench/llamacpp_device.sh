#!/usr/bin/env bash
# llama.cpp with its experts in host memory (`--n-cpu-moe`) on the H200: can it be built and run
# within a device call, and how fast is it on the MoE shape packbench measures? (issue 45, item 4)
#   build: llama.cpp's source (trimmed to CPU + CUDA, 5.9 MB: make it with `bash bench/llamacpp_device.sh
#          pack` on a machine with network, which writes .llama/llama.cpp-src.tar.gz from the llama-cpp-python
#          sdist) built with -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 (flash attention off: its kernel
#          instances are most of the compile time) into .llama-build: llama-bench and llama-batched-bench;
#   run:   a synthetic SHAPE checkpoint (qwen3-30b-a3b, LAYERS=12 of 48, fp16, drawn on the GPU), converted to
#          GGUF f16 by bench.llamacpp_gguf (llama.cpp's own convert_hf_to_gguf.py; the synthetic checkpoint's
#          missing tokenizer is supplied there), then
#          llama-bench -ngl 99 -ncmoe 0,LAYERS (experts on the GPU; every layer's experts in host memory,
#          computed by the CPU) with and without op offload (-nopo: llama.cpp copies host-resident weights to
#          the GPU for an op of >= 32 tokens, GGML_OP_OFFLOAD_MIN_BATCH), pp128 and tg16, and
#          llama-batched-bench --n-cpu-moe LAYERS at batches 1..64: llama.cpp's decode tokens/s against batch.
# No .whl needed (no ray, no database); carry the tarball, and make both calls on one warm machine:
#   run(carry=[".llama"], command="ONLY=build bash bench/llamacpp_device.sh")       # about 4-8 min at -j16
#   run(carry=[".llama"], command="ONLY=run bash bench/llamacpp_device.sh")         # synth, convert, bench
# The build lives in .llama-build, beside the carried .llama and not in it: a carried path replaces the
# device's copy, so a build inside .llama would be gone at the second call; the source is unpacked
# again there when missing. A warm machine keeps .llama-build between calls (an ignored path not
# carried); a fresh one rebuilds (ONLY unset does both: over 10 min is likely). Logs under $OUT (or
# ./llamacpp-out). CPU dry run (a CPU build, a tiny shape; sentencepiece and torch on python3's path):
#   DEVICE=cpu CUDA=OFF SHAPE=qwen3-moe-tiny LAYERS=3 OUTTYPE=f32 bash bench/llamacpp_device.sh
set -uo pipefail
root=$PWD
out=${OUT:-$root/llamacpp-out}; mkdir -p "$out"
src=$root/.llama/src/llama.cpp; build=$root/.llama-build
DEV=${DEVICE:-cuda}; CUDA=${CUDA:-ON}; SHAPE=${SHAPE:-qwen3-30b-a3b}; LAYERS=${LAYERS:-12}; OUTTYPE=${OUTTYPE:-f16}
JOBS=${JOBS:-$(nproc)}
export PYTHONPATH=$root PYTHONUNBUFFERED=1
if [ "${1:-}" = pack ]; then  # on a machine with network: the trimmed source, from llama-cpp-python's sdist
  tmp=$(mktemp -d); python3 -m pip download --no-deps --no-binary :all: llama-cpp-python -d "$tmp" || exit 1
  tar xzf "$tmp"/llama_cpp_python-*.tar.gz -C "$tmp"; ls "$tmp"/llama_cpp_python-*.tar.gz
  g=llama.cpp/ggml/src; mkdir -p .llama
  tar czf .llama/llama.cpp-src.tar.gz -C "$tmp"/llama_cpp_python-*/vendor --exclude=llama.cpp/models \
    --exclude=llama.cpp/docs --exclude=llama.cpp/tests --exclude=llama.cpp/examples --exclude=llama.cpp/pocs \
    --exclude=llama.cpp/benches --exclude=llama.cpp/media --exclude=llama.cpp/tools/ui \
    $(for b in cann et hexagon hip metal musa opencl openvino rpc sycl virtgpu vulkan webgpu zdnn zendnn; do
      echo --exclude=$g/ggml-$b; done) llama.cpp
  ls -la .llama/llama.cpp-src.tar.gz; rm -rf "$tmp"; exit 0
fi
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1
echo "nvcc: $(nvcc --version 2>/dev/null | tail -1); cmake: $(cmake --version | head -1); gcc: $(gcc -dumpfullversion); cores: $(nproc)"
unpack() { [ -f "$src/CMakeLists.txt" ] || { mkdir -p .llama/src && tar xzf .llama/llama.cpp-src.tar.gz -C .llama/src; }; }
if [ "${ONLY:-build}" = build ]; then
  unpack || exit 1
  t0=$(date +%s)
  cmake -S "$src" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA="$CUDA" -DCMAKE_CUDA_ARCHITECTURES=90 \
    -DGGML_CUDA_FA=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
    > "$out/cmake.log" 2>&1; echo "== configure rc $? in $(( $(date +%s) - t0 )) s"; grep -iE "error|cuda" "$out/cmake.log" | head -5
  t0=$(date +%s)
  cmake --build "$build" --target llama-bench llama-batched-bench -j "$JOBS" > "$out/build.log" 2>&1
  echo "== build rc $? in $(( $(date +%s) - t0 )) s"; grep -E "error" "$out/build.log" | head -5; tail -2 "$out/build.log"
fi
if [ "${ONLY:-run}" = run ]; then
  [ -x "$build/bin/llama-bench" ] || { echo "no build at $build: run ONLY=build first on this (warm) machine"; exit 1; }
  unpack || exit 1  # the converter (convert_hf_to_gguf.py, gguf-py) is the source's
  source "$root/bench/device_common.sh"; work_dir; dir=$work/$SHAPE
  t0=$(date +%s)
  python3 -c "from packbench.engine.moe.synth import synth_moe; synth_moe(__import__('pathlib').Path('$dir'), \
shape='$SHAPE', dtype='float16' if '$OUTTYPE' == 'f16' else 'float32', layers=$LAYERS, device='$DEV')" \
    > "$out/synth.log" 2>&1; echo "== synth rc $? in $(( $(date +%s) - t0 )) s ($(du -sh "$dir" | cut -f1))"
  t0=$(date +%s)
  python3 -m bench.llamacpp_gguf --model "$dir" --llama "$src" --out "$work/model.gguf" --outtype "$OUTTYPE" \
    > "$out/convert.log" 2>&1; echo "== convert rc $? in $(( $(date +%s) - t0 )) s ($(du -sh "$work/model.gguf" | cut -f1))"
  tail -2 "$out/convert.log"; rm -rf "$dir"
  ngl=99; [ "$CUDA" = ON ] || ngl=0
  t0=$(date +%s)
  "$build/bin/llama-bench" -m "$work/model.gguf" -ngl $ngl -ncmoe "0,$LAYERS" -nopo 0,1 -fa off -p 128 -n 16 -r 3 \
    -t "$JOBS" -o md > "$out/llama-bench.md" 2> "$out/llama-bench.err"
  echo "== llama-bench rc $? in $(( $(date +%s) - t0 )) s"; cat "$out/llama-bench.md"; tail -3 "$out/llama-bench.err"
  t0=$(date +%s)
  "$build/bin/llama-batched-bench" -m "$work/model.gguf" -ngl $ngl --n-cpu-moe "$LAYERS" -fa off -c 8192 -b 2048 \
    -ub 512 -npp 16 -ntg 8 -npl 1,2,4,8,16,32,64 -t "$JOBS" > "$out/batched.log" 2>&1
  echo "== llama-batched-bench (experts of $LAYERS layers in host memory) rc $? in $(( $(date +%s) - t0 )) s"
  grep -E "^\|" "$out/batched.log" | head -12
  rm -rf "$work"
fi
