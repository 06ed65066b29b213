"""A small character corpus made here, with no download: sentences from a tiny grammar, seeded.

Writes what nanoGPT's character datasets write - ``train.bin`` and ``val.bin`` (uint16 token ids,
90% / 10%) - and ``meta.json`` (the vocabulary; nanoGPT keeps it in a pickle, which a shared folder
should not be trusted with).

    python examples/nanogpt/prepare.py outputs/nanogpt/data   # or let train.py do it (once, on rank 0)
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import numpy as np

import multigpu as mg

SUBJECTS = [
    "the cat",
    "a dog",
    "the old sailor",
    "my sister",
    "the small robot",
    "a quiet student",
    "the baker",
]
VERBS = ["sees", "likes", "carries", "paints", "follows", "finds", "remembers", "builds"]
OBJECTS = [
    "the red ball",
    "a long letter",
    "the green door",
    "an empty box",
    "the river",
    "a tall tree",
    "the moon",
]
ENDINGS = [".", " today.", " at night.", " in the rain.", " again and again.", "!", " slowly."]


def make_text(chars: int = 200_000, seed: int = 0) -> str:
    rng = random.Random(seed)
    lines, size = [], 0
    while size < chars:
        line = (
            f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)}{rng.choice(ENDINGS)}"
        )
        line = line[0].upper() + line[1:]
        lines.append(line)
        size += len(line) + 1
    return "\n".join(lines)[:chars]


def prepare(folder: str | Path, chars: int = 200_000) -> Path:
    """Write the corpus into ``folder`` (each file written whole, then renamed; meta.json last), unless it
    is there already: runs and resumes share one preparation."""
    folder = Path(folder)
    if all((folder / name).is_file() for name in ("train.bin", "val.bin", "meta.json")):
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    text = make_text(chars)
    vocab = sorted(set(text))
    stoi = {ch: i for i, ch in enumerate(vocab)}
    ids = np.array([stoi[ch] for ch in text], dtype=np.uint16)
    split = int(len(ids) * 0.9)
    # each file whole (mg.write_file: a temporary file renamed over it, never written through a link there)
    for name, part in (("train.bin", ids[:split]), ("val.bin", ids[split:])):
        mg.write_file(folder / name, part.tobytes())
    # last: done
    mg.write_file(folder / "meta.json", json.dumps({"vocab_size": len(vocab), "itos": vocab}))
    return folder


if __name__ == "__main__":
    where = prepare(sys.argv[1] if len(sys.argv) > 1 else "outputs/nanogpt/data")
    print(f"wrote {where}/train.bin, val.bin, meta.json")
