"""A bounded shuffle buffer of documents whose state is where its documents are, not their tokens.

Full, each document put in takes the place of one drawn at random, which goes on into the rows (as ``datasets``'
and litdata's buffers do). A checkpoint saves each buffered document's place (its source and position, a few bytes)
and the generator's state; resumed, the documents are read and tokenized again from their places, so the state
stays small whatever the documents' length.
"""

from __future__ import annotations

from typing import Any

import numpy as np

Place = tuple[int, int]  # a source's index, a piece's position in it (byte or row)


class ShuffleBuffer:
    def __init__(self, size: int, *, seed: int, rank: int) -> None:
        self.size = size
        self.generator = np.random.Generator(np.random.PCG64([seed, rank]))
        self.documents: list[tuple[np.ndarray, Place]] = []

    def put(self, tokens: np.ndarray, place: Place) -> tuple[np.ndarray, Place] | None:
        """Hold a document; once full, give back one drawn at random (its tokens and place) in its place."""
        if len(self.documents) < self.size:
            self.documents.append((tokens, place))
            return None
        slot = int(self.generator.integers(self.size))
        drawn, self.documents[slot] = self.documents[slot], (tokens, place)
        return drawn

    def state_dict(self) -> dict[str, Any]:
        return {"places": [list(place) for _, place in self.documents], "generator": self.generator.bit_generator.state}

    def load_state_dict(self, state: dict[str, Any], tokens: list[np.ndarray]) -> None:
        """Restore the buffer, given its documents' ``tokens`` read again from ``state["places"]``."""
        self.generator.bit_generator.state = state["generator"]
        places = [(source, position) for source, position in state["places"]]
        self.documents = list(zip(tokens, places, strict=True))
