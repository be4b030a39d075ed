"""Machines that hold different copies of the files: described, compared and refused at setup
(lightning_automodel.data.copies)."""

import os
import re
import socket
import threading
from functools import partial

from copies_checks import check_copies

from lightning_automodel.data import copies
from lightning_automodel.data.copies import ENDS, Description, Entry, compare, describe, describe_files
from lightning_automodel.data.demo import demo_documents
from lightning_automodel.data.modules.text import TextDataModule
from lightning_automodel.testing.harness import check_name, run_checks

MADE_BY = {"format": 2, "tokenizer": "t0", "records": "documents", "text_field": "text"}


def description(*entries: Entry, **made_by) -> Description:
    return Description({**MADE_BY, **made_by}, entries)


def entry(name: str, size: int = 100, digest: str = "d", documents: int = 3, tokens: int = 90) -> Entry:
    return Entry(name, size, digest, documents, tokens)


ORIGINAL = description(entry("data/a.txt"), entry("data/b.txt"), entry("data/c.txt"))


def test_alike_machines_pass_and_each_difference_is_named():
    same = [("h0", 0, {"train": ORIGINAL}), ("h0", 0, {"train": ORIGINAL}), ("h1", 1, {"train": ORIGINAL})]
    assert compare(same) is None
    other = description(entry("data/a.txt"), entry("data/b.txt", size=104), entry("data/c.txt", digest="e"))
    message = compare([("h0", 0, {"train": ORIGINAL}), ("h0", 0, {"train": ORIGINAL}), ("h1", 1, {"train": other})])
    assert "different copies of the train split's files" in message
    assert "h1 (node 1; rank 2) against h0 (node 0; ranks 0-1):" in message
    assert "data/b.txt: 100 bytes on h0 (node 0), 104 bytes on h1 (node 1)" in message
    assert "data/c.txt: same size, other content" in message
    assert "data/a.txt" not in message
    assert "rsync -a -c" in message and "remove the token caches" in message
    missing = description(entry("data/a.txt"), entry("data/b.txt"), tokenizer="t1", text_field="body")
    message = compare([("h0", 0, {"train": ORIGINAL}), ("h1", 0, {"train": missing})])
    assert "data/c.txt: only on h0 (node 0)" in message
    assert "the tokenizer differs" in message and "text_field: 'text' on h0 (node 0), 'body' on h1 (node 0)" in message
    reordered = description(*reversed(ORIGINAL.entries))
    assert "the same files, in another order" in compare(
        [("h0", 0, {"train": ORIGINAL}), ("h1", 0, {"train": reordered})]
    )
    absent = compare([("h0", 0, {"train": ORIGINAL, "val": ORIGINAL}), ("h1", 0, {"train": ORIGINAL})])
    assert "val split" in absent and "train split" not in absent and "no rows on h1 (node 0)" in absent


def test_many_differences_and_machines_stay_readable():
    many = description(*(entry(f"data/{i:03}.txt") for i in range(40)))
    edited = description(*(entry(f"data/{i:03}.txt", digest="e") for i in range(40)))
    ranks = [(f"h{node}", node, {"train": many if node < 2 else edited}) for node in range(8) for _ in range(4)]
    message = compare(ranks)
    assert message.count("same size, other content") == 5 and "and 35 more files" in message
    assert "h2 (node 2; ranks 8-11), h3 (node 3; ranks 12-15), h4 (node 4; ranks 16-19) and 3 more machines" in message
    assert "against h0 (node 0; ranks 0-3), h1 (node 1; ranks 4-7):" in message
    assert len(message.splitlines()) < 12


