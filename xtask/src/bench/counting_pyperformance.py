# `cargo xtask bench counting`'s driver for pyperformance benchmarks (counting.rs): runs one
# benchmark's core function the way its run_benchmark.py hands it to pyperf, without pyperf's
# worker processes, so that a traced run is one process.
#
#   python DRIVER BENCHMARKS_DIR NAME MODE
#
# BENCHMARKS_DIR is pyperformance's data-files/benchmarks (its bm_NAME/run_benchmark.py imports
# pyperf: PYTHONPATH names it). MODE is `plain`, `gated:FILE` (as plain, but first prints
# `ready` and waits, blocked in open() of the FIFO FILE until it is written: a profiler attaches by pid meanwhile,
# and sees the module's import and every run) or `cprofile` (cProfile enabled around each
# timed run, and around the module's import, untimed). Prints `SECONDS` (the fastest of RUNS
# runs, each timed as pyperf times it: the workload's own timer) and, under cProfile, `CALLS`
# (the Python calls cProfile saw per run: entries other than C functions) and `FILE` lines
# (each function of run_benchmark.py cProfile saw, the module's import included: first line,
# name, calls in the whole process), to check tracer's counts against.
import importlib.util
import os
import sys
import time

RUNS = 3

bench_dir, name, mode = sys.argv[1], sys.argv[2], sys.argv[3]
path = os.path.join(bench_dir, "bm_" + name, "run_benchmark.py")
spec = importlib.util.spec_from_file_location("bm_" + name, path)
bm = importlib.util.module_from_spec(spec)
if mode.startswith("gated:"):
    print("ready", flush=True)
    # Blocked in native code (open of a FIFO, until the bench opens it to write), as an idle
    # service waits in accept or on a queue.
    with open(mode[len("gated:"):], "rb") as gate:
        gate.read()
if mode == "cprofile":
    import cProfile

    # The import too, untimed, for the FILE counts only: tracer counts the whole process,
    # the module's and its classes' bodies and what they call included.
    imported = cProfile.Profile()
    imported.enable()
    spec.loader.exec_module(bm)
    imported.disable()
else:
    spec.loader.exec_module(bm)


def timed(f, *args):
    def run():
        t = time.perf_counter()
        f(*args)
        return time.perf_counter() - t

    return run


# As each run_benchmark.py's `__main__` block calls it, one pyperf loop a run.
if name == "richards":
    run = timed(bm.Richards().run, 1)
elif name == "go":
    run = timed(bm.versus_cpu)
elif name == "deltablue":
    run = timed(bm.delta_blue, 100)
elif name == "raytrace":
    # bench_time_func: the function times itself. A quarter of pyperformance's 100×100
    # picture (the same work per pixel), to keep the traced runs short.
    def run():
        return bm.bench_raytrace(1, 50, 50, None)
else:
    sys.exit(f"unknown benchmark {name}")

if mode == "cprofile":
    p = cProfile.Profile()

    def profiled():
        p.enable()
        try:
            return run()
        finally:
            p.disable()

    times = [profiled() for _ in range(RUNS)]
    p.create_stats()
    imported.create_stats()
    # Keys are (filename, firstlineno, name); C functions have filename "~". Values start
    # (primitive calls, calls).
    calls = sum(v[1] for k, v in p.stats.items() if k[0] != "~")
    print(f"CALLS {calls // RUNS}")
    file = {}
    for stats in (imported.stats, p.stats):
        for (filename, line, func), v in stats.items():
            if os.path.realpath(filename) == os.path.realpath(path):
                file[line, func] = file.get((line, func), 0) + v[1]
    for (line, func), n in file.items():
        print(f"FILE {line} {func} {n}")
else:
    times = [run() for _ in range(RUNS)]
print(f"SECONDS {min(times):.6f}")
