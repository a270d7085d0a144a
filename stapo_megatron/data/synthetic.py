"""The synthetic task for CPU runs, and its tokenizer (real Hugging Face tokenizer files).

Prompts are ``BOS a + b =`` for digits a and b with a + b <= 9; the answer is the digit a + b. A
response may carry free words after its answer: ``7 w3 w8`` then EOS. It is scored by the
``free_words`` reward: the first word must be the answer digit and every word after it a free
word. The free words decide nothing, yet every one of them inherits the response's reward, as the
filler tokens of a math response do; once the policy is sharp, the rare ones that land in correct
responses are what STAPO's S2T rule silences. (Free words before the answer move the answer's
position from response to response, and a from-scratch model then stays for hundreds of steps
on one constant digit, 0.1 accuracy; after it, the answer is the first token.)

Why sums below 10 and not ``(a + b) mod 10`` over all 100 pairs: the score -(c - a - b)^2 of answer
c is, up to a term that does not depend on c, a sum of a function of a and one of b, so a readout
that adds what attention gathers from the two operands already ranks the answers right. The
modular sum has no such form: a from-scratch model first sits on accuracy 0.1 for a number of
steps that changes with the seed, the learning rate and even the tensor-parallel layout's rounding
(measured: accuracy 0.97 after 135 steps of one run at TP=1, 0.64 at TP=2, all else equal).

The vocabulary: three special tokens, the ten digits, ``+``, ``=``, and ``free_tokens`` words
``w0`` ... ``wN``. Its size matters to S2T: a from-scratch model starts near uniform over the
vocabulary, so with more than 1 / tau_p entries every token starts below S2T's probability
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
    """The 55 problems ``a + b =`` (a, b digits, a + b <= 9), answer ``a + b``, rows numbered from 1."""
    pairs = [(a, b) for a in range(10) for b in range(10 - a)]
    return [
        PromptRecord(
            uid=f"{SYNTHETIC_SOURCE}:{a}+{b}",
            problem=f"{a} + {b} =",
            answer=str(a + b),
            source=SYNTHETIC_SOURCE,
            row=row,
        )
        for row, (a, b) in enumerate(pairs, start=1)
    ]
