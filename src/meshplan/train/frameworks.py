"""What each training framework does that changes the cost model, as `Options` overrides (`--framework`).

Each entry names the behaviour and where it is documented; an explicit flag on the command line wins over the
framework's value, and the framework's value over the `Options` default.
"""

from __future__ import annotations

from dataclasses import fields, replace
from typing import Any

from meshplan.errors import unknown_name_error
from meshplan.train.costmodel import Options

FRAMEWORKS: dict[str, dict[str, Any]] = {
    # Megatron-LM / Megatron-Core with Transformer Engine: fused kernels and vocab-parallel cross-entropy, FP8
    # weights cast once per step (TE `is_first_microbatch`), bucketed gradient reduction and parameter all-gather
    # overlapped with compute (--overlap-grad-reduce, --overlap-param-gather; Megatron-LM README)
    "megatron": dict(fused_elementwise=True, fused_loss=True, fp8_weight_cache=True, dp_overlap=True,
                     overlap_param_gather=True),
    # NeMo: Megatron-Core underneath, and its H100 performance recipes turn on Transformer Engine's TP
    # communication overlap (userbuffers; NeMo docs, "Communication overlap")
    "nemo": dict(fused_elementwise=True, fused_loss=True, fp8_weight_cache=True, dp_overlap=True,
                 overlap_param_gather=True, tp_overlap=True),
    # torchtitan: FSDP2 over the dp_shard×cp mesh, torch.compile on the transformer blocks only (the loss stays
    # eager: F.cross_entropy on fp32 logits), torchao float8 (dynamic scaling: an amax pass and a cast per operand,
    # weights cast on every forward); AsyncTP is opt-in;
    # context parallelism through PyTorch's context_parallel with its "allgather" rotation (torchtitan
    # config_manager `context_parallel_rotate_method`, default "allgather"; the Llama model repeats K/V heads
    # before SDPA); attention by PyTorch SDPA, whose backend priority puts its bundled FlashAttention-2 first,
    # also on Hopper (pytorch/pytorch#142132)
    "torchtitan": dict(fused_elementwise=True, fused_loss=False, fp8_weight_cache=False, fp8_fused_casts=False,
                       fsdp_over_cp=True, dp_overlap=True, cp_impl="torch", attention_kernel="sdpa"),
    # MaxText (JAX/XLA): XLA fuses pointwise chains and the loss, decomposes TP collectives into collective
    # matmuls, and reduces the scanned layers' gradients across replicas after the backward
    "maxtext": dict(fused_elementwise=True, fused_loss=True, tp_overlap=True, dp_overlap=False),
    # DeepSpeed wraps the user's own PyTorch model, typically a Hugging Face transformers one run eagerly: one kernel
    # per pointwise op, an eager loss on fp32 logits, attention through PyTorch SDPA (transformers' default
    # attn_implementation); `overlap_comm` (zero_optimization) buckets the gradient reduction behind the backward
    "deepspeed": dict(fused_elementwise=False, fused_loss=False, attention_kernel="sdpa", dp_overlap=True),
}


def framework_options(name: str | None, base: Options, explicit: dict[str, Any]) -> Options:
    """`base` with the framework's behaviour applied, then every flag the user gave (`None` = not given)."""
    changes: dict[str, Any] = {}
    if name is not None:
        if name not in FRAMEWORKS:
            raise unknown_name_error("framework", name, FRAMEWORKS)
        changes.update(FRAMEWORKS[name])
    known = {f.name for f in fields(Options)}
    changes.update({k: v for k, v in explicit.items() if v is not None and k in known})
    return replace(base, **changes)
