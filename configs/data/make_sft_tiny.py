"""Writes configs/data/sft-tiny.jsonl: 400 short chat records for `configs/sft-tiny.toml`.

Small deterministic tasks a tiny model can learn in a minute on a CPU (adding small numbers,
reversing and spelling words, the next letter, counting), in the three record shapes tessel
reads: OpenAI `messages` (some with a system message, some with two turns), ShareGPT
`conversations` and `prompt`/`completion`. Run it again to regenerate the same file:

    python configs/data/make_sft_tiny.py
"""

from __future__ import annotations

import json
import random
from pathlib import Path

WORDS = ["cat", "dog", "sun", "tree", "book", "milk", "rain", "star", "fish", "bird", "lamp",
         "door", "road", "ship", "cake", "moon", "wind", "rock", "leaf", "king"]


def task(rng: random.Random) -> tuple[str, str]:
    """One (question, answer) pair."""
    kind = rng.randrange(5)
    if kind == 0:
        a, b = rng.randrange(10), rng.randrange(10)
        return f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}."
    if kind == 1:
        w = rng.choice(WORDS)
        return f"Reverse the word {w}.", f"{w} reversed is {w[::-1]}."
    if kind == 2:
        w = rng.choice(WORDS)
        return f"Spell {w}.", "-".join(w.upper())
    if kind == 3:
        c = chr(ord("a") + rng.randrange(25))
        return f"Which letter comes after {c}?", f"After {c} comes {chr(ord(c) + 1)}."
    n = rng.randrange(2, 8)
    return f"Count to {n}.", " ".join(str(i) for i in range(1, n + 1))


def record(i: int, rng: random.Random) -> dict:
    q, a = task(rng)
    shape = i % 5
    if shape == 0:
        return {"prompt": q, "completion": a}
    if shape == 1:
        return {"conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}]}
    if shape == 2:
        return {"messages": [{"role": "system", "content": "Answer briefly."},
                             {"role": "user", "content": q}, {"role": "assistant", "content": a}]}
    if shape == 3:
        q2, a2 = task(rng)
        return {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a},
                             {"role": "user", "content": q2},
                             {"role": "assistant", "content": a2}]}
    return {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}


def main() -> None:
    rng = random.Random(0)
    out = Path(__file__).with_name("sft-tiny.jsonl")
    lines = [json.dumps(record(i, rng)) for i in range(400)]
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out} ({len(lines)} records)")


if __name__ == "__main__":
    main()
