#!/bin/sh
# Sampling a PyTorch program: Python frames and the C++/CUDA frames they call in one stack.
# Not part of CI: run by hand on a GPU machine, as root; results go in docs/GPU_VALIDATION.md.
# usage: check_sampling.sh BIN_DIR [SCRIPT]   (SCRIPT defaults to torch_loop.py here)
set -eu
BIN=$(cd "$1" && pwd)
HERE=$(cd "$(dirname "$0")" && pwd)
SCRIPT=${2:-$HERE/torch_loop.py}
. "$HERE/tracerd.sh"
echo "== tracer, 999 Hz, $SCRIPT"
$CTL start --mode=sampling --frequency 999 --limit 25 -- python3 "$SCRIPT" | tee "$STATE/table"
ID=$(sed -n 's/^session \([0-9a-f]*\) .*/\1/p' "$STATE/table")
$CTL report "$ID" --format folded -o "$STATE/folded"
$CTL report "$ID" --format pprof -o "$STATE/cpu.pb.gz"
echo "== heaviest stacks with a Python frame above a C++ frame (at::, c10::, torch::, cu*)"
python3 - "$STATE/folded" <<'PY'
import re, sys
rows = []
for line in open(sys.argv[1]):
    stack, n = line.rstrip("\n").rsplit(" ", 1)
    frames = stack.split(";")
    py = [i for i, f in enumerate(frames) if re.search(r"\(.*\.py:\d+\)$", f)]
    cxx = [i for i, f in enumerate(frames) if re.match(r"(at::|c10::|torch::|cu[A-Z])", f)]
    if py and cxx and max(py) < max(cxx):
        rows.append((int(n), frames))
total = sum(int(l.rsplit(" ", 1)[1]) for l in open(sys.argv[1]))
mixed = sum(n for n, _ in rows)
print(f"{mixed} of {total} samples have Python frames calling into C++/CUDA frames")
for n, frames in sorted(rows, key=lambda r: -r[0])[:5]:
    keep = [f for f in frames if re.search(r"\.py:\d+\)$", f) or re.match(r"(at::|c10::|torch::|cu[A-Z])", f)]
    print(n, " → ".join(keep[-12:]))
PY
echo "pprof written to $STATE/cpu.pb.gz (go tool pprof -top)"
