"""Three busy threads, each in its own function: every one must be sampled."""
import sys
import threading
import time


def busy(seconds):
    end = time.monotonic() + seconds
    s = 0
    while time.monotonic() < end:
        for i in range(1000):
            s += i
    return s


def worker_a(seconds):
    return busy(seconds)


def worker_b(seconds):
    return busy(seconds)


def worker_c(seconds):
    return busy(seconds)


def main(seconds):
    threads = [threading.Thread(target=f, args=(seconds,)) for f in (worker_a, worker_b, worker_c)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


if __name__ == "__main__":
    main(float(sys.argv[1]) if len(sys.argv) > 1 else 2.0)
