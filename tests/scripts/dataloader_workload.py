"""PyTorch DataLoader workers on CPU tensors: usage: dataloader_workload.py ITEMS CALLS [METHOD]

A DataLoader with 4 workers (started with METHOD, default fork) reads ITEMS items; reading one
calls `f` CALLS times and counts those calls with a sys.setprofile hook, the events cProfile
counts. The parent prints `PID CALLS` per worker, summed over its items (the ground truth, per
process)."""
import os
import sys
from collections import Counter

import torch
from torch.utils.data import DataLoader, Dataset


def f(i):
    return i + 1


class Items(Dataset):
    def __init__(self, items, calls):
        self.items, self.calls = items, calls

    def __len__(self):
        return self.items

    def __getitem__(self, index):
        n = 0
        code = f.__code__

        def hook(frame, event, arg):
            nonlocal n
            if event == "call" and frame.f_code is code:
                n += 1

        sys.setprofile(hook)
        for i in range(self.calls):
            f(i)
        sys.setprofile(None)
        return os.getpid(), n, torch.full((8,), float(index))


def main():
    items, calls = int(sys.argv[1]), int(sys.argv[2])
    method = sys.argv[3] if len(sys.argv) > 3 else "fork"
    loader = DataLoader(
        Items(items, calls), batch_size=None, num_workers=4, multiprocessing_context=method
    )
    total = Counter()
    seen = 0.0
    for pid, n, tensor in loader:
        total[pid] += n
        seen += float(tensor.sum())
    assert seen == 8 * sum(range(items)), seen
    for pid, n in sorted(total.items()):
        print(pid, n)


if __name__ == "__main__":
    main()
