"""The reference LLaMA-style decoder in PyTorch, run as torchtitan runs it on one GPU: fp32 parameters (the
master copy) with bf16 autocast, each transformer block compiled with torch.compile, attention by
F.scaled_dot_product_attention (causal, GQA), the loss eager on fp32 logits, fused AdamW. Recompute: "full"
checkpoints each block, "selective" only the attention core (torch.utils.checkpoint, non-reentrant).

Same shapes as `meshplan.measure.jaxmodel` (fused QKV, fused gate/up, RMSNorm, rotate-half RoPE, tied or
untied output). Imported only where torch is installed.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from meshplan.specs.model import ModelConfig


def rope_tables(T: int, H: int, theta: float = 10000.0, device: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    half = H // 2
    freq = theta ** (-torch.arange(half, dtype=torch.float32, device=device) / half)
    ang = torch.arange(T, dtype=torch.float32, device=device)[:, None] * freq[None, :]
    return torch.cos(ang)[None, None], torch.sin(ang)[None, None]  # [1,1,T,H/2]


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class Block(nn.Module):
    def __init__(self, m: ModelConfig, recompute: str):
        super().__init__()
        self.N, self.K, self.H = m.n_heads, m.n_kv_heads, m.head_dim
        self.attn_norm = nn.RMSNorm(m.d_model, eps=1e-6)
        self.wqkv = nn.Linear(m.d_model, (self.N + 2 * self.K) * self.H, bias=False)
        self.wo = nn.Linear(self.N * self.H, m.d_model, bias=False)
        self.mlp_norm = nn.RMSNorm(m.d_model, eps=1e-6)
        self.w_gate_up = nn.Linear(m.d_model, 2 * m.d_ff, bias=False)
        self.w_down = nn.Linear(m.d_ff, m.d_model, bias=False)
        self.selective = recompute == "selective"

    def _attn(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.K != self.N)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        qkv = self.wqkv(self.attn_norm(x)).view(B, T, self.N + 2 * self.K, self.H).transpose(1, 2)
        q, k, v = qkv.split([self.N, self.K, self.K], dim=1)
        q, k = rotary(q, cos, sin), rotary(k, cos, sin)
        o = checkpoint(self._attn, q, k, v, use_reentrant=False) if self.selective else self._attn(q, k, v)
        x = x + self.wo(o.transpose(1, 2).reshape(B, T, self.N * self.H))
        gate, up = self.w_gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.w_down(F.silu(gate) * up)


class Decoder(nn.Module):
    def __init__(self, m: ModelConfig, recompute: str):
        super().__init__()
        self.m = m
        self.embed = nn.Embedding(m.vocab_size, m.d_model)
        self.blocks = nn.ModuleList([Block(m, recompute) for _ in range(m.n_layers)])
        self.norm = nn.RMSNorm(m.d_model, eps=1e-6)
        self.unembed = None if m.tied_embeddings else nn.Linear(m.d_model, m.vocab_size, bias=False)
        self.full = recompute == "full"
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.normal_(p, std=1.0 / math.sqrt(p.shape[-1]))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        cos, sin = rope_tables(tokens.shape[1], self.m.head_dim, device=tokens.device)
        x = self.embed(tokens)
        for blk in self.blocks:
            x = checkpoint(blk, x, cos, sin, use_reentrant=False) if self.full else blk(x, cos, sin)
        x = self.norm(x)
        return x @ self.embed.weight.T if self.unembed is None else self.unembed(x)


def build(m: ModelConfig, recompute: str, compile_blocks: bool = True) -> tuple[Decoder, torch.optim.Optimizer]:
    if recompute not in ("none", "selective", "full"):
        raise ValueError(f"the PyTorch reference has no '{recompute}' recompute policy")
    model = Decoder(m, recompute).cuda()
    if compile_blocks:
        for blk in model.blocks:
            blk.compile()  # torchtitan compiles each TransformerBlock
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    return model, opt


def train_step(model: Decoder, opt: torch.optim.Optimizer, tokens: torch.Tensor, targets: torch.Tensor) -> float:
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = model(tokens)
    loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())  # torchtitan: eager, fp32 logits
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss
