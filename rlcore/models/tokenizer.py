"""A character-level tokenizer with a chat template, built offline from the `tokenizers` library.

It lets the default job and the tests train a policy from scratch without downloading anything:
every printable ASCII character is one token, and the chat markers are special tokens.
"""

from __future__ import annotations

import string

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from rlcore.models.vl_names import VISION_TOKENS

PAD, BOS, EOS, UNK = "<|pad|>", "<|im_start|>", "<|im_end|>", "<|unk|>"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'][0] }}:{{ m['content'] }}<|im_end|>{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>a:{% endif %}"
)


def char_tokenizer(vision: bool = False) -> PreTrainedTokenizerFast:
    """Printable ASCII + newline as single-character tokens; roles render as one letter (`u:`)
    so prompts stay short for tiny models. `<|im_end|>` is the end-of-sequence token.

    ``vision`` appends Qwen-VL's vision markers (`<|vision_start|>`, `<|vision_end|>`,
    `<|image_pad|>`, `<|video_pad|>`) as special tokens after the text vocabulary, so the text
    ids (and a text-only model's initial weights) do not change."""
    chars = sorted(set(string.printable) - set("\t\r\x0b\x0c"))
    specials = [PAD, BOS, EOS, UNK]
    extra = list(VISION_TOKENS) if vision else []
    vocab = {tok: i for i, tok in enumerate(specials + chars + extra)}
    specials += extra
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token=PAD, bos_token=BOS, eos_token=EOS, unk_token=UNK
    )
    tok.add_special_tokens({"additional_special_tokens": specials})
    tok.chat_template = CHAT_TEMPLATE
    return tok
