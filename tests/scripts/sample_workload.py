"""CPU-bound work in fixed proportions: tracer's sampled shares must match py-spy's.

heavy does three units per round, medium two, light one; main() runs rounds for the number
of seconds given (default 3).
"""
import sys
import time


def spin(n):
    s = 0
    for i in range(n):
        s += i * i
    return s


# A unit runs several sampling periods (milliseconds): rounds about as long as the period
# let samples fall in step with them, which skews the shares.
def heavy():
    return spin(300_000)


def medium():
    return spin(200_000)


def light():
    return spin(100_000)


def main(seconds):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        heavy()
        medium()
        light()


if __name__ == "__main__":
    main(float(sys.argv[1]) if len(sys.argv) > 1 else 3.0)
