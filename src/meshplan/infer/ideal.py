"""The book's idealised serving answers for a model on a chip (ch.7 'Inference', ch.8 'Serving LLaMA 3-70B'):
peak FLOPs, peak HBM bandwidth, no kernel launches, no scheduler, no runtime memory reserve. `serve --ideal`
prints them beside the realistic planner (`infer.step`, `infer.memory`), which reduces to them when every
efficiency is 1 and every overhead 0.

Context: the KV cache is counted at the full context (input + output) for memory, as the book's memory
questions do, and at the mean context (input + output/2) for the decode step, the average over a request.
"""

from __future__ import annotations

from meshplan.cost.roofline import critical_batch, moe_critical_batch
from meshplan.infer import bounds as bd
from meshplan.infer.config import ServeConfig, Workload
from meshplan.math.transformer import (
    kv_cache_bytes_per_token,
    matmul_params_active,
    native_weight_bytes,
    param_counts,
)
from meshplan.specs.hardware import Chip
from meshplan.specs.model import ModelConfig

BOOK_DTYPES = ("bf16", "int8", "int4")  # book ch.8 'smallest topology' table: weights and KV in the same dtype


def smallest_topologies(m: ModelConfig, chip: Chip, w: Workload, *, step_target_s: float | None = None,
                        dtypes: tuple[str, ...] = BOOK_DTYPES) -> list[dict]:
    """Book ch.8: per weight dtype (KV in the same dtype), the smallest power-of-two slice holding the
    weights, the batch its free HBM holds and the QPS per chip; then the same on twice the chips (how QPS
    moves with topology). `step_target_s` caps the batch at a decode-step latency target."""
    params, active = param_counts(m).total, matmul_params_active(m)
    ctx = w.input_len + w.output_len
    rows = []
    for d in dtypes:
        kv_tok = kv_cache_bytes_per_token(m, d, ctx)  # mean per token: windowed layers keep at most their window
        C = chip.peak("bf16")  # int8/int4 weights compute in bf16 (book ch.8); bf16 itself is bf16
        # FLOPs from the active parameters (an MoE's k of E experts, book ch.4), bytes from all of them
        base = bd.ideal_serving_point(params, d, kv_tok, ctx, w.output_len, chip.hbm_bytes,
                                      chip.hbm_bandwidth_bytes_per_s, C, step_target_s=step_target_s,
                                      active_params=active)
        for scale in (1, 2):
            p = base if scale == 1 else bd.ideal_serving_point(
                params, d, kv_tok, ctx, w.output_len, chip.hbm_bytes, chip.hbm_bandwidth_bytes_per_s, C,
                chips=2 * base.chips, step_target_s=step_target_s, active_params=active)
            rows.append({**p.as_dict(), "topology": "smallest" if scale == 1 else "doubled",
                         "active_flops_params": active})
    return rows


def ideal_serving(m: ModelConfig, chip: Chip, cfg: ServeConfig, w: Workload, batch: int,
                  step_target_s: float | None = None) -> dict:
    """The ideal answers for one replica of `cfg` (tp x pp chips) at `batch` sequences:
    TPOT = ideal decode step (book ch.7 §8.3, FLOPs from the active matmul parameters), TTFT = the prefill
    compute floor 2 P_active I / (N C) or the weight read, whichever is larger (book ch.7/ch.8 at 100% MFU),
    the free-HBM batch, critical batch (ch.7 §8.1; x E/k for MoE, ch.4), QPS per chip (ch.8) and how it
    moves with batch, and on TPUs the 2D weight-stationary comparison of one MLP (ch.7 Q7)."""
    n = cfg.chips_per_replica
    params, active = param_counts(m).total, matmul_params_active(m)
    # an MXFP4 checkpoint (gpt-oss) as released: experts in MXFP4, the rest bf16 (math/transformer.native_weight_bytes)
    pbytes = native_weight_bytes(m) if cfg.weight_dtype == "mxfp4" else bd.weight_bytes(params, cfg.weight_dtype)
    # per token, averaged over the context (windowed layers keep at most their window)
    kv_tok = kv_cache_bytes_per_token(m, cfg.kv_dtype, w.input_len + w.output_len)
    C, W = chip.peak(cfg.compute_dtype(chip)), chip.hbm_bandwidth_bytes_per_s
    mean_ctx = w.input_len + w.output_len / 2
    kv_mean = bd.kv_bytes_per_sequence(kv_cache_bytes_per_token(m, cfg.kv_dtype, mean_ctx), mean_ctx)
    step = bd.ideal_decode_step(pbytes, kv_mean, batch, n, W, C, active)
    ttft = max(2.0 * active * w.input_len / (n * C), bd.min_decode_latency(pbytes, n, W))
    max_b = bd.ideal_max_decode_batch(n * chip.hbm_bytes, pbytes, bd.kv_bytes_per_sequence(
        kv_tok, w.input_len + w.output_len))
    wb = cfg.expert_weight_bytes if m.is_moe else cfg.weight_bytes  # the bytes the critical batch trades against
    b_crit = (moe_critical_batch(C, W, m.n_experts, m.experts_per_token, wb) if m.is_moe
              else critical_batch(C, W, wb))
    # ch.7 Q7 counts torus axes (W = bidirectional ICI per axis); a GPU's NVSwitch has no axes to split over. The 1D
    # comparison shards over every axis the chip's torus has: 3 on v4/v5p (the book's case), 2 on v5e/v6e
    ws = (bd.weight_stationary_2d(batch, m.d_model, m.d_ff, n, 2 * chip.links.ici_bandwidth_per_link_bytes_per_s, C,
                                  axes_1d=chip.links.torus_dims)
          if n > 1 and chip.links.is_torus else None)
    sweep = sorted({b for b in (1, 8, 32, 128, 512, round(b_crit), batch, max_b) if 1 <= b <= max(max_b, batch)})
    by_batch = []
    for b in sweep:  # how QPS/chip moves with batch (book ch.7 §8.3 latency-throughput trade-off, ch.8)
        t = bd.ideal_decode_step(pbytes, kv_mean, b, n, W, C, active)
        by_batch.append({"batch": b, "step_s": t, "tokens_per_s_per_chip": b / (t * n),
                         "queries_per_s_per_chip": bd.queries_per_s_per_chip(b, t, w.output_len, n)})
    out = {
        "chips_per_replica": n,
        "batch": batch,
        "tpot_s": step,
        "ttft_s": ttft,
        "min_decode_step_s": bd.min_decode_latency(pbytes, n, W),
        "max_batch_per_replica": max_b,
        "throughput_tokens_per_s_per_chip": batch / (step * n),
        "queries_per_s_per_chip": bd.queries_per_s_per_chip(batch, step, w.output_len, n),
        "critical_batch": b_crit,
        "weight_stationary_2d": ws.as_dict() if ws else None,
        "by_batch": by_batch,
        "smallest_topologies": smallest_topologies(m, chip, w, step_target_s=step_target_s),
    }
    if step_target_s is not None:
        # no more than the free HBM holds (the smallest-topology rows cap theirs alike)
        out["batch_for_step_target"] = min(bd.max_batch_for_step(step_target_s, pbytes, kv_mean, n, W, C, active),
                                           max_b)
    return out


