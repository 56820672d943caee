"""Built-in tokenizers with a chat template, built offline from the `tokenizers` library.

They let the default job and the tests train a policy from scratch without downloading anything:
`char` makes every printable ASCII character one token; `bpe` is a small byte-level BPE (tokens
of several characters, other boundaries than `char`'s: the student of cross-tokenizer
distillation on CPU). The chat markers are special tokens in both.
"""

from __future__ import annotations

import random
import string

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
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
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token=PAD, bos_token=BOS, eos_token=EOS, unk_token=UNK)
    tok.add_special_tokens({"additional_special_tokens": specials})
    tok.chat_template = CHAT_TEMPLATE
    return tok


BPE_VOCAB_SIZE = 384


def bpe_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE of `BPE_VOCAB_SIZE` tokens, trained here on a fixed corpus (seeded
    lowercase strings, a few English words and the chat markers' role letters), so every process
    builds the same vocabulary: the chat markers first (ids 0-3 as in `char`), then the 256
    bytes, then merges. Same chat template as `char`."""
    rng = random.Random(0)
    letters = string.ascii_lowercase
    corpus = ["".join(rng.choice(letters) for _ in range(rng.randint(3, 8))) for _ in range(4000)]
    corpus += ["reverse the text", "sort the words", "the answer is", "u:", "a:"] * 50
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    specials = [PAD, BOS, EOS, UNK]
    core.train_from_iterator(
        corpus,
        trainers.BpeTrainer(
            vocab_size=BPE_VOCAB_SIZE,
            special_tokens=specials,
            show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token=PAD, bos_token=BOS, eos_token=EOS, unk_token=UNK)
    tok.add_special_tokens({"additional_special_tokens": specials})
    tok.chat_template = CHAT_TEMPLATE
    return tok
