"""The data the tutorial's trainer has no real version of: a synthetic task that a model can
learn (the tutorial's uninitialised tensors hold nothing to learn), or a text file read as
word_language_model reads its corpus, cut into word_language_model's batches."""

import math
from pathlib import Path

import torch

# The synthetic task: SYNTHETIC_NTOKEN distinct tokens in sequences that count up (each token
# is the previous one plus 1, modulo SYNTHETIC_NTOKEN) and restart from a random token with
# probability SYNTHETIC_RESTART at each step. The tutorial's get_next_batch draws indices from
# uninitialised memory, which no model can learn; these follow a rule, so the loss has somewhere
# to fall to.
SYNTHETIC_NTOKEN = 10  # the tutorial's ntoken
SYNTHETIC_RESTART = 0.1
SYNTHETIC_TOKENS = 2000  # per epoch; 133 batches of 5 steps x 3 sequences


def synthetic_tokens(length, ntoken, seed):
    """The synthetic task's token stream (see SYNTHETIC_RESTART), the same for a given seed."""
    gen = torch.Generator().manual_seed(seed)
    restarts = (torch.rand(length, generator=gen) < SYNTHETIC_RESTART).tolist()
    random_tokens = torch.randint(ntoken, (length,), generator=gen).tolist()
    tokens = [random_tokens[0]]
    for restart, random_token in zip(restarts[1:], random_tokens[1:], strict=True):
        tokens.append(random_token if restart else (tokens[-1] + 1) % ntoken)
    return torch.tensor(tokens)


def best_synthetic_loss(ntoken, restart):
    """The entropy of the synthetic task's next token, the lowest loss any model can reach: the
    counting rule gives the next token with probability 1 - restart + restart / ntoken, each
    other token has restart / ntoken."""
    other = restart / ntoken
    likely = 1 - restart + other
    return -likely * math.log(likely) - (ntoken - 1) * other * math.log(other)


def tokenize(text):
    """Words split on white space, with <eos> at the end of every line, as word_language_model
    reads its corpus."""
    return [word for line in text.splitlines() for word in line.split() + ["<eos>"]]


def load_corpus(path):
    """(vocabulary, token ids) of a plain-text file: the vocabulary is every distinct word in the
    order it first appears. Raises ValueError with a one-line reason if the file cannot serve."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"--corpus {path}: not a UTF-8 text file") from None
    except OSError as err:
        raise ValueError(f"--corpus {path}: cannot read it ({err.strerror})") from None
    words = tokenize(text)
    if not any(word != "<eos>" for word in words):
        raise ValueError(f"--corpus {path}: the file holds no words")
    word_to_id = {}
    for word in words:
        word_to_id.setdefault(word, len(word_to_id))
    return list(word_to_id), torch.tensor([word_to_id[word] for word in words])


def check_corpus(path, batch_size):
    """None if the file at path can serve as a corpus for batch_size sequences, else a one-line
    reason. Runs once, before any rank starts."""
    try:
        _, tokens = load_corpus(path)
    except ValueError as err:
        return str(err)
    if len(tokens) < 2 * batch_size:
        return (f"--corpus {path}: {len(tokens)} words (counting <eos>) are too few for "
                f"--batch_size {batch_size}; need at least {2 * batch_size}")
    return None


def batchify(data, batch_size):
    """Cut a token stream into batch_size sequences of equal length, one per column (the
    remainder is dropped), as word_language_model does: (length, batch_size)."""
    length = data.size(0) // batch_size
    return data[:length * batch_size].view(batch_size, length).t().contiguous()


def next_token_windows(source, bptt, max_batches=None):
    """Consecutive (data, target) windows of up to bptt steps over a batchified source, in
    order, so that the hidden state carried from one window to the next follows the text.
    target is data one step ahead: at every position, the token that comes next."""
    for start in range(0, source.size(0) - 1, bptt)[:max_batches]:
        seq_len = min(bptt, source.size(0) - 1 - start)
        yield source[start:start + seq_len], source[start + 1:start + 1 + seq_len]


def training_data(args):
    """(ntoken, source) for the trainer: this run's tokens (the synthetic task, or --corpus),
    said in one line, and cut into --batch_size sequences, one a column (batchify)."""
    if args.corpus is None:
        best = best_synthetic_loss(SYNTHETIC_NTOKEN, SYNTHETIC_RESTART)
        print(f"Synthetic data: {SYNTHETIC_TOKENS} tokens counting up modulo "
              f"{SYNTHETIC_NTOKEN}, restarting at a random token with probability "
              f"{SYNTHETIC_RESTART} (lowest possible loss {best:.4f})")
        ntoken, tokens = SYNTHETIC_NTOKEN, synthetic_tokens(SYNTHETIC_TOKENS, SYNTHETIC_NTOKEN,
                                                            args.seed)
    else:
        vocabulary, tokens = load_corpus(args.corpus)
        print(f"Corpus {args.corpus}: {len(tokens)} words, {len(vocabulary)} distinct")
        ntoken = len(vocabulary)
    return ntoken, batchify(tokens, args.batch_size)
