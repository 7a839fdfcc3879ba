#!/bin/sh
# Builds the fake CUDA driver (libcuda.so.1), the fake runtime (libcudart.so.13), the fake
# management library (libnvidia-ml.so.1, for tracerd's GPU metrics), the fake CUPTI
# (libcupti.so.13, for GPU kernel times) and the test programs
# (cuda_app, warm_kernels, launch_loop) into OUT_DIR. Needs only a C compiler and libc headers (Debian 12:
# build-essential). The app finds the libraries through its $ORIGIN rpath or LD_LIBRARY_PATH.
# usage: build.sh OUT_DIR        (CC and CFLAGS are honoured; with CFLAGS set, the prologue
#                                 check at the end is skipped)
set -eu
if [ $# -ne 1 ]; then
  echo "usage: $0 OUT_DIR" >&2
  exit 2
fi
HERE=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$1"
OUT=$(cd "$1" && pwd)
CC=${CC:-cc}
USER_CFLAGS=${CFLAGS:+yes}
# -O2 with frame pointers, without shrink-wrapping, sibling calls or the scheduling pass that
# moves instructions into the prologue: every exported function is a real, non-inlined symbol
# (noinline in the sources) that starts with `push %rbp; mov %rsp,%rbp` on x86-64 (after
# `endbr64` in the CET-built driver); except the runtime's __cudaLaunchKernel*, which jump on
# to cudaLaunchKernel* as the real ones do.
CFLAGS=${CFLAGS:--O2 -g -fno-omit-frame-pointer -fno-shrink-wrap -fno-optimize-sibling-calls \
-fno-schedule-insns2}
WARN="-std=gnu11 -Wall -Wextra -Wno-unused-parameter"

# The driver is built the CET way where the compiler can (as distributions' packages are):
# its functions start with an `endbr64` landing pad, which tracer probes past.
CET=
if [ -z "$USER_CFLAGS" ] && [ "$(uname -m)" = x86_64 ] &&
  echo 'int f(void){return 0;}' | $CC -fcf-protection=full -x c -c -o /dev/null - 2>/dev/null; then
  CET=-fcf-protection=full
fi
$CC $CFLAGS $CET $WARN -fPIC -fvisibility=hidden -shared -Wl,-soname,libcuda.so.1 \
  -o "$OUT/libcuda.so.1" "$HERE/fake_cuda.c" -ldl -lpthread
# The runtime dlopen()s libcuda.so.1 itself; its own $ORIGIN runpath finds the fake one next
# to it (a runpath is not inherited from the app).
$CC $CFLAGS $WARN -fPIC -fvisibility=hidden -shared -Wl,-soname,libcudart.so.13 \
  '-Wl,-rpath,$ORIGIN' -o "$OUT/libcudart.so.13" "$HERE/fake_cudart.c" -ldl -lpthread
$CC $CFLAGS $WARN -fPIC -fvisibility=hidden -shared -Wl,-soname,libnvidia-ml.so.1 \
  -o "$OUT/libnvidia-ml.so.1" "$HERE/fake_nvml.c"
# CUPTI, for tracer's injection library (GPU kernel times): found beside the runtime, as in a
# CUDA 13 wheel.
$CC $CFLAGS $WARN -fPIC -fvisibility=hidden -shared -Wl,-soname,libcupti.so.13 \
  -o "$OUT/libcupti.so.13" "$HERE/fake_cupti.c" -lpthread
# The development names, for tools that look for libcuda.so / libcudart.so.
ln -sf libcuda.so.1 "$OUT/libcuda.so"
ln -sf libcudart.so.13 "$OUT/libcudart.so"
# The app is linked against neither library: it dlopen()s them by soname after its cue.
$CC $CFLAGS $WARN -o "$OUT/cuda_app" "$HERE/cuda_app.c" '-Wl,-rpath,$ORIGIN' -ldl -lpthread
# A process whose kernels are registered at load, nvcc's way, by a stripped binary linked
# against the runtime (as PyTorch's libraries are) and the driver.
$CC $CFLAGS $WARN -s -o "$OUT/warm_kernels" "$HERE/warm_kernels.c" -L"$OUT" -l:libcudart.so.13 \
  -l:libcuda.so.1 '-Wl,-rpath,$ORIGIN'
# Launches from a thread that runs no Python, for tests/scripts/cuda_calls.py.
$CC $CFLAGS $WARN -fPIC -shared -o "$OUT/libworker_launch.so" "$HERE/worker_launch.c" -lpthread
# The launch-bound loop of `cargo xtask bench cuda`, built the same way.
$CC $CFLAGS $WARN -o "$OUT/launch_loop" "$HERE/launch_loop.c" '-Wl,-rpath,$ORIGIN' -ldl
# The same loop as a library, for launch_loop.py: launches made under a Python frame.
$CC $CFLAGS $WARN -fPIC -shared -DLAUNCH_LOOP_LIBRARY -o "$OUT/liblaunch_loop.so" \
  "$HERE/launch_loop.c" '-Wl,-rpath,$ORIGIN' -ldl

# Check the promise above on x86-64 when building with the default flags (objdump and nm come
# with binutils, part of build-essential).
if [ -z "$USER_CFLAGS" ] && [ "$(uname -m)" = x86_64 ] && command -v objdump >/dev/null; then
  for lib in libcuda.so.1 libcudart.so.13; do
    exports=$(nm -D --defined-only "$OUT/$lib" | awk '$2 == "T" { printf "%s ", $3 }')
    objdump -d --no-show-raw-insn "$OUT/$lib" | awk -v lib="$lib" -v exports="$exports" '
      BEGIN {
        n = split(exports, e, " ")
        # nvcc 13 stubs launch through these; they jump to cudaLaunchKernel* (unprobed).
        for (i = 1; i <= n; i++) if (e[i] !~ /^__cudaLaunchKernel/) want[e[i]] = 1
      }
      /^[0-9a-f]+ <.*>:$/ { name = substr($2, 2, length($2) - 3); n = 0; next }
      name in want && /^ +[0-9a-f]+:/ {
        n++; sub(/^ +[0-9a-f]+:[ \t]+/, ""); gsub(/[ \t]+/, " ")
        if (n == 1 && $0 == "endbr64") { n = 0; next }
        if (n == 1) first = $0
        if (n == 2) {
          if (first != "push %rbp" || $0 != "mov %rsp,%rbp") {
            print lib ": " name ": " first "; " $0
            bad = 1
          }
          delete want[name]
        }
      }
      END { for (w in want) { print lib ": " w ": not found"; bad = 1 } exit bad }
    ' || {
      echo "exported functions without the usual prologue" >&2
      exit 1
    }
  done
fi
echo "built $OUT/libcuda.so.1 $OUT/libcudart.so.13 $OUT/libnvidia-ml.so.1 $OUT/libcupti.so.13 $OUT/cuda_app"
