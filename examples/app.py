"""A small deterministic workload for tracer's demo: pure-Python CPU work plus some allocation."""


def fib(n):
    return n if n < 2 else fib(n - 1) + fib(n - 2)


def build_table(rows):
    return {i: [j * j for j in range(50)] for i in range(rows)}


def main():
    total = 0
    for _ in range(3):
        total += fib(22)
        total += len(build_table(2000))
    print(f"app.py done: {total}")


if __name__ == "__main__":
    main()
