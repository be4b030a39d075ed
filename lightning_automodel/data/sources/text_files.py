"""Local ``.txt`` and ``.jsonl`` files read piece by piece, each piece with the line it starts on.

A corpus is never held whole: files are read line by line, and what the readers yield is small. A piece that is not
UTF-8, not JSON or lacks its field is an error naming the file and the line.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from typing import BinaryIO

TEXT_SUFFIXES = (".txt",)
JSONL_SUFFIXES = (".jsonl", ".json")
_BLANK = re.compile(r"[ \t]*")
MAX_PARAGRAPH = 1 << 26  # characters: a text file without blank lines would otherwise be one document, read whole


def is_jsonl(path: str) -> bool:
    return path.endswith(JSONL_SUFFIXES)


def file_pieces(path: str) -> Iterator[tuple[int, str]]:
    """The pieces of ``path`` with the line each starts on: a JSONL file's non-blank lines (unparsed), a text file's
    paragraphs (separated by blank lines; a file without one is one paragraph). Newlines are ``\\n`` whatever the
    file's. A file without a non-blank character is an error: more likely a broken export than meant."""
    empty = True
    for piece in _pieces(path, start=0, end=os.path.getsize(path), numbered=True):
        empty = False
        yield piece
    if empty:
        raise ValueError(f"{path} is empty: fill it, or leave it out of the files.")


def pieces_in_range(path: str, *, start: int, end: int) -> Iterator[tuple[int, str]]:
    """The pieces of ``path`` (as :func:`file_pieces` makes them) whose first byte lies in ``[start, end)``, each
    with that byte's offset: ranges that tile a file share its pieces out, each once, and a reader of one range
    reads little past it (the rest of its last paragraph). Errors name the byte, not the line, which would take
    reading the file up to there to count."""
    return _pieces(path, start=start, end=end, numbered=False)


def _pieces(path: str, *, start: int, end: int, numbered: bool) -> Iterator[tuple[int, str]]:
    """The pieces starting in ``[start, end)``, each with its first line's number (``numbered``, from a start at 0)
    or its first byte's offset."""
    paragraphs = not is_jsonl(path)
    with open(path, "rb") as file:
        offset = _line_start_from(file, start)
        after_blank = _after_blank_line(file, offset)
        file.seek(offset)
        begun, begun_where, lines, characters = None, "", [], 0  # the paragraph being read: where it starts, its lines
        for number, data in enumerate(iter(file.readline, b""), start=1):
            line_start, offset = offset, offset + len(data)
            where = f"line {number}" if numbered else f"the line at byte {line_start}"
            line = _decoded(path, where, line_start, data).rstrip("\r\n")
            position = number if numbered else line_start
            blank = _BLANK.fullmatch(line) is not None
            if not paragraphs or blank:
                if begun is not None:
                    yield begun, "\n".join(lines)
                    begun, lines, characters = None, [], 0
                if not paragraphs and not blank:
                    if line_start >= end:
                        return
                    yield position, line
                after_blank = blank
                continue
            if begun is None and after_blank:
                if line_start >= end:
                    return
                begun, begun_where = position, where
            if begun is not None:
                lines.append(line)
                characters += len(line)
                if characters > MAX_PARAGRAPH:
                    raise ValueError(
                        f"{path}, {begun_where}: a paragraph of over {MAX_PARAGRAPH >> 20} Mi characters. A text file's"
                        " documents are separated by blank lines: separate them, or write one JSON object a line"
                        " (.jsonl)."
                    )
            after_blank = False
        if begun is not None:
            yield begun, "\n".join(lines)


def _decoded(path: str, where: str, offset: int, data: bytes) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(
            f"{path}, {where} (byte {offset + error.start}): not UTF-8 ({error.reason}:"
            f" {data[error.start : error.end]!r}). Convert the file to UTF-8, e.g. `iconv -f LATIN1 -t UTF-8 {path} >"
            f" {path}.utf8` for a Latin-1 file."
        ) from error


def json_record(where: str, line: str) -> object:
    try:
        return json.loads(line)
    except json.JSONDecodeError as error:
        raise ValueError(
            f"{where}: not valid JSON ({error.msg}). .jsonl/.json files hold one JSON object per line."
        ) from error


def text_of(record: object, text_field: str, where: str) -> str:
    """The document in a JSONL record: its ``text_field``, a string."""
    if not isinstance(record, dict) or text_field not in record:
        found = sorted(record) if isinstance(record, dict) else f"a {type(record).__name__}"
        raise ValueError(
            f"{where}: no field {text_field!r} (found {found}). Set text_field to the field with the text."
        )
    if record[text_field] is None:
        raise ValueError(f"{where}: field {text_field!r} is null. Fill it, or leave the record out.")
    if not isinstance(record[text_field], str):
        raise ValueError(f"{where}: field {text_field!r} is a {type(record[text_field]).__name__}, not a string.")
    return record[text_field]


def _line_start_from(file: BinaryIO, offset: int) -> int:
    """The first line start at or after ``offset``."""
    if offset == 0:
        return 0
    file.seek(offset - 1)
    return offset - 1 + len(file.readline())


def _after_blank_line(file: BinaryIO, offset: int) -> bool:
    """Whether the line before the one starting at ``offset`` is blank (the file's start counts as one): read
    backwards from the newline ending it to the first byte that is not a space, a tab or a carriage return."""
    end = offset - 1
    while end > 0:
        begin = max(0, end - 256)
        file.seek(begin)
        stripped = file.read(end - begin).rstrip(b" \t\r")
        if stripped:
            return stripped.endswith(b"\n")
        end = begin
    return True
