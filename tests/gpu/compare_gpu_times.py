"""Prints a tracer report's GPU time per kernel next to torch_launches.py's profiler listing.
usage: compare_gpu_times.py REPORT_JSON PROFILER_OUTPUT EXTRA LABEL
EXTRA: kernels tracer is expected to see beyond the profiler's (added to its count);
LABEL: what the profiler's count is called in the output."""
import json
import re
import sys

report, listing, extra, label = sys.argv[1:5]
c = json.load(open(report))["cuda"]
print("status:", [g["status"] for g in c.get("gpu_times", [])])
ours = {}
for k in c.get("gpu_kernels", []):
    n, ns = ours.get(k["kernel"], (0, 0))
    ours[k["kernel"]] = (n + k["executions"], ns + k["total_ns"])
prof = {}
for line in open(listing):
    m = re.match(r"\s+(\d+)\s+([\d.]+)\s+(.*)$", line)
    if m:
        prof[m.group(3)] = (int(m.group(1)), float(m.group(2)))
print("executions: tracer", sum(n for n, _ in ours.values()), label,
      int(extra) + sum(n for n, _ in prof.values()))
for name, (n, ns) in sorted(ours.items(), key=lambda kv: -kv[1][1])[:15]:
    p = prof.get(name[:110])
    pavg = f"{p[1] / p[0]:9.2f}" if p else "        -"
    print(f"{n:6d} {ns / n / 1e3:9.2f} us avg | profiler {p[0] if p else '-':>5} {pavg} us avg  {name[:90]}")
