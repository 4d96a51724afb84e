"""Procedurally generated tasks that a small model can only solve by running code.

Each family maps (random generator, difficulty) to a Task whose answer is computed exactly here
and whose `solution_code` is a short program that prints it. Task `i` of a `GeneratedTasks(seed=s)`
depends only on (family, s, i, difficulty), so datasets are reproducible without storing them.

Difficulty 0 is the quickstart level: one short, formulaic prompt per task ("Compute a * b.")
whose correct transcript is a one-line program and a boxed number, so a 2-layer model trained
from scratch on CPU can learn the tool-use pattern in minutes. Higher levels grow the numbers
and add families whose answers need loops (primes, factorial digits, Fibonacci).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from envs.tasks.base import Task

Generator = Callable[[random.Random, int], tuple[str, int, str]]
"""(rng, difficulty) -> (problem text, integer answer, solution code)."""


def _digits(rng: random.Random, n: int) -> int:
    return rng.randint(10 ** (n - 1), 10**n - 1)


def multiply(rng: random.Random, d: int) -> tuple[str, int, str]:
    # n = 3 digits at d=0: far beyond mental arithmetic for a small model, yet short enough that a
    # 2-layer model learns to copy operands and results in a CPU warm-up. The product always has
    # exactly 2n digits: with 5- and 6-digit results mixed, where the first digit of a tool's
    # output sits relative to the answer was ambiguous, and a tiny model learned to copy it only
    # for some seeds and CPU kernel paths (greedy success 0.52 vs 0.97 for seed 3 on AVX2).
    n = 3 + 3 * d
    a = rng.randint(math.isqrt(10 ** (2 * n - 1)) + 1, 10**n - 1)
    b = rng.randint(-(-(10 ** (2 * n - 1)) // a), 10**n - 1)  # ceil(10^(2n-1) / a)
    return f"Compute {a} * {b}.", a * b, f"print({a} * {b})"


def add(rng: random.Random, d: int) -> tuple[str, int, str]:
    n = 2 + d
    terms = [_digits(rng, 10 + 4 * d) for _ in range(n)]
    expr = " + ".join(map(str, terms))
    return f"Compute {expr}.", sum(terms), f"print({expr})"


def power(rng: random.Random, d: int) -> tuple[str, int, str]:
    a, b = rng.randint(3, 9 + 10 * d), rng.randint(15 + 10 * d, 25 + 20 * d)
    return f"Compute {a}**{b}.", a**b, f"print({a}**{b})"


def modpow(rng: random.Random, d: int) -> tuple[str, int, str]:
    a, b, m = _digits(rng, 3 + d), _digits(rng, 4 + 2 * d), _digits(rng, 4 + d)
    return f"Compute {a}^{b} mod {m}.", pow(a, b, m), f"print(pow({a}, {b}, {m}))"


def count_primes(rng: random.Random, d: int) -> tuple[str, int, str]:
    d = min(d, 3)  # keeps a plain sieve under ~10 MB and a second
    lo = rng.randint(1, 10 ** (3 + d))
    hi = lo + rng.randint(100, 10 ** (2 + d))
    sieve = bytearray([1]) * (hi + 1)
    sieve[0:2] = b"\x00\x00"
    for p in range(2, math.isqrt(hi) + 1):
        if sieve[p]:
            sieve[p * p :: p] = bytearray(len(sieve[p * p :: p]))
    count = sum(sieve[lo : hi + 1])
    code = (
        f"s = bytearray([1]) * ({hi} + 1)\ns[:2] = bytes(2)\n"
        f"for p in range(2, int({hi} ** 0.5) + 1):\n    if s[p]:\n        s[p * p :: p] = bytes(len(s[p * p :: p]))\n"
        f"print(sum(s[{lo}:{hi} + 1]))"
    )
    return f"How many primes are between {lo} and {hi} inclusive?", count, code


def factorial_digit_sum(rng: random.Random, d: int) -> tuple[str, int, str]:
    n = rng.randint(20 + 30 * d, 60 + 100 * d)
    code = f"import math\nprint(sum(int(c) for c in str(math.factorial({n}))))"
    return f"What is the sum of the digits of {n}!?", sum(map(int, str(math.factorial(n)))), code


def fibonacci_mod(rng: random.Random, d: int) -> tuple[str, int, str]:
    n, m = rng.randint(100, 10 ** (3 + min(d, 3))), _digits(rng, 4 + d)
    a, b = 0, 1
    for _ in range(n):
        a, b = b, (a + b) % m
    code = f"a, b = 0, 1\nfor _ in range({n}):\n    a, b = b, (a + b) % {m}\nprint(a)"
    return f"Let F(0)=0, F(1)=1, F(n)=F(n-1)+F(n-2). What is F({n}) mod {m}?", a, code


def divisor_count(rng: random.Random, d: int) -> tuple[str, int, str]:
    n = rng.randint(10 ** (4 + d), 10 ** (5 + d))
    count, k = 0, 1
    while k * k <= n:
        if n % k == 0:
            count += 1 if k * k == n else 2
        k += 1
    code = f"n = {n}\nprint(sum(1 if k * k == n else 2 for k in range(1, int(n**0.5) + 1) if n % k == 0))"
    return f"How many positive divisors does {n} have?", count, code


FAMILIES: dict[str, Generator] = {
    "multiply": multiply,
    "add": add,
    "power": power,
    "modpow": modpow,
    "count_primes": count_primes,
    "factorial_digit_sum": factorial_digit_sum,
    "fibonacci_mod": fibonacci_mod,
    "divisor_count": divisor_count,
}
EASY_FAMILIES = ("multiply",)
"""The quickstart family: at difficulty 0 a prompt is ~30 characters and its solution one line."""


@dataclass
class GeneratedTasks:
    """An indexable, reproducible stream of generated tasks.

    Task i uses family `families[i % len(families)]`, so any contiguous range is balanced across
    families, and a generator seeded by (seed, i) so it never depends on what was drawn before.
    """

    families: Sequence[str] = tuple(FAMILIES)
    """Family names from FAMILIES."""
    difficulty: int = 1
    """0 = quickstart level; each step makes numbers longer and loops longer."""
    seed: int = 0
    """Changes every task while keeping each one reproducible."""
    size: int = 1_000_000
    """Nominal length; tasks are made on demand, so this costs nothing."""

    def __post_init__(self) -> None:
        self.families = tuple(self.families)
        unknown = [f for f in self.families if f not in FAMILIES]
        if unknown or not self.families:
            raise ValueError(f"unknown task families {unknown}; choose from: {', '.join(FAMILIES)}")
        if not 0 <= self.difficulty <= 5:
            raise ValueError(f"difficulty must be in 0..5, got {self.difficulty}")
        if self.size <= 0:
            raise ValueError(f"size must be positive, got {self.size}")

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> Task:
        if not 0 <= index < self.size:
            raise IndexError(f"task index {index} out of range [0, {self.size})")
        family = self.families[index % len(self.families)]
        rng = random.Random(f"{family}:{self.seed}:{index}:{self.difficulty}")
        problem, answer, code = FAMILIES[family](rng, self.difficulty)
        return Task(
            problem=problem,
            answer=str(answer),
            id=f"{family}-d{self.difficulty}-s{self.seed}-{index}",
            family=family,
            solution_code=code,
            metadata={"difficulty": self.difficulty},
        )
