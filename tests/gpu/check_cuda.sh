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
# profiler saw it, and the two random-number kernels. The fourth turns GPU times on in the
# warm process (--gpu-times --pid), then, once the session has ended, runs torch.profiler in
# that same process: it must find CUPTI free, and both see the same kernels. The fifth
# attaches to a warm training loop (backward passes launch from autograd's threads): driver
# launches against the profiler's kernels for the same steps, and by whose call site they
# carry (none should be left without), and how many carry the name the profiler gives their
# kernel.
set -eu
BIN=$(cd "$1" && pwd)
HERE=$(cd "$(dirname "$0")" && pwd)
. "$HERE/tracerd.sh"
# attached_then_profiled SECONDS REPORT PROFILER_OUT FLAGS [WORKLOAD ARGS…]: the warm
# torch_launches.py attached with `--cuda FLAGS`, counted for SECONDS, the session stopped
# and its JSON report written to REPORT; then torch.profiler in the same process, its listing
# in PROFILER_OUT.
attached_then_profiled() {
  secs=$1 report=$2 out=$3 flags=$4
  shift 4
  rm -f "$STATE/ready" "$STATE/go" "$STATE/again"
  python3 "$HERE/torch_launches.py" "$@" --wait "$STATE/ready" "$STATE/go" "$STATE/again" \
    --then-profile > "$out" &
  work=$!
  while [ ! -e "$STATE/ready" ]; do sleep 0.1; done
  id=$($CTL start --mode=counting --cuda $flags --pid $work)
  touch "$STATE/go"
  sleep "$secs"
  $CTL stop "$id" > /dev/null
  touch "$STATE/again"
  wait $work
  $CTL report "$id" --format json -o "$report"
}
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
# The profiler saw the counted run only: the two random-number kernels are extra.
python3 "$HERE/compare_gpu_times.py" "$STATE/times.json" "$STATE/profiler" 2 "profiler + 2"
echo "== tracer --cuda --gpu-times --pid on the warm process, then torch.profiler in it"
attached_then_profiled 3 "$STATE/attached.json" "$STATE/after" --gpu-times
python3 "$HERE/compare_gpu_times.py" "$STATE/attached.json" "$STATE/after" 0 \
  "torch.profiler after it, same process"
echo "== tracer --cuda --pid on a warm training loop (backward on autograd's threads), then torch.profiler in it"
attached_then_profiled 5 "$STATE/train.json" "$STATE/train-profiler" "" --train
python3 - "$STATE/train.json" "$STATE/train-profiler" <<'PY'
import collections, json, re, sys
c = json.load(open(sys.argv[1]))["cuda"]
driver = [l for l in c["launches"] if l["api"].startswith("cuLaunch") or l["api"] == "cuGraphLaunch"]
prof, prof_names = None, set()
for line in open(sys.argv[2]):
    m = re.search(r"PROFILER_KERNELS (\d+)", line)
    if m:
        prof = int(m.group(1))
    if line.startswith("PROFILER_NAMES "):
        prof_names = set(json.loads(line.split(" ", 1)[1]))
print("driver launches:", sum(l["launches"] for l in driver), "torch.profiler kernels (same steps, after):", prof)
sites = collections.Counter()
for l in driver:
    sites[l.get("call_site_from") or ("own thread" if l.get("call_site") else "none")] += l["launches"]
print("driver launches by call site:", dict(sites))
named = collections.Counter(l.get("named_from") or "naming call" for l in driver)
print("driver rows by where their name came from:", dict(named), "unnamed rows:", c["unnamed"])
# Issue 39's goal: each launch named exactly as torch.profiler names its kernel.
kernels = [l for l in driver if l["api"] != "cuGraphLaunch"]
same = sum(l["launches"] for l in kernels if l["kernel"] in prof_names)
total = sum(l["launches"] for l in kernels)
print(f"driver launches named as torch.profiler names them: {same} of {total}"
      f" ({100 * same / max(total, 1):.1f}%)")
by_from = collections.Counter()
for l in kernels:
    if l["kernel"] not in prof_names:
        by_from[l.get("named_from") or "naming call"] += l["launches"]
print("launches named otherwise, by where their name came from:", dict(by_from))
for l in sorted((l for l in kernels if l["kernel"] not in prof_names), key=lambda l: -l["launches"])[:6]:
    print(f'  {l["launches"]:5d} {l.get("named_from") or "naming call":20s} {l["kernel"][:100]}')
for l in sorted(driver, key=lambda l: -l["launches"])[:8]:
    print(f'{l["launches"]:5d} {l["kernel"][:70]:70s} {l.get("call_site", "-")[:60]} {l.get("call_site_from", "")}')
PY