def print_ideal(o: dict) -> None:
    """`serve --ideal` text: the book's answers beside the realistic plan in `o` (serve's JSON object)."""
    from rich.table import Table

    from meshplan.cli.app import console
    from meshplan.units import fmt_bytes, fmt_time

    b = o["book_ideal"]
    t = Table(title=f"book (ideal, ch.7/ch.8) vs meshplan (realistic): one replica of {b['chips_per_replica']} "
                    f"chips at batch {b['batch']}")
    for col in ("quantity", "meshplan (realistic)", "book (ideal)"):
        t.add_column(col, justify="left" if col == "quantity" else "right")
    t.add_row("TPOT (decode step)", fmt_time(o["tpot_s"]), fmt_time(b["tpot_s"]))
    t.add_row("TTFT", fmt_time(o["ttft_s"]), fmt_time(b["ttft_s"]))
    t.add_row("max batch per replica", str(o["max_batch_per_replica"]), str(b["max_batch_per_replica"]))
    t.add_row("output tokens/s per chip", f"{o['throughput_tokens_per_s_per_chip']:,.1f}",
              f"{b['throughput_tokens_per_s_per_chip']:,.1f}")
    t.add_row("queries/s per chip", f"{o['throughput_tokens_per_s_per_chip'] / o['output_len']:.3f}",
              f"{b['queries_per_s_per_chip']:.3f}")
    t.add_row("critical batch (compute-bound decode)", "", f"{b['critical_batch']:.0f}")
    console.print(t)
    ws = b["weight_stationary_2d"]
    if ws:
        console.print(f"2D weight-stationary MLP (book ch.7 Q7) on {ws['n_chips']} chips: X={ws['x']:.1f}, "
                      f"YZ={ws['yz']:.1f}, comms {fmt_time(ws['t_comms_2d_s'])} vs 1D {fmt_time(ws['t_comms_1d_s'])} "
                      f"(math {fmt_time(ws['t_math_s'])}); 2D wins above {ws['crossover_chips']:.0f} chips -> "
                      f"{ws['better'].upper()}", highlight=False)
    t = Table(title=f"book (ideal): QPS per chip vs batch on this replica ({o['output_len']}-token outputs)")
    for col in ("batch", "step", "tokens/s/chip", "QPS/chip"):
        t.add_column(col, justify="right")
    for r in b["by_batch"]:
        t.add_row(str(r["batch"]), fmt_time(r["step_s"]), f"{r['tokens_per_s_per_chip']:,.1f}",
                  f"{r['queries_per_s_per_chip']:.3f}")
    console.print(t)
    t = Table(title="smallest topology per weight dtype (book ch.8; KV in the same dtype, batch = what free HBM holds)")
    for col in ("dtype", "topology", "chips", "weights", "free HBM", "batch", "step", "tokens/s/chip", "QPS/chip"):
        t.add_column(col, justify="left" if col in ("dtype", "topology") else "right")
    for r in b["smallest_topologies"]:
        t.add_row(r["weight_dtype"], r["topology"], str(r["chips"]), fmt_bytes(r["param_bytes"]),
                  fmt_bytes(r["free_bytes"]), str(r["batch"]), fmt_time(r["step_s"]), f"{r['tokens_per_s_per_chip']:,.1f}",
                  f"{r['queries_per_s_per_chip']:.3f}")
    console.print(t)
