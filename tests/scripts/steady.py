"""A steady Python workload for live views: `busy` calls `step` in a loop for SECONDS
(argument), after printing `ready`."""
import sys
import time


def step(x):
    return (x * x + 1) % 7919


def busy(seconds):
    end = time.monotonic() + seconds
    n = 0
    while time.monotonic() < end:
        n = step(n)
    return n


print("ready", flush=True)
busy(float(sys.argv[1]))
