"""launch_loop (tests/cuda/launch_loop.c) run from Python, for `cargo xtask bench cuda`: the
same launches, each made under this file's main() frame, which tracer reads at every launch
for its Python call site. The C loop does the rest (its cue, timing and output).
usage: launch_loop.py LIBLAUNCH_LOOP_SO [N] [ROUNDS]"""
import ctypes
import sys


def main():
    lib = ctypes.CDLL(sys.argv[1])
    args = [b"launch_loop"] + [a.encode() for a in sys.argv[2:]]
    argv = (ctypes.c_char_p * len(args))(*args)
    return lib.launch_loop_main(len(args), argv)  # every launch's call site


sys.exit(main())
