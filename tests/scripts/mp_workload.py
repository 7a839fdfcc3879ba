"""Worker processes as multiprocessing and concurrent.futures make them.

usage: mp_workload.py METHOD TASKS CALLS

Runs TASKS tasks in a multiprocessing Pool of 2 and TASKS more in a ProcessPoolExecutor of 2,
both started with METHOD (fork, forkserver or spawn). Each task calls `f` CALLS times and
counts those calls with a sys.setprofile hook, the events cProfile counts; the parent prints
`PID CALLS` per worker, summed over its tasks (the ground truth, per process)."""
import multiprocessing
import os
import sys
from collections import Counter
from concurrent.futures import ProcessPoolExecutor


def f(i):
    return i + 1


def task(calls):
    n = 0
    code = f.__code__

    def hook(frame, event, arg):
        nonlocal n
        if event == "call" and frame.f_code is code:
            n += 1

    sys.setprofile(hook)
    for i in range(calls):
        f(i)
    sys.setprofile(None)
    return os.getpid(), n


def main():
    method, tasks, calls = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    ctx = multiprocessing.get_context(method)
    total = Counter()
    with ctx.Pool(2) as pool:
        for pid, n in pool.map(task, [calls] * tasks, chunksize=1):
            total[pid] += n
    with ProcessPoolExecutor(2, mp_context=ctx) as executor:
        for pid, n in executor.map(task, [calls] * tasks):
            total[pid] += n
    for pid, n in sorted(total.items()):
        print(pid, n)


if __name__ == "__main__":
    main()
