"""Forked workers busy in Python, for sampling: usage: fork_spin.py CHILDREN SECONDS

Forks CHILDREN workers; each prints its pid and spins in `child_busy` until it has had
SECONDS of CPU time (so that a loaded machine makes it run longer, not get fewer samples;
at most ten times SECONDS of wall time), while the parent waits in os.waitpid. The workers
never enter the eval loop anew: their Python frames are the parent's, continued."""
import os
import sys
import time


def step(x):
    return (x * x + 1) % 7919


def child_busy(seconds):
    end = time.process_time() + seconds
    give_up = time.monotonic() + 10 * seconds
    n = 0
    while time.process_time() < end and time.monotonic() < give_up:
        n = step(n)
    return n


def main():
    children, seconds = int(sys.argv[1]), float(sys.argv[2])
    kids = []
    for _ in range(children):
        pid = os.fork()
        if pid == 0:
            os.write(1, f"{os.getpid()}\n".encode())
            child_busy(seconds)
            os._exit(0)
        kids.append(pid)
    for k in kids:
        os.waitpid(k, 0)


if __name__ == "__main__":
    main()
