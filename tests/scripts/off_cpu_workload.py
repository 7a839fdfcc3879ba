"""Wall-clock ground truth: phases of known length on the main thread, each timed by the
program itself: computing, sleeping, reading a pipe, waiting on a lock. Prints the seconds
spent in each as JSON."""
import json, os, sys, threading, time

PHASE = float(sys.argv[1]) if len(sys.argv) > 1 else 0.5
ROUNDS = int(sys.argv[2]) if len(sys.argv) > 2 else 4
took = {"compute": 0.0, "sleep": 0.0, "pipe": 0.0, "lock": 0.0}

def compute(seconds):
    end = time.perf_counter() + seconds
    n = 0
    while time.perf_counter() < end:
        n += 1
    return n

def sleep_phase(seconds):
    time.sleep(seconds)

def pipe_phase(seconds):
    r, w = os.pipe()
    t = threading.Timer(seconds, lambda: os.write(w, b"x"))
    t.start()
    os.read(r, 1)
    t.join()
    os.close(r); os.close(w)

def lock_phase(seconds):
    lock = threading.Lock()
    lock.acquire()
    t = threading.Timer(seconds, lock.release)
    t.start()
    lock.acquire()
    lock.release()
    t.join()

for _ in range(ROUNDS):
    for name, f in (("compute", compute), ("sleep", sleep_phase), ("pipe", pipe_phase), ("lock", lock_phase)):
        t0 = time.perf_counter()
        f(PHASE)
        took[name] += time.perf_counter() - t0
print(json.dumps(took))
