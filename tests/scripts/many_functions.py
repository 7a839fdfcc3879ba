"""Calls each of N generated functions (argv[1]) over and over, until killed.

For what a session with very many functions costs: every function lives in "generated.py".
"""
import sys

n = int(sys.argv[1])
src = "".join(f"def f{i}(x):\n    return x\n" for i in range(n))
ns = {}
exec(compile(src, "generated.py", "exec"), ns)
fs = [ns[f"f{i}"] for i in range(n)]
print("ready", flush=True)
while True:
    for f in fs:
        f(0)
