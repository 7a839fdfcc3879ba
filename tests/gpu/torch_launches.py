"""CUDA work whose kernel count torch.profiler gives: 100 x (matmul, relu, div) and 20
convolutions, after a warm-up outside the count. With --profile, runs the counted part under
torch.profiler and prints the number of GPU kernels it saw, and per kernel name its count and
GPU time. With --wait READY GO [AGAIN] --then-profile: warm, counted once when GO appears,
then profiled once more in the same process when AGAIN appears (after a tracer session on it
has ended). With --train, the counted part is three training steps instead (a transformer
encoder layer, a loss, loss.backward() on autograd's own threads, AdamW): launches made on
threads that run no Python, whose call sites are the line that called backward()."""
import sys

import torch


def work(a, x, conv):
    for _ in range(100):
        b = torch.relu(a @ a) / 2
    for _ in range(20):
        y = conv(x)
    torch.cuda.synchronize()
    return b, y


def train(model, opt, batch):
    for _ in range(3):
        opt.zero_grad(set_to_none=True)
        loss = model(batch).pow(2).mean()
        loss.backward()  # the backward pass launches from autograd's device threads
        opt.step()
    torch.cuda.synchronize()
    return loss


def main():
    torch.manual_seed(0)
    a = torch.randn(512, 512, device="cuda")
    x = torch.randn(8, 3, 64, 64, device="cuda")
    conv = torch.nn.Conv2d(3, 16, 3).cuda()
    torch.backends.cudnn.benchmark = False
    if "--train" in sys.argv:
        model = torch.nn.Sequential(
            torch.nn.TransformerEncoderLayer(256, 4, 1024, batch_first=True),
            torch.nn.Linear(256, 256),
        ).cuda()
        opt = torch.optim.AdamW(model.parameters())
        batch = torch.randn(16, 64, 256, device="cuda")
        counted = lambda: train(model, opt, batch)  # noqa: E731
    else:
        counted = lambda: work(a, x, conv)  # noqa: E731
    counted()  # warm-up: library loading, cuBLAS/cuDNN handles, autotuning
    if "--wait" in sys.argv:
        # Warm: tell the runner, wait until a session is attached, then do the counted part;
        # with --then-profile, wait for a third file and profile it once more.
        import os
        import time
        ready, go, *again = sys.argv[sys.argv.index("--wait") + 1:][:3]
        open(ready, "w").close()
        while not os.path.exists(go):
            time.sleep(0.01)
        counted()
        if "--then-profile" not in sys.argv:
            return
        while not os.path.exists(again[0]):
            time.sleep(0.01)
    if "--profile" in sys.argv or "--then-profile" in sys.argv:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            counted()
        kernels = [e for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA
                   and not e.name.startswith(("Memcpy", "Memset"))]
        print("PROFILER_KERNELS", len(kernels))
        import json
        # Full names, for check_cuda.sh's comparison of tracer's names with the profiler's.
        print("PROFILER_NAMES", json.dumps(sorted({k.name for k in kernels})))
        names = {}
        for k in kernels:
            n, us = names.get(k.name, (0, 0.0))
            names[k.name] = (n + 1, us + k.time_range.elapsed_us())
        # count, GPU time in µs, name: what tracer's --gpu-times table is compared with.
        for n, (c, us) in sorted(names.items(), key=lambda kv: -kv[1][1]):
            print(f"  {c:5d} {us:12.1f}  {n[:110]}")


main()
