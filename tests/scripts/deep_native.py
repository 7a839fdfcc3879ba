"""Spins at the bottom of DEPTH nested calls, each made from C (map): every level adds the
eval loop's native frames, 24-47 KiB of C stack at 40 levels on CPython 3.10-3.15.
usage: deep_native.py DEPTH SECONDS"""
import sys
import time


def spin(seconds):
    end = time.perf_counter() + seconds
    n = 0
    while time.perf_counter() < end:
        n += 1
    return n


def nest(n, seconds):
    if n == 0:
        return spin(seconds)
    return list(map(nest, [n - 1], [seconds]))[0]


nest(int(sys.argv[1]), float(sys.argv[2]))
