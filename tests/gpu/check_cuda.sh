#!/bin/sh
# `--cuda` on a PyTorch program, next to torch.profiler's kernel list for the same work.
# Not part of CI: run by hand on a GPU machine, as root; results go in docs/GPU_VALIDATION.md.
# usage: check_cuda.sh BIN_DIR
# The first run follows the program from its start, so the kernels loaded during the warm-up are
# named; without --profile the program runs `work` once, so its counts are the profiler's plus
# the two random-number kernels that set up the inputs.
# The second attaches to the warm process with --cuda-stacks: its kernels were named before
# tracer came, so the runtime rows are named from symbols; the stacks show where launches
# come from. The third starts the program with --gpu-times (CUPTI through tracer's injection
# library): GPU time per kernel, next to the profiler's: each kernel as often as the
# profiler saw it, and the two random-number kernels.
set -eu
BIN=$(cd "$1" && pwd)
HERE=$(cd "$(dirname "$0")" && pwd)
. "$HERE/tracerd.sh"
echo "== torch.profiler (the counted run)"
python3 "$HERE/torch_launches.py" --profile | tee "$STATE/profiler" | head -30
echo "== tracer --cuda, the whole program (warm-up and counted run)"
$CTL start --mode=counting --cuda --limit 40 -- python3 "$HERE/torch_launches.py" | tee "$STATE/table"
ID=$(sed -n 's/^session \([0-9a-f]*\) .*/\1/p' "$STATE/table")
$CTL report "$ID" --format json -o "$STATE/report.json"
python3 - "$STATE/report.json" <<'PY'
import collections, json, sys
c = json.load(open(sys.argv[1]))["cuda"]
per = collections.Counter()
for l in c["launches"]:
    layer = "driver" if l["api"].startswith("cu") and not l["api"].startswith("cuda") else "runtime"
    per[layer] += l["launches"]
print("launches per layer:", dict(per), "rows without a name:", c["unnamed"])
PY
echo "== tracer --cuda --cuda-stacks attached to the warm process (kernels named before it)"
python3 "$HERE/torch_launches.py" --wait "$STATE/ready" "$STATE/go" &
WORK=$!
while [ ! -e "$STATE/ready" ]; do sleep 0.1; done
ID=$($CTL start --mode=counting --cuda --cuda-stacks --pid $WORK)
sleep 1
touch "$STATE/go"
wait $WORK
report_when_ended "$ID" --format kernels --limit 30
$CTL report "$ID" --format json -o "$STATE/warm.json"
python3 - "$STATE/warm.json" <<'PY'
import collections, json, sys
r = json.load(open(sys.argv[1]))
c = r["cuda"]
named = collections.Counter(l.get("named_from", "naming call") for l in c["launches"])
print("rows by where their name came from:", dict(named), "unnamed rows:", c["unnamed"])
print("launch stacks:", sum(s["count"] for s in r["profile"]["stacks"]), "losses:", r["losses"])
# Call sites (issue 39): launches by whose Python line they carry; none should be left without.
sites = collections.Counter()
for l in c["launches"]:
    sites[l.get("call_site_from") or ("own thread" if l.get("call_site") else "none")] += l["launches"]
print("launches by call site:", dict(sites))
PY
$CTL report "$ID" --format folded | sort -t' ' -k2 -nr | head -5 | cut -c1-400
echo "-- launch stacks of threads without Python (their Python frames: the thread they work for)"
$CTL report "$ID" --format folded | grep -F '[a thread without Python' | sort -t' ' -k2 -nr | head -3 | cut -c1-600
echo "== tracer --cuda --gpu-times, the whole program (warm-up and counted run)"
$CTL start --mode=counting --cuda --gpu-times --format json -o "$STATE/times.json" \
  -- python3 "$HERE/torch_launches.py"
$CTL report "$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["session"]["id"])' "$STATE/times.json")" \
  --format kernels --limit 20 | sed -n '/GPU kernel times/,$p'
python3 - "$STATE/times.json" "$STATE/profiler" <<'PY'
import json, re, sys
c = json.load(open(sys.argv[1]))["cuda"]
print("status:", [g["status"] for g in c.get("gpu_times", [])])
ours = {}
for k in c.get("gpu_kernels", []):
    n, ns = ours.get(k["kernel"], (0, 0))
    ours[k["kernel"]] = (n + k["executions"], ns + k["total_ns"])
prof = {}
for line in open(sys.argv[2]):
    m = re.match(r"\s+(\d+)\s+([\d.]+)\s+(.*)$", line)
    if m:
        prof[m.group(3)] = (int(m.group(1)), float(m.group(2)))
print("executions: tracer", sum(n for n, _ in ours.values()), "profiler + 2", 2 + sum(n for n, _ in prof.values()))
for name, (n, ns) in sorted(ours.items(), key=lambda kv: -kv[1][1])[:15]:
    p = prof.get(name[:110])
    pavg = f"{p[1] / p[0]:9.2f}" if p else "        -"
    print(f"{n:6d} {ns / n / 1e3:9.2f} us avg | profiler {p[0] if p else '-':>5} {pavg} us avg  {name[:90]}")
PY
