"""A byte-level tokenizer built in code, so demos and tests need no tokenizer files and no model hub.

Token id ``b`` is byte ``b`` (0..255); two special tokens follow. It round-trips any unicode text, and
``save_pretrained`` writes an ordinary ``tokenizer.json`` that ``AutoTokenizer.from_pretrained`` reloads with the
same ids, so a model trained on it exports like any other Hugging Face model.
"""

from __future__ import annotations

from functools import cache

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

PAD_TOKEN = "<pad>"
EOS_TOKEN = "<eos>"
PAD_ID = 256
EOS_ID = 257
BYTE_VOCAB_SIZE = 258
# Each message under a header naming its role; an answer (with its closing EOS) inside {% generation %}, which
# transformers' return_assistant_tokens_mask reads: the tokens a fine-tuning loss trains on.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '### ' + message['role'] + ':\\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + eos_token }}{% endgeneration %}"
    "{% else %}{{ message['content'] }}{% endif %}{{ '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '### assistant:\\n' }}{% endif %}"
)


@cache
def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's map from bytes to printable characters: the alphabet the ByteLevel pre-tokenizer emits.

    Printable Latin-1 bytes stand for themselves; the others (controls, space, ...) are shifted above U+0100.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = (b for b in range(256) if b not in printable)
    mapping = {b: chr(b) for b in printable}
    mapping.update({b: chr(256 + i) for i, b in enumerate(shifted)})
    return mapping


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """Build the byte tokenizer: ids 0..255 are bytes, ``<pad>`` is 256, ``<eos>`` is 257; no BOS is added. Its chat
    template (:data:`CHAT_TEMPLATE`) marks the answers for fine-tuning.

    A BPE model with the 256 byte characters as its vocabulary and no merges maps each byte to its own id; the
    ByteLevel pre-tokenizer and decoder turn text into those characters and back, which makes the round trip exact
    for any unicode text.
    """
    vocab = {char: byte for byte, char in _byte_to_unicode().items()}
    vocab |= {PAD_TOKEN: PAD_ID, EOS_TOKEN: EOS_ID}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    # Without a regex split and a prefix space, the bytes of the text are exactly the bytes encoded.
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([PAD_TOKEN, EOS_TOKEN])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer
