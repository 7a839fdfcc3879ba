#!/bin/sh
# Kernel launches counted with `--uprobe` on libcuda and libcudart, next to torch.profiler's
# kernel count for the same work. Not part of CI: run by hand on a GPU machine, as root;
# results go in docs/GPU_VALIDATION.md.  usage: check_cuda_launches.sh BIN_DIR
set -eu
BIN=$(cd "$1" && pwd)
HERE=$(cd "$(dirname "$0")" && pwd)
. "$HERE/tracerd.sh"
CUDART=$(python3 -c "import glob, os, nvidia; print(sorted(glob.glob(os.path.join(list(nvidia.__path__)[0], '*/lib/libcudart.so*')))[0])")
echo "libcudart: $CUDART"
echo "== torch.profiler (second run of the work, warm)"
python3 "$HERE/torch_launches.py" --profile | head -20
echo "== tracer, attached to the warm process: driver and runtime launch entry points"
python3 "$HERE/torch_launches.py" --wait "$STATE/ready" "$STATE/go" &
WORK=$!
while [ ! -e "$STATE/ready" ]; do sleep 0.1; done
ID=$($CTL start --mode=counting --pid $WORK \
  --uprobe 'libcuda:cuLaunchKernel*' --uprobe 'libcuda:cuGraphLaunch*' \
  --uprobe "$CUDART:cudaLaunchKernel*" --uprobe "$CUDART:cudaGraphLaunch*")
touch "$STATE/go"
wait $WORK
report_when_ended "$ID"
