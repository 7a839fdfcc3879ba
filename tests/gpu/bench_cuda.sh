#!/bin/sh
# The PyTorch part of `cargo xtask bench cuda`, for a GPU machine with the built binaries and
# no build tree: ns per launch of tests/gpu/torch_launch_loop.py untraced, under
# `--mode=counting --cuda` (the default: launches counted in-process, through CUPTI's
# callbacks) and under `--mode=counting --cuda --cuda-uprobes-only` (the launch probes), and
# the same two in tracing mode (the default stamps each launch into the library's ring),
# attached before its timed rounds, RUNS runs of each, interleaved.
# Not part of CI: run by hand as root; results go in docs/GPU_VALIDATION.md.
# usage: bench_cuda.sh BIN_DIR [N=20000] [ROUNDS=3] [RUNS=3]
#        (START_ARGS=--cuda-driver-only adds arguments to the session's start)
set -eu
BIN=$(cd "$1" && pwd)
N=${2:-20000}
ROUNDS=${3:-3}
RUNS=${4:-3}
HERE=$(cd "$(dirname "$0")" && pwd)
. "$HERE/tracerd.sh"

# One run: prints the median round's ns per launch (and the session's counts when traced).
run() {
  mkfifo "$STATE/in"
  python3 "$HERE/torch_launch_loop.py" "$N" "$ROUNDS" <"$STATE/in" >"$STATE/out" &
  LOOP=$!
  exec 3>"$STATE/in"
  while ! grep -q ready "$STATE/out" 2>/dev/null; do sleep 0.1; done
  ID=
  case "$1" in
  counting) ID=$($CTL start --mode=counting --cuda ${START_ARGS:-} --pid $LOOP) ;;
  probes) ID=$($CTL start --mode=counting --cuda --cuda-uprobes-only ${START_ARGS:-} --pid $LOOP) ;;
  tracing) ID=$($CTL start --mode=tracing --cuda ${START_ARGS:-} --pid $LOOP) ;;
  tr-probes) ID=$($CTL start --mode=tracing --cuda --cuda-uprobes-only ${START_ARGS:-} --pid $LOOP) ;;
  esac
  [ -z "$ID" ] || sleep 1
  echo go >&3
  wait $LOOP
  exec 3>&-
  rm "$STATE/in"
  NS=$(sed -n 's/^SECONDS //p' "$STATE/out" | sort -n | awk -v n="$N" '{ t[NR] = $1 } END { printf "%.0f", t[int((NR + 1) / 2)] / n * 1e9 }')
  COUNTS=
  if [ -n "$ID" ]; then
    report_when_ended "$ID" --format json -o "$STATE/r.json"
    COUNTS=$(python3 - "$STATE/r.json" <<'PY'
import json, sys
report = json.load(open(sys.argv[1]))
r = report["cuda"]
c = r["launches"]
rt = sum(l["launches"] for l in c if l["api"].startswith("cuda") and "Graph" not in l["api"])
dr = sum(l["launches"] for l in c if not l["api"].startswith("cuda") and "Graph" not in l["api"])
way = ",".join(w["way"] for w in r.get("launch_counting", [])) or "probes"
trace = report.get("trace") or {}
events = f" events {trace['cuda_events']}" if "cuda_events" in trace else ""
lost = sum(l["count"] for l in report.get("losses", []))
print(f"runtime {rt} driver {dr} ({way}){events} lost {lost}")
PY
)
  fi
  echo "$1 $NS $COUNTS"
}

echo "torch_launch_loop.py $N x $ROUNDS rounds, $RUNS runs each; ns per x.add_(1) (median round)"
for i in $(seq "$RUNS"); do
  run untraced
  run counting
  run probes
  run tracing
  run tr-probes
done | tee "$STATE/runs"
median() {
  awk -v c="$1" '$1 == c { print $2 }' "$STATE/runs" | sort -n | awk '{ v[NR] = $1 } END { print v[int((NR + 1) / 2)] }'
}
U=$(median untraced)
C=$(median counting)
P=$(median probes)
T=$(median tracing)
TP=$(median tr-probes)
echo "median: untraced $U ns; counting (default, in-process) $C ns: $((C - U)) ns added per launch;"
echo "        counting with the launch probes $P ns: $((P - U)) ns added per launch;"
echo "        tracing (default, in-process) $T ns: $((T - U)) ns added per launch;"
echo "        tracing with the launch probes $TP ns: $((TP - U)) ns added per launch"
