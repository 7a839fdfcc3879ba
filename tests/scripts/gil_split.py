"""Two threads for a fixed time: `spin` runs pure Python, holding the GIL whenever it runs;
`digest` hashes 4 MiB buffers, which hashlib does without the GIL (it takes it back
between buffers)."""
import hashlib, sys, threading, time

SECONDS = float(sys.argv[1]) if len(sys.argv) > 1 else 2.0

def spin(end):
    n = 0
    while time.perf_counter() < end:
        n += 1

def digest(end):
    buf = b"x" * (4 << 20)
    while time.perf_counter() < end:
        hashlib.sha256(buf).digest()

end = time.perf_counter() + SECONDS
ts = [threading.Thread(target=f, args=(end,)) for f in (spin, digest)]
for t in ts: t.start()
for t in ts: t.join()
