"""The synthetic task for CPU runs, and its tokenizer (real Hugging Face tokenizer files).

Prompts are ``BOS a + b =`` for single digits a and b; the answer is ``(a + b) mod 10``. A
response may carry free words after its answer: ``7 w3 w8`` then EOS. It is scored by the
``free_words`` reward: the first word must be the answer digit and every word after it a free
word. The free words decide nothing, yet every one of them inherits the response's reward, as the
filler tokens of a math response do; once the policy is sharp, the rare ones that land in correct
responses are what STAPO's S2T rule silences. (Free words before the answer move the answer's
position from response to response, and a from-scratch model then stays for hundreds of steps
on one constant digit, 0.1 accuracy; after it, the answer is the first token, learnt as fast as
the free-word-less task.)

The vocabulary: three special tokens, the ten digits, ``+``, ``=``, and ``free_tokens`` words
``w0`` ... ``wN``. Its size matters to S2T: a from-scratch model starts near uniform over the
vocabulary, so with more than 1 / tau_p = 500 entries every token starts below S2T's probability
threshold, and the answer digit is sampled too rarely to learn from.
"""

from __future__ import annotations

from stapo_megatron.data.records import PromptRecord

SYNTHETIC_SOURCE = "synthetic"
SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>")
TASK_TOKENS = (*"0123456789", "+", "=")
FREE_TOKEN_PREFIX = "w"  # free words are w<number>: the form the free_words reward (rewards.extract.FREE_WORD) accepts


def synthetic_vocab(free_tokens: int) -> list[str]:
    """The synthetic tokenizer's tokens in id order."""
    if free_tokens < 0:
        raise ValueError(f"free_tokens must be >= 0, got {free_tokens}")
    return [*SPECIAL_TOKENS, *TASK_TOKENS, *(f"{FREE_TOKEN_PREFIX}{i}" for i in range(free_tokens))]


def synthetic_vocab_size(free_tokens: int) -> int:
    return len(SPECIAL_TOKENS) + len(TASK_TOKENS) + free_tokens


def synthetic_tokenizer(free_tokens: int):
    """The synthetic task's tokenizer: a ``tokenizers`` word-level model (one token per
    whitespace-separated word; a word outside the vocabulary cannot be encoded) that puts BOS
    first, wrapped in ``transformers.PreTrainedTokenizerFast``. ``save_pretrained`` writes the
    usual Hugging Face files, which ``AutoTokenizer.from_pretrained`` loads back."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = synthetic_vocab(free_tokens)
    pad, bos, eos = SPECIAL_TOKENS
    # No unknown token in the vocabulary: encoding an unknown word fails instead of guessing.
    model = Tokenizer(models.WordLevel({token: i for i, token in enumerate(vocab)}, unk_token="<unk>"))
    model.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    model.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, vocab.index(bos))])
    return PreTrainedTokenizerFast(tokenizer_object=model, bos_token=bos, eos_token=eos, pad_token=pad)


def synthetic_records() -> list[PromptRecord]:
    """All 100 problems ``a + b =`` (a, b single digits), answer ``(a + b) mod 10``."""
    return [
        PromptRecord(
            uid=f"{SYNTHETIC_SOURCE}:{a}+{b}",
            problem=f"{a} + {b} =",
            answer=str((a + b) % 10),
            source=SYNTHETIC_SOURCE,
            row=10 * a + b + 1,
        )
        for a in range(10)
        for b in range(10)
    ]
