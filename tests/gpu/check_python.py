"""Python call counting checked against cProfile on a machine with other interpreters (the GPU
machine's distribution python3 in a PyTorch venv). Not part of CI: run by hand, results go in
docs/GPU_VALIDATION.md.

usage: check_python.py BIN_DIR   (with the python3 to check first on PATH; as root)
Prints, per workload, how many functions were compared and every mismatch."""
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPTS = os.path.join(os.path.dirname(HERE), "scripts")
GROUND_TRUTH = os.path.join(SCRIPTS, "ground_truth.py")


def truth(mode, script, args=()):
    out = subprocess.run([sys.executable, GROUND_TRUTH, mode, script, *args],
                         capture_output=True, text=True, check=True).stdout
    line = next(l for l in out.splitlines() if l.startswith("GROUND_TRUTH "))
    return {k: (v[0], v[1]) for k, v in json.loads(line[len("GROUND_TRUTH "):]).items()}


def ours(ctl, script, args, keyed_by_file):
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "r.json")
        t = time.time()
        subprocess.run([*ctl, "start", "--mode=counting", "--python", "--format", "json", "-o",
                        out, "--", sys.executable, script, *args], check=True,
                       stdout=subprocess.DEVNULL)
        wall = time.time() - t
        rep = json.load(open(out))
    got = {}
    for f in rep["python"]["functions"]:
        name = f["qualname"].rsplit(".", 1)[-1]
        fn = f["filename"]
        if keyed_by_file:
            key = f"{fn}:{f['firstlineno']}:{name}"
        elif os.path.abspath(fn) == script:
            key = f"{f['firstlineno']}:{name}"
        else:
            continue
        n, p = got.get(key, (0, 0))
        got[key] = (n + f["ncalls"], p + (f["primitive_calls"] or 0))
    return got, rep, wall


def compare(label, want, got, keep=lambda k: True, primitive=True):
    keys = [k for k in want if keep(k)]
    bad = []
    for k in keys:
        w = want[k] if primitive else (want[k][0], None)
        g = got.get(k, (0, 0)) if primitive else (got.get(k, (0, 0))[0], None)
        if w != g:
            bad.append((k, w, g))
    extra = [k for k in got if keep(k) and k not in want]
    calls = sum(want[k][0] for k in keys)
    print(f"{label}: {len(keys)} functions, {calls} calls compared; "
          f"{len(keys) - len(bad)} equal, {len(bad)} differ, {len(extra)} only in tracer")
    for k, w, g in bad[:20]:
        print(f"  differs {k}: cProfile {w} tracer {g}")
    for k in extra[:10]:
        print(f"  only in tracer {k}: {got[k]}")
    return not bad


def main():
    # Same set iteration order in every run (sympy's fact tables depend on it).
    os.environ["PYTHONHASHSEED"] = "0"
    bins = os.path.abspath(sys.argv[1])
    state = tempfile.mkdtemp()
    sock = os.path.join(state, "s")
    log = open(os.path.join(state, "log"), "w")
    d = subprocess.Popen([os.path.join(bins, "tracerd"), "--socket", sock, "--state-dir",
                          os.path.join(state, "st")], stderr=log)
    ctl = [os.path.join(bins, "tracerctl"), "--socket", sock]
    try:
        for _ in range(100):
            if os.path.exists(sock):
                break
            time.sleep(0.1)
        caps = subprocess.run([*ctl, "capabilities"], capture_output=True, text=True).stdout
        print(caps[caps.find("Python interpreters"):])
        exe = os.path.realpath(sys.executable)
        print(f"python: {sys.version.split()[0]} {sys.executable} -> {exe}")
        subprocess.run([os.path.join(bins, "tracerd"), "--show-python-probes", exe])
        ok = True
        wl = os.path.join(SCRIPTS, "py_workload.py")
        got, rep, _ = ours(ctl, wl, [], False)
        ok &= compare("py_workload.py vs cProfile (ncalls/primitive)", truth("cprofile", wl), got)
        print("  losses:", rep["losses"], "unknown names:", rep["python"]["unknown_names"])
        got, rep, _ = ours(ctl, wl, ["threads"], False)
        ok &= compare("py_workload.py threads vs profile hook (ncalls)",
                      truth("hook", wl, ["threads"]), got, primitive=False)
        tl = os.path.join(HERE, "torch_loop.py")
        got, rep, wall = ours(ctl, tl, [], True)
        in_torch = lambda k: "/torch/" in k or k.startswith(tl + ":")
        # cProfile sees neither start-up nor exit; the hook sees exit (atexit) too.
        ok &= compare("torch_loop.py, functions in torch and the script, vs cProfile",
                      truth("cprofile-all", tl), got, in_torch)
        ok &= compare("torch_loop.py, functions in torch and the script, vs profile hook",
                      truth("hook-all", tl), got, in_torch, primitive=False)
        print(f"  traced run {wall:.1f} s; losses:", rep["losses"], "unknown names:",
              rep["python"]["unknown_names"], "warnings:", rep["python"].get("warnings"))
        print("ALL EQUAL" if ok else "MISMATCHES")
    finally:
        d.terminate()
        d.wait()
        log.close()
        print(open(os.path.join(state, "log")).read()[-3000:])


if __name__ == "__main__":
    main()
