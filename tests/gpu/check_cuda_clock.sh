#!/bin/sh
# Two things check_cuda.sh does not reach. Not part of CI: run by hand on a GPU machine, as
# root; results go in docs/GPU_VALIDATION.md.
# usage: check_cuda_clock.sh BIN_DIR
# 1. A tracing session with --gpu-times: CUPTI's kernel start times (moved from its clock to
#    CLOCK_MONOTONIC by tracer) against the launch instants that tracer's probes stamp. On one
#    stream the k-th kernel to start on the GPU is the k-th launched at the driver, so every
#    kernel must start after its launch, by microseconds to milliseconds; a wrong clock offset
#    shows as negative or uniformly shifted lags.
# 2. CUDA graphs: replays counted at cuGraphLaunch/cudaGraphLaunch, and the graph's kernels
#    timed by CUPTI, next to torch.profiler's kernel count for the same replays.
set -eu
BIN=$(cd "$1" && pwd)
HERE=$(cd "$(dirname "$0")" && pwd)
. "$HERE/tracerd.sh"
echo "== tracing --cuda --gpu-times: GPU start against launch"
$CTL start --mode=tracing --cuda --gpu-times --format chrome -o "$STATE/trace.json" \
  -- python3 "$HERE/torch_launches.py"
python3 - "$STATE/trace.json" <<'PY'
import json, statistics, sys
t = json.load(open(sys.argv[1]))
ev = t["traceEvents"] if isinstance(t, dict) else t
launch = sorted(e["ts"] for e in ev if e.get("cat") == "cuda" and e.get("ph") == "i"
                and e.get("args", {}).get("api", "").startswith("cuLaunch"))
gpu = sorted((e["ts"], e["dur"], e["name"]) for e in ev if e.get("cat") == "gpu")
streams = {(e["pid"], e["tid"]) for e in ev if e.get("cat") == "gpu"}
print("driver launches", len(launch), "GPU executions", len(gpu), "GPU tracks", len(streams))
n = min(len(launch), len(gpu))
lags = [gpu[k][0] - launch[k] for k in range(n)]
early = sum(1 for l in lags if l < 0)
print(f"pairs {n}: started before their launch {early}; lag us min {min(lags):.1f} "
      f"median {statistics.median(lags):.1f} max {max(lags):.1f}")
overlap = sum(1 for k in range(1, len(gpu)) if gpu[k][0] < gpu[k - 1][0] + gpu[k - 1][1] - 0.001)
print("executions overlapping the previous one on the GPU:", overlap)
print("first launches (us) and GPU starts:", [round(launch[k] - launch[0], 1) for k in range(3)],
      [round(gpu[k][0] - launch[0], 1) for k in range(3)])
PY
echo "== CUDA graph replays: torch.profiler"
python3 "$HERE/torch_graphs.py" --profile
echo "== CUDA graph replays: tracer --cuda --gpu-times, the whole program"
$CTL start --mode=counting --cuda --gpu-times --format json -o "$STATE/graphs.json" \
  -- python3 "$HERE/torch_graphs.py"
python3 - "$STATE/graphs.json" <<'PY'
import collections, json, sys
r = json.load(open(sys.argv[1]))
c = r["cuda"]
api = collections.Counter()
for l in c["launches"]:
    api[l["api"]] += l["launches"]
print("launches per entry point:", dict(api))
rows = c.get("gpu_kernels", [])
print("GPU executions:", sum(k["executions"] for k in rows), "in", len(rows), "rows")
for k in rows:
    print(f'{k["executions"]:6d} {k["total_ns"] / k["executions"] / 1e3:8.2f} us avg  {k["kernel"][:150]}')
print("status:", [g["status"] for g in c.get("gpu_times", [])], "losses:", r["losses"])
PY
