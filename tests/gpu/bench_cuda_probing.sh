#!/bin/sh
# How long requests wait while a `--cuda --all` session probes CUDA libraries it meets: the
# slowest `tracerctl list` while N processes each map copies (new files, so never probed
# before) of this machine's libcuda and libcudart, next to the slowest with nothing to probe.
# Not part of CI: run by hand as root on a machine with the NVIDIA driver; results go in
# docs/GPU_VALIDATION.md.
# usage: bench_cuda_probing.sh BIN_DIR [N=6]   (CUDA_LIBS="FILE…" names other libraries to copy)
set -eu
BIN=$(cd "$1" && pwd)
N=${2:-6}
HERE=$(cd "$(dirname "$0")" && pwd)
. "$HERE/tracerd.sh"
# The driver as the loader finds it, and the runtime from the CUDA wheels beside torch.
LIBS=${CUDA_LIBS:-$(python3 - <<'PY'
import ctypes, glob, site
ctypes.CDLL("libcuda.so.1")
for d in site.getsitepackages():
    for f in sorted(glob.glob(d + "/nvidia/*/lib/libcudart.so.*"))[:1]:
        ctypes.CDLL(f)
seen = []
for line in open("/proc/self/maps"):
    path = line.split()[-1]
    if ("/libcuda.so" in path or "/libcudart.so" in path) and path not in seen:
        seen.append(path)
print(" ".join(seen))
PY
)}
echo "libraries: $LIBS ($(du -ch $LIBS | tail -1 | cut -f1))"
$CTL start --mode=counting --cuda --all >/dev/null
sleep 2
# slowest SECONDS LABEL: the slowest list over SECONDS, in ms.
slowest() {
  end=$(($(date +%s%N) + $1 * 1000000000))
  max=0
  n=0
  while [ "$(date +%s%N)" -lt $end ]; do
    t0=$(date +%s%N)
    $CTL list >/dev/null
    d=$((($(date +%s%N) - t0) / 1000000))
    [ $d -gt $max ] && max=$d
    n=$((n + 1))
  done
  echo "$2: slowest list $max ms of $n"
}
slowest 3 "nothing to probe"
slowest $((N + 3)) "$N processes mapping new copies" &
L=$!
sleep 1
for i in $(seq "$N"); do
  mkdir "$STATE/p$i"
  cp $LIBS "$STATE/p$i/"
  python3 -c "
import ctypes, os, sys, time
for f in sorted(os.listdir(sys.argv[1]), key=lambda f: 'cudart' in f):
    ctypes.CDLL(os.path.join(sys.argv[1], f))
time.sleep(0.5)" "$STATE/p$i"
done
wait $L
echo "libraries probed: $(grep -c 'CUDA library probed' "$STATE/log")"
grep 'CUDA library probed' "$STATE/log" | sed 's/\x1b\[[0-9;]*m//g; s/.*CUDA library probed/probed/' | tail -4
