"""A small character-level transformer and its training loop (notebook 07), on text shipped with the course.

The attention is pluggable (`utils.eager.mha.MultiHeadAttention(attention=...)`): the same model, seed and batches
trained with two attention implementations must give the same loss curve, the end-to-end test of a backward pass.
The corpus is the course's own README and `utils/**/*.py` sources, so training runs offline.
"""
from __future__ import annotations

from pathlib import Path

import torch

from utils.checks import positive_int
from torch import nn

from utils.eager.mha import MultiHeadAttention

ROOT = Path(__file__).resolve().parents[2]




def load_corpus(max_chars: int | None = None) -> str:
    """The course's README.md and utils/**/*.py sources, concatenated in a fixed (sorted) order."""
    files = [ROOT / "README.md", *sorted((ROOT / "utils").rglob("*.py"))]
    text = "\n".join(p.read_text(encoding="utf-8") for p in files)
    return text if max_chars is None else text[:positive_int("max_chars", max_chars)]


class CharTokenizer:
    """Characters <-> integer ids, the vocabulary being the sorted set of characters of a text."""

    def __init__(self, text: str):
        if not isinstance(text, str) or not text:
            raise ValueError("text must be a non-empty str")
        self.chars = sorted(set(text))
        self.index = {c: i for i, c in enumerate(self.chars)}

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> torch.Tensor:
        unknown = sorted(set(text) - self.index.keys())
        if unknown:
            raise ValueError(f"characters not in the vocabulary: {unknown[:10]}")
        return torch.tensor([self.index[c] for c in text], dtype=torch.long)

    def decode(self, ids) -> str:
        return "".join(self.chars[int(i)] for i in ids)


class Block(nn.Module):
    """Pre-norm transformer block: x + attention(norm(x)), then x + MLP(norm(x))."""

    def __init__(self, dim: int, heads: int, attention):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = MultiHeadAttention(dim, heads, causal=True, attention=attention)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class CharTransformer(nn.Module):
    """Decoder-only transformer over characters: embeddings, `layers` causal blocks, a linear head."""

    def __init__(self, vocab_size: int, *, dim=64, heads=2, layers=2, max_len=128, attention="sdpa"):
        super().__init__()
        vocab_size, dim, heads, layers, max_len = (positive_int(n, x) for n, x in (
            ("vocab_size", vocab_size), ("dim", dim), ("heads", heads), ("layers", layers), ("max_len", max_len)))
        self.max_len = max_len
        self.tok = nn.Embedding(vocab_size, dim)
        self.pos = nn.Embedding(max_len, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, attention) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab_size)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids (batch, seq) -> logits (batch, seq, vocab)."""
        if ids.dim() != 2 or ids.shape[1] > self.max_len:
            raise ValueError(f"ids must be (batch, seq) with seq <= {self.max_len}, got {tuple(ids.shape)}")
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def get_batch(data: torch.Tensor, batch: int, seq: int, generator: torch.Generator):
    """Random windows of `seq` + 1 characters: inputs (batch, seq) and next-character targets (batch, seq)."""
    batch, seq = positive_int("batch", batch), positive_int("seq", seq)
    if data.dim() != 1 or data.numel() <= seq:
        raise ValueError(f"data must be a 1-D tensor longer than seq={seq}, got shape {tuple(data.shape)}")
    starts = torch.randint(0, data.numel() - seq, (batch,), generator=generator)
    windows = torch.stack([data[s: s + seq + 1] for s in starts.tolist()])
    return windows[:, :-1], windows[:, 1:]


def train_char_model(attention, *, steps=100, batch=8, seq=64, dim=64, heads=2, layers=2, lr=3e-3, seed=0,
                     device="cpu", dtype=torch.float32, text=None, progress=False) -> list[float]:
    """Train a fresh CharTransformer with `attention` and return the loss of every step.

    Everything random (initial weights, batches) comes from `seed`, so two attention implementations that
    compute the same function, forwards and backwards, give the same curve up to rounding. Mixed precision:
    the weights stay fp32 and the forward runs under autocast to `dtype` on a GPU (attention sees `dtype`), with
    the loss scaled (torch.amp.GradScaler) when `dtype` is fp16.
    """
    steps = positive_int("steps", steps)
    text = load_corpus() if text is None else text
    tok = CharTokenizer(text)
    data = tok.encode(text)
    torch.manual_seed(seed)
    model = CharTransformer(tok.vocab_size, dim=dim, heads=heads, layers=layers, max_len=seq,
                            attention=attention).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(seed)
    mixed = torch.device(device).type == "cuda" and dtype != torch.float32
    autocast = torch.autocast(device_type="cuda", dtype=dtype, enabled=mixed)
    # fp16 (the T4's dtype) has a narrow range: small gradients underflow unless the loss is scaled up first
    scaler = torch.amp.GradScaler("cuda", enabled=mixed and dtype == torch.float16)
    losses = []
    iterator = range(steps)
    if progress:
        from tqdm.auto import tqdm
        iterator = tqdm(iterator, desc=getattr(attention, "__name__", str(attention)))
    for _ in iterator:
        x, y = (t.to(device) for t in get_batch(data, batch, seq, gen))
        with autocast:
            logits = model(x)
        loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        losses.append(loss.item())
    return losses
