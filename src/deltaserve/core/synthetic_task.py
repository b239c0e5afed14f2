"""A built-in fine-tuning task with exact answers, generated from a seed (no download).

Six instruction families over small numbers and common words: addition, subtraction,
reversing a word, upper-casing a word, counting its letters, sorting its letters. Records are
in the Alpaca format, so they travel through the ordinary data path; a held-out split measures
exact-match accuracy of an adapter before and after training.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass
from pathlib import Path

WORDS = tuple(
    "apple river stone cloud garden window planet silver forest bridge candle dragon engine "
    "falcon guitar harbor island jacket kettle ladder marble needle orange pencil quartz "
    "rabbit saddle tiger umbrella violin wagon yellow zebra anchor basket castle desert "
    "eagle feather glacier hammer insect jungle kitten lemon mirror nectar oyster pepper "
    "rocket shadow tunnel valley walnut meadow canyon comet copper cotton crystal dolphin "
    "ember fabric galaxy hollow ivory lantern magnet orbit pillow puzzle ribbon saturn "
    "spiral thunder velvet whisper winter branch breeze button carpet cherry "
    .split()
)

@dataclass(frozen=True)
class TaskExample:
    instruction: str
    answer: str
    family: str

    def alpaca(self) -> dict[str, str]:
        return {"instruction": self.instruction, "input": "", "output": self.answer}


def _example(rng: random.Random) -> TaskExample:
    family = rng.choice(("add", "subtract", "reverse", "upper", "count", "sort"))
    a, b = rng.randint(2, 99), rng.randint(2, 99)
    w = rng.choice(WORDS)
    if family == "add":
        return TaskExample(f"Add {a} and {b}. Answer with the number only.", str(a + b), family)
    if family == "subtract":
        hi, lo = max(a, b), min(a, b)
        return TaskExample(f"Subtract {lo} from {hi}. Answer with the number only.",
                           str(hi - lo), family)
    if family == "reverse":
        return TaskExample(f"Reverse the letters of the word '{w}'. Answer with the word only.",
                           w[::-1], family)
    if family == "upper":
        return TaskExample(f"Write the word '{w}' in capital letters. Answer with the word "
                           "only.", w.upper(), family)
    if family == "count":
        return TaskExample(f"How many letters are in the word '{w}'? Answer with the number "
                           "only.", str(len(w)), family)
    return TaskExample(f"Sort the letters of '{w}' alphabetically. Answer with the letters "
                       "only.", "".join(sorted(w)), family)


def generate(num_train: int = 2000, num_heldout: int = 100, seed: int = 0
             ) -> tuple[list[TaskExample], list[TaskExample]]:
    """Disjoint train and held-out examples (no instruction appears in both)."""
    rng = random.Random(seed)
    seen: set[str] = set()
    out: list[TaskExample] = []
    while len(out) < num_train + num_heldout:
        ex = _example(rng)
        if ex.instruction not in seen:
            seen.add(ex.instruction)
            out.append(ex)
    return out[:num_train], out[num_train:]


def write_jsonl(examples: list[TaskExample], path: str | os.PathLike) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(e.alpaca()) + "\n" for e in examples))
    return path


def exact_match(prediction: str, answer: str) -> bool:
    return prediction.strip().strip(".").strip() == answer
