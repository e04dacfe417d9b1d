"""Writes configs/data/dpo-tiny.jsonl: 300 short preference records for
`configs/dpo-tiny.toml`.

Each asks one of the small tasks of sft-tiny.jsonl (adding small numbers, spelling a word,
the next letter); the chosen reply is right, the rejected one is the same sentence with a
wrong answer, so what separates them is a few tokens a tiny model can learn to prefer in a
minute on a CPU. Records come in TRL's three forms: conversations (`prompt`, `chosen`,
`rejected` as lists of messages, some with a system message), text (three strings) and
implicit prompts (`chosen` and `rejected` only, the prompt their shared beginning). Run it
again to regenerate the same file:

    python configs/data/make_dpo_tiny.py
"""

from __future__ import annotations

import json
import random
from pathlib import Path

WORDS = ["cat", "dog", "sun", "tree", "book", "milk", "rain", "star", "fish", "bird", "lamp",
         "door", "road", "ship", "cake", "moon", "wind", "rock", "leaf", "king"]


def task(rng: random.Random) -> tuple[str, str, str]:
    """One (question, right answer, wrong answer)."""
    kind = rng.randrange(3)
    if kind == 0:
        a, b = rng.randrange(10), rng.randrange(10)
        wrong = rng.choice([x for x in range(19) if x != a + b])
        return f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}.", f"{a} plus {b} is {wrong}."
    if kind == 1:
        w = rng.choice(WORDS)
        letters = list(w.upper())
        rng.shuffle(letters)
        if letters == list(w.upper()):
            letters = letters[::-1]
        return f"Spell {w}.", "-".join(w.upper()), "-".join(letters)
    c = rng.randrange(25)
    wrong = rng.choice([x for x in range(26) if x != c + 1])
    letter = lambda i: chr(ord("a") + i)  # noqa: E731
    return (f"Which letter comes after {letter(c)}?", f"After {letter(c)} comes {letter(c + 1)}.",
            f"After {letter(c)} comes {letter(wrong)}.")


def record(i: int, rng: random.Random) -> dict:
    question, right, wrong = task(rng)
    if i % 5 == 3:  # text, the reply after a space
        return {"prompt": f"Q: {question}\nA:", "chosen": f" {right}", "rejected": f" {wrong}"}
    if i % 5 == 4:  # an implicit prompt: the replies' shared beginning
        user = {"role": "user", "content": question}
        return {"chosen": [user, {"role": "assistant", "content": right}],
                "rejected": [user, {"role": "assistant", "content": wrong}]}
    prompt = [{"role": "user", "content": question}]
    if i % 3 == 0:
        prompt = [{"role": "system", "content": "Answer briefly."}, *prompt]
    return {"prompt": prompt, "chosen": [{"role": "assistant", "content": right}],
            "rejected": [{"role": "assistant", "content": wrong}]}


def main() -> None:
    rng = random.Random(0)
    out = Path(__file__).with_name("dpo-tiny.jsonl")
    out.write_text("".join(json.dumps(record(i, rng)) + "\n" for i in range(300)))


if __name__ == "__main__":
    main()
