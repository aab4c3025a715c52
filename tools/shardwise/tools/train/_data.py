"""The training data: a character-level corpus and deterministic batches drawn from it."""

from __future__ import annotations

import importlib.resources

import torch

__all__ = ["CharCorpus", "DEFAULT_CORPUS_NAME", "load_default_corpus"]

# Shipped inside the package (public-domain Shakespeare sonnets), so the trainer never downloads.
DEFAULT_CORPUS_NAME = "corpus.txt"


def load_default_corpus(vocab_multiple: int = 1) -> CharCorpus:
    package_files = importlib.resources.files(__package__ or "shardwise.tools.train")
    text = package_files.joinpath(DEFAULT_CORPUS_NAME).read_text(encoding="utf-8")
    return CharCorpus(text, vocab_multiple=vocab_multiple)


class CharCorpus:
    """A text encoded one token per character.

    The vocabulary is the sorted set of characters in the text, padded with unused ids up to a
    multiple of ``vocab_multiple``: the embedding and output layers are split by vocabulary row
    over the tensor-parallel ranks, and an even split keeps every rank's shard the same size.
    """

    def __init__(self, text: str, vocab_multiple: int = 1) -> None:
        if vocab_multiple < 1:
            raise ValueError(f"CharCorpus: vocab_multiple must be >= 1, got {vocab_multiple}")
        if len(text) < 2:
            raise ValueError(
                f"CharCorpus: the text needs at least 2 characters to make one (input, target) pair, got {len(text)}"
            )
        self.text = text
        self.characters: tuple[str, ...] = tuple(sorted(set(text)))
        self._index = {character: index for index, character in enumerate(self.characters)}
        self.vocab_size = -(-len(self.characters) // vocab_multiple) * vocab_multiple
        self.tokens = self.encode(text)

    def encode(self, text: str) -> torch.Tensor:
        try:
            return torch.tensor([self._index[character] for character in text], dtype=torch.long)
        except KeyError as error:
            raise ValueError(
                f"CharCorpus.encode: character {error.args[0]!r} is not in the corpus vocabulary"
            ) from None

    def decode(self, token_ids: torch.Tensor) -> str:
        # Padding ids (past the characters) never appear in the data; a model may still predict them.
        return "".join(
            self.characters[int(token_id)] if int(token_id) < len(self.characters) else "?" for token_id in token_ids
        )

    def batch(self, step: int, batch_size: int, seq_len: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-character targets, both ``(batch_size, seq_len)``, for training step ``step``.

        A pure function of its arguments: every rank, and the single-process reference run, get
        the same batch for the same step without exchanging anything.
        """
        if seq_len + 1 > len(self.tokens):
            raise ValueError(
                f"CharCorpus.batch: seq_len={seq_len} needs windows of {seq_len + 1} characters, "
                f"but the corpus has {len(self.tokens)}"
            )
        generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
        starts = torch.randint(0, len(self.tokens) - seq_len, (batch_size,), generator=generator)
        windows = torch.stack([self.tokens[start : start + seq_len + 1] for start in starts.tolist()])
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()
