"""Ground truth for tracer's Python call counts, from CPython's own profilers.

usage: ground_truth.py cprofile|hook SCRIPT [ARGS...]

cprofile: runs SCRIPT under cProfile (main thread, as `python -m cProfile` does).
hook: counts the 'call' events of sys.setprofile in every thread (threading.setprofile),
      the events cProfile counts, for scripts that start threads.
Prints {"line:name": [ncalls, primitive calls, tottime s, cumtime s]} for the functions
defined in SCRIPT, as JSON (hook mode: primitive calls and times are null)."""
import cProfile
import json
import os
import pstats
import runpy
import sys
import threading
from collections import Counter


def main():
    mode, script = sys.argv[1], os.path.abspath(sys.argv[2])
    sys.argv = [script] + sys.argv[3:]
    out = {}
    if mode == "cprofile":
        prof = cProfile.Profile()
        prof.enable()
        try:
            runpy.run_path(script, run_name="__main__")
        finally:
            prof.disable()
        for (filename, line, name), (cc, nc, tt, ct, callers) in pstats.Stats(prof).stats.items():
            if os.path.abspath(filename) == script:
                out[f"{line}:{name}"] = [nc, cc, tt, ct]
    else:
        counts = Counter()
        lock = threading.Lock()

        def hook(frame, event, arg):
            if event == "call":
                code = frame.f_code
                with lock:
                    counts[(code.co_filename, code.co_firstlineno, code.co_name)] += 1

        threading.setprofile(hook)
        sys.setprofile(hook)
        try:
            runpy.run_path(script, run_name="__main__")
        finally:
            sys.setprofile(None)
            threading.setprofile(None)
        for (filename, line, name), n in counts.items():
            if os.path.abspath(filename) == script:
                out[f"{line}:{name}"] = [n, None, None, None]
    sys.stdout.flush()
    print("GROUND_TRUTH " + json.dumps(out, sort_keys=True))


if __name__ == "__main__":
    main()
