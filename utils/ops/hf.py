"""A course kernel as a Hugging Face transformers attention implementation (transformers is an optional extra,
imported by `register` only).

    from utils.ops import hf
    name = hf.register("triton")                       # "course_triton"
    model = AutoModelForCausalLM.from_config(config, attn_implementation=name)

transformers calls an attention implementation as `fn(module, query, key, value, attention_mask, ...)` on
(batch, heads, seq, head_dim) tensors and wants (batch, seq, heads, head_dim) back. The course's kernels take no
mask, so `register` also gives transformers a mask function: it returns None unless a key is padding, and the
attention function refuses a mask with a ValueError. Without that mask function transformers passes no mask to an
implementation it does not know, and a padded batch would attend to its padding without a word.
"""
from utils.ops.attention import OPS, attention

PREFIX = "course_"


def attention_function(kernel: str):
    """The transformers attention function that runs the operator of `kernel` (one of utils.ops.attention.OPS)."""
    if not isinstance(kernel, str) or kernel not in OPS:
        raise ValueError(f"kernel must be one of {sorted(OPS)}, got {kernel!r}")

    def course_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                         **kwargs):
        if attention_mask is not None:
            raise ValueError(f"the course kernel {kernel!r} takes no attention mask: this batch has padding (or "
                             "a cache longer than its tokens). Give it sequences of one length, or use 'sdpa'")
        if dropout:
            raise ValueError(f"the course kernel {kernel!r} has no attention dropout (got dropout={dropout}); "
                             "call model.eval(), or set the config's attention_dropout to 0")
        for name in ("sliding_window", "softcap"):
            if kwargs.get(name) is not None:
                raise ValueError(f"the course kernel {kernel!r} has no {name} (got {kwargs[name]!r})")
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        o = attention(query, key, value, causal=bool(causal), sm_scale=scaling, kernel=kernel)
        return o.transpose(1, 2), None

    course_attention.__name__ = f"{PREFIX}{kernel}"
    return course_attention


def register(kernel: str = "triton") -> str:
    """Register `kernel` with transformers (its attention function and a padding-only mask function) under the
    name "course_<kernel>"; returns that name, for `attn_implementation=`."""
    fn = attention_function(kernel)
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    name = fn.__name__
    AttentionInterface.register(name, fn)
    # The flash-attention mask: None for a batch without padding, else the (batch, keys) padding mask.
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS["flash_attention_2"])
    return name
