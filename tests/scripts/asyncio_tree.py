"""A known tree of asyncio tasks for task-stack sampling: Task-1 (main) awaits the task
"middle", which awaits leaf-a and leaf-b through a coroutine of its own (`both`, gathering
them). The leaves compute in turns, leaf-a twice as long as leaf-b; the program times
itself and prints each leaf's share at the end. Prints "ready" once the tree stands.
With `block`, the leaves block the loop in `time.sleep` instead of computing. With `tree`,
each leaf then prints its chain as the program itself sees it (for interpreters without
`python -m asyncio pstree`): "chain leaf-a: [task: Task-1];main (/…/asyncio_tree.py:N);…".

Usage: asyncio_tree.py SECONDS [block] [tree]
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


work = block if "block" in sys.argv[2:] else spin


def awaiter(task):
    """The task awaiting `task`: the one whose awaited future is it, or a `gather` of it."""
    for t in asyncio.all_tasks():
        waiter = t._fut_waiter
        if waiter is task or task in getattr(waiter, "_children", ()):
            return t
    return None


def chain(task):
    """`task`'s chain, root first: each task awaiting the one before, with the coroutines
    where it awaits (the running task's own frames are not part of it)."""
    groups = [[f"[task: {task.get_name()}]"]]
    task = awaiter(task)
    while task is not None:
        group = [f"[task: {task.get_name()}]"]
        coro = task.get_coro()
        while getattr(coro, "cr_frame", None) is not None:
            code = coro.cr_code
            group.append(f"{code.co_qualname} ({code.co_filename}:{coro.cr_frame.f_lineno})")
            coro = coro.cr_await
        groups.append(group)
        task = awaiter(task)
    return [label for group in reversed(groups) for label in group]


async def leaf(name, sec, until):
    told = "tree" not in sys.argv[2:]
    while time.monotonic() < until:
        work(name, sec)
        await asyncio.sleep(0)
        if not told:
            told = True
            print(f"chain {name}: " + ";".join(chain(asyncio.current_task())), flush=True)


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
