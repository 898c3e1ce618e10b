"""A character-level tokenizer built in code (no downloads): one token per character, wrapped in a
`transformers.PreTrainedTokenizerFast` so TRL and `save_pretrained` work with it.

Encoding adds no special tokens; decoding joins characters with nothing in between, so
`decode(encode(s)) == s` for every string over `CHARS`.
"""

from __future__ import annotations

import string
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # tokenizers and transformers are imported on use: the constants stay light
    from transformers import PreTrainedTokenizerFast

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)  # ids 0, 1, 2, 3
CHARS = string.digits + string.ascii_lowercase + "+=;,.:()?*- "
VOCAB: dict[str, int] = {tok: i for i, tok in enumerate((*SPECIAL_TOKENS, *CHARS))}
VOCAB_SIZE = len(VOCAB)
MODEL_MAX_LENGTH = 256


def char_tokenizer(model_max_length: int = MODEL_MAX_LENGTH) -> PreTrainedTokenizerFast:
    """The character tokenizer: ids 0-3 are `<pad> <bos> <eos> <unk>`, then digits, lowercase letters and
    the symbols `+=;,.:()?*-` and space. Unknown characters map to `<unk>`. Pads on the left by default
    (what batched generation wants); pass `padding_side="right"` to a call to override."""
    # heavy, from the trl extra: imported on use, so the vocabulary constants stay light
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel(vocab=dict(VOCAB), unk_token=UNK))
    # Every character is its own pre-token; special tokens are matched before this runs.
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()  # join tokens with no separator
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        padding_side="left",
        clean_up_tokenization_spaces=False,
        model_max_length=model_max_length,
    )
