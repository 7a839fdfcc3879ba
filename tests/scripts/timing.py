"""Functions of known relative cost, for comparing tracer's tottime and cumtime with cProfile's."""


def spin(n):
    x = 0
    for i in range(n):
        x += i * i
    return x


def heavy():
    return spin(400_000)


def light():
    return spin(100_000)


def both():
    return heavy() + light()


def fib(n):
    return n if n < 2 else fib(n - 1) + fib(n - 2)


if __name__ == "__main__":
    for _ in range(3):
        both()
    fib(16)
