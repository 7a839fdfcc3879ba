"""A CUDA graph of 20 elementwise kernels, captured once and replayed 50 times. With
--profile, the replays run under torch.profiler, which prints how many GPU kernels it saw:
what tracer's `--gpu-times` should count for the replays, besides 50 graph launches."""
import sys

import torch

REPLAYS = 50


def main():
    x = torch.zeros(1024, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the default stream, as capture requires
        for _ in range(3):
            x.add_(1)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(10):
            x.add_(1)
            x.mul_(0.5)
    torch.cuda.synchronize()

    def replays():
        for _ in range(REPLAYS):
            graph.replay()
        torch.cuda.synchronize()

    if "--profile" in sys.argv:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            replays()
        kernels = [e for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA
                   and not e.name.startswith(("Memcpy", "Memset"))]
        print("PROFILER_KERNELS", len(kernels))
    else:
        replays()
    print("REPLAYS", REPLAYS, "value", float(x[0]))


main()
