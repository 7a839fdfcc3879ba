"""Two functions that take turns, each for exactly half of a period given in milliseconds,
on an absolute schedule: a loop in step with the sampler's period. Samples taken at an
exact period would fall at the same point of the loop each time, in one function nearly
always; the truth is half each.

Usage: in_step.py PERIOD_MS SECONDS
"""
import sys
import time


def spin_until(deadline):
    while time.monotonic() < deadline:
        pass


def first(deadline):
    spin_until(deadline)


def second(deadline):
    spin_until(deadline)


def main(period_ms, seconds):
    half = period_ms / 2000.0
    t = time.monotonic()
    end = t + seconds
    while t < end:
        first(t + half)
        second(t + 2 * half)
        t += 2 * half


if __name__ == "__main__":
    main(float(sys.argv[1]), float(sys.argv[2]))
