"""A generated dataset: an arithmetic language the tiny GPT can learn on a CPU in minutes (lesson 00).

Text looks like ``"12+34=46;7+85=92;..."``.  The operands are random, so the model can never predict
them; the sums are determined by the operands, so the loss on them falls as the model learns to add.
Loss starts near ln(vocab) ≈ 2.8 and visibly drops within a few hundred CPU steps; ``accuracy`` and
``complete`` show what was learned.

Everything is a pure function of ``(seed, step)``: the global batch of step ``i`` is the same on every
rank and in every strategy, and ``shard`` cuts it into the data-parallel ranks' contiguous slices —
which is what makes "equal to a single process with the same global batch" testable.  The data
position for a checkpoint is just the step number.
"""

from __future__ import annotations

import random

import torch

__all__ = ["VOCAB", "encode", "decode", "ArithmeticData", "shard"]

VOCAB = "0123456789+=;"
_INDEX = {ch: i for i, ch in enumerate(VOCAB)}


def encode(text: str) -> list[int]:
    """Characters to token ids (raises ``ValueError`` naming the first unknown character)."""
    try:
        return [_INDEX[ch] for ch in text]
    except KeyError as exc:
        raise ValueError(f"character {exc.args[0]!r} is not in the vocabulary {VOCAB!r}") from None


def decode(ids) -> str:
    """Token ids back to text; ids past the vocabulary (padding) print as '?'."""
    return "".join(VOCAB[i] if i < len(VOCAB) else "?" for i in (int(j) for j in ids))


class ArithmeticData:
    """Batches of ``seq_len + 1`` tokens of additions, a pure function of ``(seed, step)``."""

    def __init__(self, seq_len: int = 32, seed: int = 0, max_operand: int = 99):
        if seq_len < 2:
            raise ValueError(f"seq_len must be at least 2, got {seq_len}")
        self.seq_len, self.seed, self.max_operand = seq_len, seed, max_operand
        self.vocab_size = len(VOCAB)

    def problem(self, rng: random.Random) -> str:
        a, b = rng.randint(0, self.max_operand), rng.randint(0, self.max_operand)
        return f"{a}+{b}={a + b};"

    def row(self, rng: random.Random) -> list[int]:
        text = ""
        while len(text) < self.seq_len + 1:
            text += self.problem(rng)
        return encode(text[: self.seq_len + 1])

    def batch(self, step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The global batch of ``step``: inputs and next-token targets, each (batch_size, seq_len),
        in host memory (as a data loader's: each strategy moves its shard to its device)."""
        rng = random.Random(f"{self.seed}:{step}")
        rows = torch.tensor([self.row(rng) for _ in range(batch_size)], dtype=torch.long,
                            device="cpu")
        return rows[:, :-1], rows[:, 1:]

    def prompts(self, n: int, seed: int = 12345) -> list[tuple[str, str]]:
        """``n`` held-out problems as (prompt, answer), e.g. ("12+34=", "46;")."""
        rng = random.Random(f"eval:{seed}")
        out = []
        for _ in range(n):
            text = self.problem(rng)
            prompt, answer = text.split("=")
            out.append((prompt + "=", answer))
        return out

    @torch.no_grad()
    def accuracy(self, model, n: int = 100) -> float:
        """Fraction of held-out additions the model completes exactly (greedy decoding)."""
        done = self.complete(model, [p for p, _ in self.prompts(n)])
        answers = [a for _, a in self.prompts(n)]
        return sum(d == a for d, a in zip(done, answers)) / n

    @torch.no_grad()
    def complete(self, model, prompts: list[str]) -> list[str]:
        """Greedy completions of prompts up to and including the first ';'."""
        out, device = [], next(model.parameters()).device
        for prompt in prompts:
            ids = torch.tensor([encode(prompt)], device=device)
            full = decode(model.generate(ids, new_tokens=5, stop=_INDEX[";"])[0])
            tail = full[len(prompt):]
            out.append(tail[: tail.index(";") + 1] if ";" in tail else tail)
        return out


def shard(tensor: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank ``rank``'s contiguous slice of a global batch (rows must divide evenly)."""
    if tensor.shape[0] % world_size:
        raise ValueError(f"a batch of {tensor.shape[0]} rows does not split over {world_size} "
                         f"ranks; use a batch size that is a multiple of {world_size}")
    per = tensor.shape[0] // world_size
    return tensor[rank * per:(rank + 1) * per]
