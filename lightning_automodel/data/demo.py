"""The built-in demo corpus: generated in code, no files, no downloads, and learnable by a tiny model within the
demo's steps (most bytes follow from their context), so that a first run shows training working."""

from __future__ import annotations

import random

from lightning_automodel.data.modules.text import TextDataModule


class DemoDataModule(TextDataModule):
    """A small synthetic corpus generated in code (no files, no downloads), deterministic in ``seed``.

    The documents are fables from one story template ("Once upon a time, a brown fox lived by the river. ..."),
    counting in words, additions, and the days of the week or months of the year from a random start. Most bytes
    are predictable from context (word endings, the template, names repeated within a story, the next number or
    day) while some are not (which animal, which food), so learning is visible within a few dozen steps.
    Measured (``examples/demo.yaml``: a tiny Llama, hidden 128, 2 layers, byte vocabulary; AdamW, lr 3e-3, cosine;
    tp=2 with sp x dp=2 on 4 CPU processes): 150 steps of 16 x 128 tokens, the documents packed and kept apart, go
    from loss 5.6 to 0.49 and predict 85% of the validation bytes (always guessing the commonest byte, a space,
    gets 20%), in 91 s from launch on 2 CPU cores.
    """

    def __init__(
        self,
        seq_len: int = 128,
        batch_size: int = 16,
        pack: bool = True,
        num_documents: int = 4000,
        val_documents: int = 200,
        num_workers: int = 0,
        seed: int = 0,
    ) -> None:
        super().__init__(
            train_files=[], seq_len=seq_len, batch_size=batch_size, pack=pack, num_workers=num_workers, seed=seed
        )
        self.num_documents = num_documents
        self.val_documents = val_documents

    def documents(self, split: str) -> list[str] | None:
        documents = demo_documents(self.num_documents + self.val_documents, self.seed)
        return documents[: self.num_documents] if split == "train" else documents[self.num_documents :]


_NUMBERS = "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen".split()
_NUMBERS += "sixteen seventeen eighteen nineteen twenty".split()
_DAYS = "Monday Tuesday Wednesday Thursday Friday Saturday Sunday".split()
_MONTHS = "January February March April May June July August September October November December".split()
_ANIMALS = "fox owl cat dog bear frog duck mouse rabbit goat".split()
_ADJECTIVES = "red brown grey white black green little big".split()
_PLACES = ["the river", "the old barn", "the green hill", "the dark forest", "the pond", "the sea"]
_FOODS = "apples bread fish honey seeds berries cheese".split()


def demo_documents(count: int, seed: int) -> list[str]:
    """``count`` demo documents drawn with ``random.Random(seed)``: the same seed always gives the same text."""
    rng = random.Random(seed)
    kinds = [_fable] * 5 + [_counting] * 2 + [_additions] * 2 + [_calendar]
    return [rng.choice(kinds)(rng) for _ in range(count)]


def _fable(rng: random.Random) -> str:
    hero, friend = rng.sample(_ANIMALS, 2)
    hero_adjective, friend_adjective = rng.sample(_ADJECTIVES, 2)
    place, food = rng.choice(_PLACES), rng.choice(_FOODS)
    return (
        f"Once upon a time, a {hero_adjective} {hero} lived by {place}. Every day the {hero} ate {food}. "
        f'One day the {hero} met a {friend_adjective} {friend}. The {friend} said: "Hello, {hero}! '
        f'May I have some {food}?" The {hero} gave the {friend} some {food}, and the {hero} and the {friend} '
        "became friends. The end."
    )


def _counting(rng: random.Random) -> str:
    start = rng.randrange(0, 12)
    stop = rng.randrange(start + 4, len(_NUMBERS))
    return f"Let us count from {_NUMBERS[start]} to {_NUMBERS[stop]}: {', '.join(_NUMBERS[start : stop + 1])}."


def _additions(rng: random.Random) -> str:
    sums = []
    for _ in range(rng.randrange(3, 7)):
        a, b = rng.randrange(10), rng.randrange(10)
        sums.append(f"{a} + {b} = {a + b}.")
    return "Sums: " + " ".join(sums)


def _calendar(rng: random.Random) -> str:
    names, unit = rng.choice([(_DAYS, "day"), (_MONTHS, "month")])
    start = rng.randrange(len(names))
    run = [names[(start + i) % len(names)] for i in range(rng.randrange(4, len(names) + 1))]
    return f"After {run[0]} comes {run[1]}. Every {unit} in order: {', '.join(run)}."
