"""Fine-tuning records made tokens with a mask of the ones to train on: the assistant's answers, or the completion.

Two record formats, TRL's: ``{"messages": [{"role": ..., "content": ...}, ...]}`` rendered by the tokenizer's chat
template, and ``{"prompt": str, "completion": str}`` (the prompt tokenized as the model's input usually is, with its
BOS; the completion followed by EOS). A chat template marks the assistant's tokens with ``{% generation %}`` blocks
(transformers' ``return_assistant_tokens_mask``); a template without them is rendered turn by turn, each answer the
tokens its turn adds, which holds only where each rendering is a prefix of the next (checked, and refused otherwise).
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

_GENERATION_BLOCK = re.compile(r"{%-?\s*generation\s*-?%}")  # marks the assistant's tokens in a chat template
ROLES = ("system", "user", "assistant", "tool")
# The roles that may come right before each one: system only opens a conversation, answers follow a question.
_MAY_FOLLOW = {
    "system": (None,),
    "user": (None, "system", "assistant", "tool"),
    "assistant": ("user", "tool"),
    "tool": ("assistant", "tool"),
}


def record_format(record: object, where: str) -> str:
    """``"messages"`` or ``"prompt"``, whichever fields the record has."""
    if isinstance(record, dict) and "messages" in record:
        return "messages"
    if isinstance(record, dict) and "prompt" in record and "completion" in record:
        return "prompt"
    found = sorted(record) if isinstance(record, dict) else f"a {type(record).__name__}"
    raise ValueError(
        f"{where}: neither a conversation ({{'messages': [{{'role': ..., 'content': ...}}, ...]}}) nor a prompt and"
        f" its completion ({{'prompt': ..., 'completion': ...}}); found {found}."
    )


def encode_record(tokenizer: Any, record: dict, where: str) -> tuple[list[int], np.ndarray]:
    """The record's token ids and a 0/1 mask of those trained on."""
    if record_format(record, where) == "messages":
        return encode_conversation(tokenizer, record["messages"], where)
    return encode_completion(tokenizer, record, where)


def check_messages(messages: object, where: str, *, parts: bool = False) -> None:
    """Refuse a conversation that is not a list of ``{"role", "content"}`` messages in a possible order, or that has
    no answer to train on. ``parts``: a content may also be a list of ``{"type": "text", "text": ...}`` and
    ``{"type": "image"}`` parts (vision records)."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: 'messages' must be a non-empty list of {{'role': ..., 'content': ...}} messages.")
    previous = None
    for index, message in enumerate(messages):
        at = f"{where}, message {index}"
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            found = sorted(message) if isinstance(message, dict) else f"a {type(message).__name__}"
            raise ValueError(f"{at}: a message needs a 'role' and a 'content' (found {found}).")
        role = message["role"]
        if role not in ROLES:
            raise ValueError(f"{at}: role {role!r} is not one of {', '.join(ROLES)}.")
        _check_content(message["content"], at, parts=parts)
        if previous not in _MAY_FOLLOW[role]:
            after = f"after a {previous!r} message" if previous else "first"
            raise ValueError(
                f"{at}: a {role!r} message cannot come {after} (a conversation is an optional system message, then"
                " user and assistant turns, tool results after the assistant's call)."
            )
        previous = role
    if not any(message["role"] == "assistant" and message["content"] for message in messages):
        raise ValueError(f"{where}: no assistant answer to train on. Add one, or leave the record out.")


def _check_content(content: object, at: str, *, parts: bool) -> None:
    if isinstance(content, str):
        return
    if not parts or not isinstance(content, list):
        raise ValueError(f"{at}: content is a {type(content).__name__}, not a string{' or a list of parts' * parts}.")
    for index, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "image" or (kind == "text" and isinstance(part.get("text"), str)):
            continue
        raise ValueError(
            f"{at}, part {index}: a part is {{'type': 'text', 'text': str}} or {{'type': 'image'}} (found {part!r})."
        )


def encode_conversation(
    tokenizer: Any, messages: list[dict], where: str, *, parts: bool = False
) -> tuple[list[int], np.ndarray]:
    """The conversation's ids and trained mask; ``parts``: contents may be lists of parts (see
    :func:`check_messages`), rendered by whatever ``tokenizer`` is (a processor's adapter, for images)."""
    check_messages(messages, where, parts=parts)
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(
            f"{where}: the tokenizer has no chat template to render conversations with. Use a tokenizer with one"
            " (an instruct model's), set tokenizer.chat_template, or give prompt/completion records."
        )
    if _GENERATION_BLOCK.search(str(tokenizer.chat_template)):
        rendered = tokenizer.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        ids, trained = list(rendered["input_ids"]), np.asarray(rendered["assistant_masks"], dtype=np.uint8)
    else:
        ids, trained = _turn_by_turn(tokenizer, messages, where)
    if not trained.any():
        raise ValueError(f"{where}: the chat template renders no assistant token to train on.")
    return ids, trained


def _turn_by_turn(tokenizer: Any, messages: list[dict], where: str) -> tuple[list[int], np.ndarray]:
    """Each answer is what rendering through it adds to rendering up to its generation prompt."""
    ids = _render(tokenizer, messages, generation_prompt=False)
    trained = np.zeros(len(ids), dtype=np.uint8)
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start = _render(tokenizer, messages[:index], generation_prompt=True)
        end = _render(tokenizer, messages[: index + 1], generation_prompt=False)
        if ids[: len(start)] != start or ids[: len(end)] != end:
            raise ValueError(
                f"{where}, message {index}: the chat template renders this conversation otherwise than turn by turn"
                " (an earlier turn changes once later ones follow), so the answer's tokens cannot be told apart. Give"
                " the tokenizer a chat template that marks answers with {% generation %} blocks."
            )
        trained[len(start) : len(end)] = 1
    return ids, trained


def _render(tokenizer: Any, messages: list[dict], *, generation_prompt: bool) -> list[int]:
    if not messages:
        return []
    rendered = tokenizer.apply_chat_template(
        messages, tokenize=True, return_dict=True, add_generation_prompt=generation_prompt
    )
    return list(rendered["input_ids"])


def encode_completion(tokenizer: Any, record: dict, where: str) -> tuple[list[int], np.ndarray]:
    prompt, completion = record["prompt"], record["completion"]
    for field, value in (("prompt", prompt), ("completion", completion)):
        if not isinstance(value, str):
            raise ValueError(f"{where}: {field} is a {type(value).__name__}, not a string.")
    if not completion.strip():
        raise ValueError(f"{where}: the completion is empty: no answer to train on. Fill it, or leave the record out.")
    prompt_ids = tokenizer(prompt, add_special_tokens=True, split_special_tokens=True)["input_ids"]
    answer = tokenizer(completion, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    answer = [*answer, tokenizer.eos_token_id]
    trained = np.concatenate([np.zeros(len(prompt_ids), np.uint8), np.ones(len(answer), np.uint8)])
    return [*prompt_ids, *answer], trained
