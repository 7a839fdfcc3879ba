"""Deterministic CPU and memory work: the same page faults and about the same time on every run."""
import sys


def fib(n):
    return n if n < 2 else fib(n - 1) + fib(n - 2)


def churn(rows):
    table = {i: [j * j for j in range(100)] for i in range(rows)}
    return sum(len(v) for v in table.values())


if __name__ == "__main__":
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    total = 0
    for _ in range(rounds):
        total += fib(21) + churn(3000)
    print(total)
