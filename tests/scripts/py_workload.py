"""Deterministic Python workload covering what a call counter must get right. Every function
here is called a fixed number of times; tests compare tracer's counts with cProfile's."""
import asyncio
import sys
import threading


def fib(n):
    return n if n < 2 else fib(n - 1) + fib(n - 2)


def squares(n):
    for i in range(n):
        yield i * i


def abandoned():
    # Closed after its first item: close() throws GeneratorExit into the suspended frame.
    yield 1
    yield 2


class Shape:
    def __init__(self, side):
        self.side = side

    @property
    def area(self):
        return self.side * self.side

    def scaled(self, k):
        return Shape(self.side * k)


def fail(depth):
    if depth == 0:
        raise ValueError("bottom")
    return fail(depth - 1)


def deep(n):
    # Deeper than a small shadow stack: importing PyTorch nests over 100 frames.
    return 0 if n == 0 else deep(n - 1) + 1


def catch():
    caught = 0
    for _ in range(10):
        try:
            fail(5)
        except ValueError:
            caught += 1
    return caught


async def leaf(i):
    await asyncio.sleep(0)
    return i


async def gather_all():
    return sum(await asyncio.gather(*(leaf(i) for i in range(20))))


def key_of(x):
    return -x


def double(x):
    return 2 * x


def comprehensions():
    a = [x * 2 for x in range(50)]
    b = {x: x for x in range(10)}
    c = sum(x for x in range(30))
    return len(a) + len(b) + c


def callbacks():
    s = sorted(range(200), key=key_of)
    m = list(map(double, range(150)))
    f = list(filter(lambda v: v % 3 == 0, range(90)))
    return len(s) + len(m) + len(f)


def thread_work(n):
    return sum(fib(10) for _ in range(n))


def threads():
    ts = [threading.Thread(target=thread_work, args=(5,)) for _ in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()


def main():
    fib(18)
    total = sum(squares(300))
    g = abandoned()
    next(g)
    g.close()
    shapes = [Shape(i).scaled(2) for i in range(40)]
    total += sum(s.area for s in shapes)
    total += catch()
    total += deep(200)
    total += asyncio.run(gather_all())
    total += comprehensions() + callbacks()
    if "threads" in sys.argv:
        threads()
    print(total)


if __name__ == "__main__":
    main()