def test_only_the_distinct_copies_are_gathered_and_every_rank_raises_alike(monkeypatch):
    """Six ranks on three machines (two ranks each), the third's copy edited: the second gather carries one
    description per distinct copy, from the first rank holding it, and every rank raises the same message."""
    other = description(entry("data/a.txt"), entry("data/b.txt", digest="e"), entry("data/c.txt"))
    copy_of = [ORIGINAL, ORIGINAL, ORIGINAL, ORIGINAL, other, other]
    rank, barrier, slots, sent = threading.local(), threading.Barrier(6), [None] * 6, []

    def all_gather(value):
        slots[rank.value] = value
        barrier.wait()
        gathered = list(slots)
        barrier.wait()
        return gathered

    def run(me: int, outcome: list) -> None:
        rank.value = me
        try:
            copies.refuse_other_copies({"train": copy_of[me]}, node_rank=me // 2)
        except ValueError as error:
            outcome[me] = str(error)

    monkeypatch.setattr(copies, "_all_gather", lambda value: sent.append(value) or all_gather(value))
    monkeypatch.setattr(copies, "describe", lambda rows: rows)
    monkeypatch.setattr(copies.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(copies.dist, "get_world_size", lambda: 6)
    monkeypatch.setattr(copies.dist, "get_rank", lambda: rank.value)
    outcome = [None] * 6
    threads = [threading.Thread(target=run, args=(me, outcome)) for me in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    second = [value for value in sent if isinstance(value, dict)]
    assert sorted(len(value) for value in second) == [0, 0, 0, 0, 1, 1], "not one description per distinct copy"
    assert len(set(outcome)) == 1 and "(node 2; ranks 4-5) against " in outcome[0], outcome
    assert "(node 0; ranks 0-1), " in outcome[0] and "data/b.txt: same size, other content" in outcome[0]


def test_a_cache_describes_what_the_files_gave_not_where_or_when(tmp_path, monkeypatch):
    """Two machines' caches of copies under other directories and times describe alike; a letter changed in the
    middle of a file, at the same size, is another digest."""
    text = "\n\n".join(demo_documents(8, seed=0)) + "\n"

    def described(machine: str, copy: str) -> Description:
        (tmp_path / machine / "data").mkdir(parents=True)
        (tmp_path / machine / "data" / "a.txt").write_text(copy)
        monkeypatch.chdir(tmp_path / machine)
        data = TextDataModule("data/*.txt", seq_len=16, cache_dir="cache")
        data.setup("fit")
        return describe(data.datasets["train"])

    first = described("m0", text)
    os.utime(tmp_path / "m0" / "data" / "a.txt", ns=(1, 1))
    assert described("m1", text) == first
    middle = len(text) // 2 + text[len(text) // 2 :].index("a")
    edited = described("m2", text[:middle] + "b" + text[middle + 1 :])
    sizes = [(e.name, e.size, e.documents, e.tokens) for e in edited.entries]
    assert sizes == [("data/a.txt", len(text), 8, first.entries[0].tokens)]
    assert edited.entries[0].digest != first.entries[0].digest


def test_a_stream_compares_sizes_and_the_ends_only(tmp_path):
    """A streamed file's digest covers its first and last 64 KiB: an edit there is seen, one in the middle is not."""
    path = tmp_path / "a.txt"

    def digest(at: int) -> str:
        data = bytearray(b"x" * (3 * ENDS))
        data[at] = ord("y")
        path.write_bytes(bytes(data))
        return describe_files([str(path)], made_by={}).entries[0].digest

    original = digest(ENDS + ENDS // 2)
    assert digest(ENDS + 10) == original  # documented: not seen in streaming mode
    assert digest(10) != original and digest(3 * ENDS - 10) != original


CASES = ("identical", "edited", "same size", "missing", "streamed", "fails on one")


def test_nodes_with_different_copies_are_refused_before_the_first_step(tmp_path):
    """Two simulated nodes, each its own local rank 0 building its own cache from its own copy under the same
    relative names: copies alike but for their times train; a file edited (another size), changed at the same size,
    missing on one node, or differing in a stream is refused on both ranks with the same message, naming both
    machines and the file."""
    checks = [partial(check_copies, str(tmp_path), case) for case in CASES]
    launched = run_checks(2, checks)
    results = {case: launched[check_name(check)] for case, check in zip(CASES, checks, strict=True)}
    node0, node1 = results["identical"]
    assert (node0["place"], node1["place"]) == ((0, 0, 0), (0, 1, 1)), "not one local rank 0 per simulated node"
    assert node0["error"] is None and node1["error"] is None and node0["cached"] and node1["cached"]
    expected = {
        "edited": r"data/b\.txt: (\d+) bytes on \S+ \(node 0\), (?!\1 )\d+ bytes on \S+ \(node 1\)",
        "same size": r"data/b\.txt: same size, other content",
        "missing": r"data/c\.txt: only on \S+ \(node 0\)",
        "streamed": r"data/b\.txt: same size, other content",
    }
    for case, pattern in expected.items():
        first, second = (rank["error"] for rank in results[case])
        assert first is not None and first == second, f"{case}: not refused alike on both ranks: {first!r}, {second!r}"
        assert re.search(r"\S+ \(node 1; rank 1\) against \S+ \(node 0; rank 0\):", first), first
        assert re.search(pattern, first), f"{case}: {first}"
        assert len(first.splitlines()) == 4, first
    node0, node1 = (rank["error"] for rank in results["fails on one"])
    assert node1 is not None and node1.startswith("No file matches 'data/extra.txt'"), node1
    assert node0 == f"Rank 1 on {socket.gethostname()} (node 1) could not set up the data: {node1}", node0
