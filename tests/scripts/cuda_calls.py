"""Launches through a CUDA runtime library (argv[1]) with ctypes, from a known line: prints
"loaded" once the library is mapped, waits for a line on stdin, calls cudaLaunchKernel
argv[2] times from launch() (and argv[3] times, default 0, from warm_up() first; with the
driver's library, cuLaunchKernel), prints
"done", then waits for stdin to close. With argv[4] "fork", a forked child makes the
launches and prints "child PID" first; the parent makes none. tracer's CUDA report must name launch() and that line
as the launches' Python call site. With argv[4] "thread", argv[2] launches (grid 3, block 8)
are made instead by a thread that runs no Python (libworker_launch.so, beside the library)
while on_a_thread() waits for it: the report must name on_a_thread() and its line, as the
frame of the thread that launched from Python last (warm_up's), or else of the thread that
last held the GIL. "thread-busy" is "thread" with another Python thread spinning meanwhile,
which holds the GIL whenever it can. With CUDA_CALLS_INIT=1 in the environment, CUDA is
initialized (cudaDeviceSynchronize, which maps the driver) before "loaded"."""
import ctypes
import os
import sys
import threading

# A driver library (libcuda.so*) is called through cuLaunchKernel instead.
DRIVER = os.path.basename(sys.argv[1]).startswith("libcuda.so")


class Dim3(ctypes.Structure):
    _fields_ = [("x", ctypes.c_uint), ("y", ctypes.c_uint), ("z", ctypes.c_uint)]


def launch(rt, n):
    for _ in range(n):
        if DRIVER:
            rt.cuLaunchKernel(ctypes.c_void_p(0x1234), 2, 3, 4, 5, 6, 7, 64, None, None, None)
        else:
            rt.cudaLaunchKernel(ctypes.c_void_p(0x1234), Dim3(2, 3, 4), Dim3(5, 6, 7), None, ctypes.c_size_t(64), None)  # the call site


def on_a_thread(rt, n):
    worker = ctypes.CDLL(os.path.join(os.path.dirname(sys.argv[1]), "libworker_launch.so"))
    entry = worker.driver_launch_on_a_thread if DRIVER else worker.launch_on_a_thread
    entry.argtypes = [ctypes.c_void_p, ctypes.c_int]
    launch_fn = ctypes.cast(rt.cuLaunchKernel if DRIVER else rt.cudaLaunchKernel, ctypes.c_void_p)
    entry(launch_fn, n)  # the thread's call site


def spin(done):
    while not done.is_set():
        sum(range(100))


def warm_up(rt, n):
    for _ in range(n):
        if DRIVER:
            rt.cuLaunchKernel(ctypes.c_void_p(0x1234), 1, 1, 1, 1, 1, 1, 0, None, None, None)
        else:
            rt.cudaLaunchKernel(ctypes.c_void_p(0x1234), Dim3(1, 1, 1), Dim3(1, 1, 1), None, ctypes.c_size_t(0), None)


def main():
    rt = ctypes.CDLL(sys.argv[1])
    if os.environ.get("CUDA_CALLS_INIT") == "1" and not DRIVER:
        rt.cudaDeviceSynchronize()
    print("loaded", flush=True)
    sys.stdin.readline()
    mode = sys.argv[4] if len(sys.argv) > 4 else ""
    fork = mode == "fork"
    kid = os.fork() if fork else 0
    if kid == 0:
        warm_up(rt, int(sys.argv[3]) if len(sys.argv) > 3 else 0)
        if mode in ("thread", "thread-busy"):
            done = threading.Event()
            if mode == "thread-busy":
                spinner = threading.Thread(target=spin, args=(done,))
                spinner.start()
            on_a_thread(rt, int(sys.argv[2]))
            done.set()
            if mode == "thread-busy":
                spinner.join()
        else:
            launch(rt, int(sys.argv[2]))
        if fork:
            print("child", os.getpid(), flush=True)
            os._exit(0)
    else:
        os.waitpid(kid, 0)
    print("done", flush=True)
    sys.stdin.read()


main()
