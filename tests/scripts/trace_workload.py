"""A workload that waits for its cue: prints "ready", reads a line from stdin, calls `tick`
N times (argv[1]) and `os.getpid` M times (argv[2], default 0), prints "done", then waits
for stdin to close before exiting. Tests start sessions and watchers before the cue, so
they know exactly which calls happen while they look."""
import os
import sys


def tick(i):
    return i + 1


def main():
    n = int(sys.argv[1])
    m = int(sys.argv[2]) if len(sys.argv) > 2 else 0
    print("ready", flush=True)
    sys.stdin.readline()
    for i in range(n):
        tick(i)
    for _ in range(m):
        os.getpid()
    print("done", flush=True)
    sys.stdin.read()


main()
