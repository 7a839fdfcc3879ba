"""Ground truth for tracer's Python call counts, from CPython's own profilers.

usage: ground_truth.py cprofile|cprofile-all|cprofile-callers|hook|hook-all SCRIPT [ARGS...]

cprofile: runs SCRIPT under cProfile (main thread, as `python -m cProfile` does).
cprofile-all: the same, for every Python function that ran (keyed "file:line:name").
cprofile-callers: for the functions defined in SCRIPT, their callers as cProfile records
      them: {"line:name": {"file:line:name": [ncalls, primitive calls]}} (file "~" for C).
hook: counts the 'call' events of sys.setprofile in every thread (threading.setprofile),
      the events cProfile counts, for scripts that start threads.
hook-all: the hook, for every Python function, left on until the atexit handlers have run.
Prints {"line:name": [ncalls, primitive calls, tottime s, cumtime s]} for the functions
defined in SCRIPT, as JSON (hook mode: primitive calls and times are null).

The hook modes import only what they need before the script runs: a module imported here
(pstats pulls in dataclasses, enum, typing…) can fill caches that the script would otherwise
fill itself, and then the script makes fewer calls than it does alone."""
import atexit
import os
import runpy
import sys
import threading
from collections import Counter


def main():
    mode, script = sys.argv[1], os.path.abspath(sys.argv[2])
    sys.argv = [script] + sys.argv[3:]
    out = {}
    if mode in ("cprofile", "cprofile-all", "cprofile-callers"):
        import cProfile
        import pstats
        prof = cProfile.Profile()
        prof.enable()
        try:
            runpy.run_path(script, run_name="__main__")
        finally:
            prof.disable()
        for (filename, line, name), (cc, nc, tt, ct, callers) in pstats.Stats(prof).stats.items():
            if mode == "cprofile-callers":
                if os.path.abspath(filename) == script:
                    out[f"{line}:{name}"] = {
                        f"{f}:{l}:{n}": [v[0], v[1]] for (f, l, n), v in callers.items()}
            elif mode == "cprofile-all" and not filename.startswith(("~", "<")):
                out[f"{filename}:{line}:{name}"] = [nc, cc, tt, ct]
            elif os.path.abspath(filename) == script:
                out[f"{line}:{name}"] = [nc, cc, tt, ct]
    else:
        counts = Counter()
        lock = threading.Lock()

        def hook(frame, event, arg):
            if event == "call":
                code = frame.f_code
                with lock:
                    counts[(code.co_filename, code.co_firstlineno, code.co_name)] += 1

        def report():
            import json
            for (filename, line, name), n in list(counts.items()):
                if mode == "hook-all" and not filename.startswith("<"):
                    out[f"{filename}:{line}:{name}"] = [n, None, None, None]
                elif os.path.abspath(filename) == script:
                    out[f"{line}:{name}"] = [n, None, None, None]
            print("GROUND_TRUTH " + json.dumps(out, sort_keys=True), flush=True)

        threading.setprofile(hook)
        sys.setprofile(hook)
        if mode == "hook-all":
            # Registered first, run last: the script's own atexit handlers are counted.
            atexit.register(report)
            runpy.run_path(script, run_name="__main__")
            return
        try:
            runpy.run_path(script, run_name="__main__")
        finally:
            sys.setprofile(None)
            threading.setprofile(None)
        report()
        return
    import json
    sys.stdout.flush()
    print("GROUND_TRUTH " + json.dumps(out, sort_keys=True))


if __name__ == "__main__":
    main()
