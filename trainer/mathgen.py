"""Seeded arithmetic word problems with exact integer answers.

Each problem is multi-step, written from one of several templates with varied names, objects and numbers, and
carries its worked solution. The held-out split later serves as an exact-match task, so every answer is an
integer computed here, never parsed back from text.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

NAMES = ["Ada", "Ben", "Chloe", "Dev", "Elena", "Farid", "Grace", "Hiro", "Ines", "Jonas", "Kemi", "Liam",
         "Maya", "Nils", "Olga", "Priya", "Quinn", "Rosa", "Sami", "Tara", "Umar", "Vera", "Wen", "Yusuf", "Zoe"]
ITEMS = [("apple", "apples"), ("notebook", "notebooks"), ("pencil", "pencils"), ("ticket", "tickets"),
         ("loaf of bread", "loaves of bread"), ("marble", "marbles"), ("stamp", "stamps"), ("book", "books"),
         ("orange", "oranges"), ("battery", "batteries"), ("cookie", "cookies"), ("seed packet", "seed packets")]
CONTAINERS = ["box", "crate", "bag", "basket", "shelf", "tray"]
VEHICLES = ["train", "bus", "cyclist", "truck", "ferry", "runner"]


@dataclass(frozen=True)
class Problem:
    question: str
    solution: str  # worked steps, ending in "Answer: N"
    answer: int
    template: str

    @property
    def text(self) -> str:
        return f"Question: {self.question}\nSolution: {self.solution}\n"


def _shopping(r: random.Random) -> Problem:
    name = r.choice(NAMES)
    one, many = r.choice(ITEMS)
    n, price = r.randint(2, 19), r.randint(2, 45)
    m, price2 = r.randint(2, 9), r.randint(3, 60)
    one2, many2 = r.choice([it for it in ITEMS if it[0] != one])
    total = n * price + m * price2
    paid = ((total // 50) + 1 + r.randint(0, 3)) * 50
    q = (f"{name} buys {n} {many} at {price} dollars each and {m} {many2} at {price2} dollars each. "
         f"{name} pays with {paid} dollars. How much change does {name} get?")
    s = (f"The {many} cost {n} * {price} = {n * price}. The {many2} cost {m} * {price2} = {m * price2}. "
         f"Together that is {n * price} + {m * price2} = {total}. The change is {paid} - {total} = {paid - total}. "
         f"Answer: {paid - total}")
    return Problem(q, s, paid - total, "shopping")


def _sharing(r: random.Random) -> Problem:
    name, other = r.sample(NAMES, 2)
    _, many = r.choice(ITEMS)
    people = r.randint(2, 9)
    per = r.randint(3, 40)
    gained, lost = r.randint(5, 80), r.randint(1, 30)
    start = people * per - gained + lost
    while start <= lost:
        per += 5
        start = people * per - gained + lost
    q = (f"{name} has {start} {many}. {other} gives {name} {gained} more, and then {name} loses {lost}. "
         f"{name} shares the rest equally among {people} friends. How many {many} does each friend get?")
    mid = start + gained
    rest = mid - lost
    s = (f"After the gift {name} has {start} + {gained} = {mid}. After the loss {mid} - {lost} = {rest}. "
         f"Each friend gets {rest} / {people} = {rest // people}. Answer: {rest // people}")
    return Problem(q, s, rest // people, "sharing")


def _speed(r: random.Random) -> Problem:
    v = r.choice(VEHICLES)
    s1, t1 = r.randint(20, 120), r.randint(2, 6)
    s2, t2 = r.randint(10, 90), r.randint(1, 5)
    q = (f"A {v} travels at {s1} km per hour for {t1} hours, then at {s2} km per hour for {t2} hours. "
         f"How many kilometres does the {v} travel in total?")
    d1, d2 = s1 * t1, s2 * t2
    s = (f"First part: {s1} * {t1} = {d1} km. Second part: {s2} * {t2} = {d2} km. "
         f"Total: {d1} + {d2} = {d1 + d2}. Answer: {d1 + d2}")
    return Problem(q, s, d1 + d2, "speed")


def _packing(r: random.Random) -> Problem:
    name = r.choice(NAMES)
    c = r.choice(CONTAINERS)
    _, many = r.choice(ITEMS)
    per, full = r.randint(4, 24), r.randint(3, 30)
    extra = r.randint(0, per - 1)
    total = per * full + extra
    q = (f"{name} packs {total} {many} into {c}es that hold {per} each. How many {many} are left over "
         f"after filling as many {c}es as possible, plus the number of full {c}es?")
    s = (f"{total} / {per} = {full} full {c}es with remainder {extra}. "
         f"Left over plus full {c}es: {extra} + {full} = {extra + full}. Answer: {extra + full}")
    return Problem(q, s, extra + full, "packing")


def _percent(r: random.Random) -> Problem:
    name = r.choice(NAMES)
    one, _ = r.choice(ITEMS)
    price = r.randint(2, 40) * 20
    pct = r.choice([5, 10, 15, 20, 25, 30, 40, 50])
    qty = r.randint(2, 6)
    off = price * pct // 100
    q = (f"A {one} costs {price} dollars. It is on sale for {pct} percent off. {name} buys {qty} of them. "
         f"How much does {name} pay?")
    s = (f"The discount is {price} * {pct} / 100 = {off}. The sale price is {price} - {off} = {price - off}. "
         f"For {qty}: {qty} * {price - off} = {qty * (price - off)}. Answer: {qty * (price - off)}")
    return Problem(q, s, qty * (price - off), "percent")


def _ages(r: random.Random) -> Problem:
    a, b = r.sample(NAMES, 2)
    age_b = r.randint(3, 40)
    diff = r.randint(1, 30)
    years = r.randint(2, 25)
    q = (f"{a} is {diff} years older than {b}. {b} is {age_b} years old. "
         f"What will be the sum of their ages in {years} years?")
    age_a = age_b + diff
    total = age_a + years + age_b + years
    s = (f"{a} is {age_b} + {diff} = {age_a}. In {years} years: {age_a + years} and {age_b + years}. "
         f"Sum: {age_a + years} + {age_b + years} = {total}. Answer: {total}")
    return Problem(q, s, total, "ages")


def _area(r: random.Random) -> Problem:
    w, h = r.randint(3, 40), r.randint(3, 40)
    cw, ch = r.randint(1, w - 1), r.randint(1, h - 1)
    cost = r.randint(2, 15)
    area = w * h - cw * ch
    q = (f"A garden is a {w} m by {h} m rectangle with a {cw} m by {ch} m pond cut out. "
         f"Grass costs {cost} dollars per square metre. How much does it cost to cover the garden without the pond?")
    s = (f"Whole area: {w} * {h} = {w * h}. Pond: {cw} * {ch} = {cw * ch}. Grass: {w * h} - {cw * ch} = {area}. "
         f"Cost: {area} * {cost} = {area * cost}. Answer: {area * cost}")
    return Problem(q, s, area * cost, "area")


TEMPLATES = (_shopping, _sharing, _speed, _packing, _percent, _ages, _area)


def generate(n: int, seed: int) -> list[Problem]:
    """`n` problems, the same for the same seed on every machine (Python's Mersenne Twister is portable)."""
    r = random.Random(seed)
    return [r.choice(TEMPLATES)(r) for _ in range(n)]
