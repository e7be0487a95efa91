"""The character-level model of notebook 07: corpus, tokenizer, batches, and the training loop."""
import pytest
import torch

from utils.course.char_model import CharTokenizer, CharTransformer, get_batch, load_corpus, train_char_model
from utils.eager.reference import naive_attention, sdpa_attention


def test_corpus_is_the_course_itself():
    text = load_corpus()
    assert "FlashAttention" in text and "def flash_attention_backward" in text
    assert load_corpus(100) == text[:100]
    with pytest.raises(ValueError):
        load_corpus(0)


def test_tokenizer_round_trip_and_errors():
    tok = CharTokenizer("hello world")
    assert tok.vocab_size == len(set("hello world"))
    ids = tok.encode("world")
    assert ids.dtype == torch.long and tok.decode(ids) == "world"
    with pytest.raises(ValueError, match="not in the vocabulary"):
        tok.encode("xyz")
    with pytest.raises(ValueError):
        CharTokenizer("")


def test_get_batch_targets_are_shifted_inputs():
    data = torch.arange(100)
    x, y = get_batch(data, 4, 10, torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (4, 10)
    assert torch.equal(y[:, :-1], x[:, 1:]) and torch.equal(y[:, -1], x[:, -1] + 1)
    with pytest.raises(ValueError):
        get_batch(torch.arange(5), 2, 10, torch.Generator())
    with pytest.raises(TypeError):
        get_batch(data, 2.0, 10, torch.Generator())


def test_model_shapes_and_causality():
    torch.manual_seed(0)
    model = CharTransformer(11, dim=16, heads=2, layers=1, max_len=12)
    ids = torch.randint(0, 11, (2, 12))
    logits = model(ids)
    assert logits.shape == (2, 12, 11)
    changed = ids.clone()
    changed[:, 8] = (changed[:, 8] + 1) % 11
    assert torch.allclose(model(changed)[:, :8], logits[:, :8], atol=1e-6), "position < 8 saw the future"
    with pytest.raises(ValueError):
        model(torch.randint(0, 11, (2, 13)))
    with pytest.raises(ValueError):
        CharTransformer(0)


@pytest.mark.full   # half a minute on a CPU; notebook 07 makes the same check with its own kernel
def test_same_seed_same_curve_for_equivalent_attentions():
    kw = dict(steps=40, batch=4, seq=16, dim=16, heads=2, layers=1, text=load_corpus(20_000))
    a = train_char_model(sdpa_attention, **kw)
    b = train_char_model(naive_attention, **kw)
    assert len(a) == 40 and max(abs(x - y) for x, y in zip(a, b)) < 1e-4
    # it learns: averaged over 8 steps (single steps are noisy; the corpus is this repository's text)
    assert sum(a[-8:]) / 8 < sum(a[:8]) / 8 - 0.3
    with pytest.raises(ValueError):
        train_char_model(sdpa_attention, steps=0)
