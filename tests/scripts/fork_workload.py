"""Forked Python workers, as multiprocessing's fork start method, pre-fork servers and
DataLoader workers make them.

usage: fork_workload.py CHILDREN CALLS DEPTH [WAIT_S]

Says `ready` and waits WAIT_S seconds (for a tracer to attach), then forks CHILDREN workers; each calls `f`
CALLS times in its main thread and CALLS times in a thread it starts, forks one worker of its
own while DEPTH allows (children of children), and waits for it. Every process counts its own calls of `f` with a sys.setprofile hook, the
events cProfile counts, and prints `PID CALLS` (the ground truth, per process)."""
import os
import sys
import threading
import time


def f(i):
    return i + 1


def work(calls):
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
    return n


def worker(calls, depth):
    # A thread born in the child: its thread state is new, not the forking thread's.
    in_thread = []
    t = threading.Thread(target=lambda: in_thread.append(work(calls)))
    t.start()
    n = work(calls)
    t.join()
    n += in_thread[0]
    kid = os.fork() if depth > 1 else -1
    if kid == 0:
        worker(calls, depth - 1)
    os.write(1, f"{os.getpid()} {n}\n".encode())
    if kid > 0:
        os.waitpid(kid, 0)
    os._exit(0)


def main():
    children, calls, depth = (int(a) for a in sys.argv[1:4])
    if len(sys.argv) > 4:
        print("ready", flush=True)
        time.sleep(float(sys.argv[4]))
    kids = []
    for _ in range(children):
        pid = os.fork()
        if pid == 0:
            worker(calls, depth)
        kids.append(pid)
    for k in kids:
        os.waitpid(k, 0)


if __name__ == "__main__":
    main()
