"""Threads that C code makes for itself: each is a pthread started with pthread_create from
ctypes, whose start routine is a Python callback (a CFUNCTYPE), so the thread's first Python
runs under a thread state made by PyGILState_Ensure, not by the threading module. The main
thread waits in pthread_join with the GIL released, so the C threads run at once, and runs
Python of its own meanwhile. Prints the calls each function got: `CALLS {"name": n, ...}`
(the program's own account, from fib's known call counts).

With `reset`, each round first puts CPython's own frame evaluation function back, as
PyTorch's dynamo does once its frames are done, and runs some Python before the threads
start.

Usage: c_threads.py [THREADS [ROUNDS [reset]]]"""
import ctypes
import ctypes.util
import json
import sys


def fib(n):
    return n if n < 2 else fib(n - 1) + fib(n - 2)


def fib_calls(n):
    return 1 if n < 2 else 1 + fib_calls(n - 1) + fib_calls(n - 2)


def in_c_thread(_arg):
    fib(12)
    return None


ROUTINE = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)


def main():
    threads = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    routine = ROUTINE(in_c_thread)
    reset = sys.argv[3:] == ["reset"]
    for _ in range(rounds):
        if reset:
            api = ctypes.pythonapi
            api._PyInterpreterState_SetEvalFrameFunc.argtypes = [ctypes.c_void_p] * 2
            api.PyInterpreterState_Get.restype = ctypes.c_void_p
            default = ctypes.cast(api._PyEval_EvalFrameDefault, ctypes.c_void_p)
            api._PyInterpreterState_SetEvalFrameFunc(api.PyInterpreterState_Get(), default)
            fib(10)
        ids = [ctypes.c_ulong() for _ in range(threads)]
        for t in ids:
            rc = libc.pthread_create(ctypes.byref(t), None, routine, None)
            if rc != 0:
                raise OSError(rc, "pthread_create")
        fib(10)
        for t in ids:
            libc.pthread_join(t, None)
    calls = {
        "in_c_thread": threads * rounds,
        "fib": threads * rounds * fib_calls(12) + (2 if reset else 1) * rounds * fib_calls(10),
    }
    print("CALLS", json.dumps(calls, sort_keys=True), flush=True)


if __name__ == "__main__":
    main()
