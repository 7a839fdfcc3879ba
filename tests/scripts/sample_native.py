"""A C extension doing the work: zlib's deflate must show up under compress_loop."""
import sys
import time
import zlib

DATA = bytes(range(256)) * 4096


def compress_loop(seconds):
    end = time.monotonic() + seconds
    n = 0
    while time.monotonic() < end:
        n += len(zlib.compress(DATA, 9))
    return n


def main(seconds):
    compress_loop(seconds)


if __name__ == "__main__":
    main(float(sys.argv[1]) if len(sys.argv) > 1 else 2.0)
