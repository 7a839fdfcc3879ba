"""A known tree of asyncio tasks for task-stack sampling: Task-1 (main) awaits the task
"middle", which awaits leaf-a and leaf-b through a coroutine of its own (`both`, gathering
them). The leaves compute in turns, leaf-a twice as long as leaf-b; the program times
itself and prints each leaf's share at the end. Prints "ready" once the tree stands.
With `block`, the leaves block the loop in `time.sleep` instead of computing.

Usage: asyncio_tree.py SECONDS [block]
"""

import asyncio
import sys
import time

spent = {"leaf-a": 0.0, "leaf-b": 0.0}


def spin(name, sec):
    t = time.perf_counter()
    while time.perf_counter() - t < sec:
        pass
    spent[name] += time.perf_counter() - t


def block(name, sec):
    t = time.perf_counter()
    time.sleep(sec)
    spent[name] += time.perf_counter() - t


work = block if sys.argv[2:] == ["block"] else spin


async def leaf(name, sec, until):
    while time.monotonic() < until:
        work(name, sec)
        await asyncio.sleep(0)


async def both(a, b):
    await asyncio.gather(a, b)


async def middle(until):
    a = asyncio.create_task(leaf("leaf-a", 0.002, until), name="leaf-a")
    b = asyncio.create_task(leaf("leaf-b", 0.001, until), name="leaf-b")
    print("ready", flush=True)
    await both(a, b)


async def main(seconds):
    until = time.monotonic() + seconds
    await asyncio.create_task(middle(until), name="middle")
    total = sum(spent.values())
    print(f"leaf-a {spent['leaf-a'] / total:.4f}", flush=True)


asyncio.run(main(float(sys.argv[1])))
