"""A launch-bound PyTorch loop for `cargo xtask bench cuda` and tests/gpu/bench_cuda.sh:
small in-place adds on a CUDA tensor, one elementwise kernel launch each, far shorter on the
GPU than its launch. CUDA is initialised (and its libraries mapped) before it prints "ready";
it waits for a line, then prints `SECONDS s` per round of N adds and `LAUNCHES n`.
usage: torch_launch_loop.py N ROUNDS"""
import sys
import time

import torch

n, rounds = int(sys.argv[1]), int(sys.argv[2])
x = torch.zeros(1024, device="cuda")
for _ in range(1000):
    x.add_(1)
torch.cuda.synchronize()
print("ready", flush=True)
sys.stdin.readline()
for _ in range(rounds):
    t = time.perf_counter()
    for _ in range(n):
        x.add_(1)
    torch.cuda.synchronize()
    print(f"SECONDS {time.perf_counter() - t:.6f}", flush=True)
print(f"LAUNCHES {n * rounds}", flush=True)
