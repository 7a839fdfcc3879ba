"""Three threads of pure Python for 2 s each: only one holds the GIL at a time, the others
wait for it."""
import threading, time
def spin(seconds):
    end = time.perf_counter() + seconds
    n = 0
    while time.perf_counter() < end:
        n += 1
ts = [threading.Thread(target=spin, args=(2,)) for _ in range(3)]
for t in ts: t.start()
for t in ts: t.join()
