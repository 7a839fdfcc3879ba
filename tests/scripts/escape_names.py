"""A program whose function name is a terminal escape: its code object is renamed to clear
the screen, break the table's line and start a C1 control sequence. tracerctl must print it
escaped in its tables and keep it as data in JSON. Prints nothing itself."""
import sys

EVIL = "evil\x1b[2J\n\x9bname"


def f(n):
    return n + 1


# 3.10 code objects have no qualname: tracer names them by co_name there.
names = {"co_name": EVIL}
if sys.version_info >= (3, 11):
    names["co_qualname"] = EVIL
f.__code__ = f.__code__.replace(**names)

total = 0
for _ in range(1000):
    total = f(total)
assert total == 1000
