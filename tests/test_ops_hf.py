"""utils.ops.hf: a course kernel as a transformers attention implementation, in a small random-weight Llama with
grouped-query attention, against transformers' own SDPA path. transformers is an optional extra: without it only
the argument checks run."""
import copy

import pytest
import torch

from utils.ops import hf

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


def test_an_unknown_kernel_is_refused():
    with pytest.raises(ValueError, match="kernel must be one of"):
        hf.attention_function("mine")
    with pytest.raises(ValueError, match="kernel must be one of"):
        hf.register(3)


@pytest.fixture(scope="module")
def models():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      max_position_embeddings=128)
    name = hf.register("triton")
    torch.manual_seed(0)
    # each model its own config: from_config writes the implementation into the config it is given
    theirs = transformers.LlamaForCausalLM._from_config(copy.deepcopy(config), attn_implementation="sdpa")
    ours = transformers.LlamaForCausalLM._from_config(copy.deepcopy(config), attn_implementation=name)
    ours.load_state_dict(theirs.state_dict())
    assert (ours.config._attn_implementation, theirs.config._attn_implementation) == (name, "sdpa")
    return ours.to(DEVICE).eval(), theirs.to(DEVICE).eval()


TOL = dict(atol=1e-4, rtol=1e-4)   # float32 on both sides


def test_logits_and_gradients_match_sdpa(models):
    ours, theirs = models
    ids = torch.randint(0, 128, (2, 40), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    out, ref = ours(ids, labels=ids), theirs(ids, labels=ids)
    torch.testing.assert_close(out.logits, ref.logits, **TOL)
    out.loss.backward()
    ref.loss.backward()
    for (name, p), p_ref in zip(ours.named_parameters(), theirs.parameters()):
        torch.testing.assert_close(p.grad, p_ref.grad, **TOL, msg=lambda m, name=name: f"{name}: {m}")
    ours.zero_grad(), theirs.zero_grad()


def test_a_padded_batch_is_refused_and_an_unpadded_mask_is_not(models):
    ours, theirs = models
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    mask = torch.ones_like(ids)
    with torch.no_grad():
        torch.testing.assert_close(ours(ids, attention_mask=mask).logits, theirs(ids, attention_mask=mask).logits,
                                   **TOL)
        mask[0, :5] = 0   # left padding of the first sequence
        with pytest.raises(ValueError, match="takes no attention mask"):
            ours(ids, attention_mask=mask)


def test_greedy_generation_with_a_kv_cache_matches_sdpa(models):
    """Decoding: one query against a longer cache, causal aligned to the last key (bottom-right)."""
    ours, theirs = models
    prompt = torch.randint(0, 128, (1, 10), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    ours_tokens = ours.generate(prompt, max_new_tokens=6, do_sample=False)
    assert ours_tokens.tolist() == theirs.generate(prompt, max_new_tokens=6, do_sample=False).tolist()


def test_attention_dropout_is_refused(models):
    ours, _ = models
    layer = ours.model.layers[0].self_attn
    q = torch.randn(1, 4, 8, 16, device=DEVICE)
    k = v = torch.randn(1, 2, 8, 16, device=DEVICE)
    fn = hf.attention_function("triton")
    with pytest.raises(ValueError, match="no attention dropout"):
        fn(layer, q, k, v, None, dropout=0.1)
    with pytest.raises(ValueError, match="no sliding_window"):
        fn(layer, q, k, v, None, sliding_window=4)
    o, weights = fn(layer, q, k, v, None)
    assert o.shape == (1, 8, 4, 16) and weights is None
