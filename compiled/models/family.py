"""What kiln knows of a model family, behind one interface (`ModelFamily`): the loader, the quantizer,
tensor parallelism and the runner reach a model only through it and the modules it builds. A family is
found by its HF config's `model_type` (`family_of`)."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

Renames = tuple[tuple[str, str], ...]  # (pattern, replacement): a name through the first that matches


@dataclass(frozen=True)
class ModelFamily:
    """A family's weight names and how its model is built.

    Invariant: the model it builds names its weights as the TP split (compiled/parallel.py) expects:
    `wqkv` (q, k and v rows), `w13` (gate and up rows), `wo` and `w2` (split by columns),
    `tok_embeddings` and `output` (by vocabulary rows); the KV layout is `ModelArgs`' heads and windows.
    """

    model_types: tuple[str, ...]
    hf_names: Renames  # HF parameter name -> the model's
    # The model's fused weights from HF parts: (the model's name, a pattern whose group 2 names the part,
    # the parts' order along dim 0).
    hf_fused: tuple[tuple[str, str, tuple[str, ...]], ...]
    gguf_names: Renames | None  # GGUF tensor name -> HF's; None: kiln reads none of its GGUF files
    build: Callable[..., nn.Module]  # (ModelArgs, attention backend) -> the model


def renamed(name: str, table: Renames) -> str | None:
    """`name` through the first pattern of `table` that matches it; None when none does."""
    for pattern, repl in table:
        new, n = re.subn(pattern, repl, name)
        if n:
            return new
    return None


def family_of(config: Any) -> ModelFamily:
    """The family of an HF config; an error naming those kiln runs for any other."""
    from compiled.models import gemma, llama, phi3

    families = {t: f for f in (llama.FAMILY, phi3.FAMILY, gemma.FAMILY) for t in f.model_types}
    model_type = getattr(config, "model_type", None)
    if model_type not in families:
        raise ValueError(f"unsupported model_type {model_type!r}; kiln runs {', '.join(sorted(families))}")
    return families[model_type]
