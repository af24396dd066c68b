"""Prompts for `kiln bench throughput|latency|serve`: windows of a fixed-seed English text, cut at
random token offsets, or the "prompt" field of a JSONL file.

Real text rather than random token ids: a tokenizer round trip (the serve bench sends text) nearly
keeps its length, and the model sees the kind of input it was trained on. Windows start at random offsets
of a long text, so two prompts rarely share a prefix and the prefix cache does not flatter the numbers.
"""

from __future__ import annotations

import json
import random

SUBJECTS = [
    "The old potter",
    "A young apprentice",
    "The miller's daughter",
    "Her neighbour",
    "The village priest",
    "A travelling merchant",
    "The blacksmith",
    "Two children from the farm",
    "The ferryman",
    "An elderly widow",
    "The schoolmaster",
    "A stranger from the coast",
]
ACTIONS = [
    "carried wet clay up from the river",
    "stacked the kiln with pale green bowls",
    "mended the cracked chimney",
    "counted the silver from the market",
    "copied the glaze recipes into a worn notebook",
    "split logs for the firebox",
    "watched the glaze run down the jar like honey",
    "sold a tall blue jar to a merchant",
    "swept the ash from the yard",
    "wrapped the best pieces in straw",
    "patched the walls where the frost had split the mortar",
    "listened to the owl in the orchard",
]
TIMES = [
    "before dawn",
    "at the edge of the village",
    "while the mist still lay over the water",
    "in the long winter evenings",
    "on the morning of the fair",
    "after the spring floods",
    "by the light of the firebox",
    "beneath the old walnut tree",
    "when the harvest was in",
    "long after the others had gone to bed",
]
CLAUSES = [
    "and nobody thought it strange",
    "because the weather was turning",
    "although the roads were still muddy",
    "as her grandfather had done before her",
    "and the work went slowly",
    "while the dog slept by the door",
    "though no one had asked",
    "and the evening grew cold",
]


def english_text(num_sentences: int, seed: int = 0) -> str:
    """Paragraphs of simple sentences drawn from a few thousand combinations: English-like, deterministic
    for a seed, as long as needed, and varied enough that windows rarely share a prefix."""
    rng = random.Random(seed)
    sentences = []
    for _ in range(num_sentences):
        clause = f", {rng.choice(CLAUSES)}" if rng.random() < 0.5 else ""
        sentences.append(f"{rng.choice(SUBJECTS)} {rng.choice(ACTIONS)} {rng.choice(TIMES)}{clause}.")
    paragraphs, i = [], 0
    while i < num_sentences:
        n = rng.randint(3, 7)
        paragraphs.append(" ".join(sentences[i : i + n]))
        i += n
    return "\n\n".join(paragraphs)


def token_prompts(tokenizer, num: int, min_len: int, max_len: int, seed: int = 0) -> list[list[int]]:
    """`num` token-id windows of uniform random length in [min_len, max_len] at random offsets."""
    if not 1 <= min_len <= max_len:
        raise ValueError(f"input lengths must satisfy 1 <= min <= max (got {min_len}, {max_len})")
    rng = random.Random(seed)
    # About 20 tokens a sentence; the text is several windows long so that offsets vary widely.
    ids = tokenizer.encode(english_text(max_len // 4 + 64, seed), add_special_tokens=False)
    lengths = [rng.randint(min_len, max_len) for _ in range(num)]
    starts = [rng.randrange(len(ids) - n + 1) for n in lengths]
    return [ids[s : s + n] for s, n in zip(starts, lengths)]


def dataset_prompts(path: str, num: int) -> list[str]:
    """The "prompt" field of the first `num` lines of a JSONL file."""
    prompts = []
    with open(path) as f:
        for i, line in enumerate(f, 1):
            if len(prompts) == num:
                break
            if not line.strip():
                continue
            record = json.loads(line)
            if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
                raise ValueError(f"{path}:{i}: expected a JSON object with a string 'prompt' field")
            prompts.append(record["prompt"])
    if not prompts:
        raise ValueError(f"{path} has no prompts")
    return prompts
