"""`meshplan model`, `meshplan hardware`, `meshplan roofline`."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from meshplan.cli.app import app, console, fail, print_json
from meshplan.cost import roofline as rf
from meshplan.cost.efficiency import default_efficiency
from meshplan.math import transformer as tm
from meshplan.specs.hardware import Chip, load_chip, preset_chips
from meshplan.specs.model import load_model
from meshplan.specs.pod import superpod
from meshplan.units import fmt_bytes, fmt_count, fmt_flops, fmt_rate, fmt_time
from meshplan.validate import DIM

JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object instead of a table.")]


def model_summary(name: str, seq_len: int | None = None) -> dict:
    """The `meshplan model --json` contract."""
    m = load_model(name)
    S = m.max_seq_len if seq_len is None else seq_len
    if S <= 0:
        fail(f"--seq-len must be positive, got {S}")
    pc = tm.param_counts(m)
    tf = tm.flops_per_token(m, S, causal=True)
    return {
        "name": m.name,
        "params_total": pc.total,
        "params_active": pc.active,
        "params_non_embedding": pc.non_embedding,
        "flops_per_token_forward": tf.forward,
        "flops_per_token_training": tf.training,
        "flops_per_token_breakdown": {
            "forward/matmul": tf.forward_matmul,
            "forward/attention_causal": tf.forward_attention,
            "forward/attention_full": tm.attention_flops_per_token(m, S, causal=False),
        },
        "seq_len": S,
        "kv_cache_bytes_per_token": {d: tm.kv_cache_bytes_per_token(m, d, S) for d in ("bf16", "fp8", "int8")},
        "weight_bytes": {**{d: pc.total * tm.dtype_bytes(d) for d in ("bf16", "fp8", "int8", "int4")},
                         "native": tm.native_weight_bytes(m)},
        "params_breakdown": pc.breakdown(),
        "architecture": m.as_dict(),
    }


@app.command()
def model(
    name: Annotated[str, typer.Argument(help="Preset name (e.g. llama3-70b) or path to a HF config.json.")],
    seq_len: Annotated[int | None, typer.Option(help="Sequence length for attention FLOPs (default: the model's).")] = None,
    json_out: JsonOpt = False,
) -> None:
    """Parameters, FLOPs per token, KV-cache bytes and weight memory of a model."""
    s = model_summary(name, seq_len)
    if json_out:
        print_json(s)
        return
    a = s["architecture"]
    t = Table(title=f"{s['name']}  (L={a['n_layers']} D={a['d_model']} N={a['n_heads']} K={a['n_kv_heads']} "
                    f"H={a['head_dim']} F={a['d_ff']} V={a['vocab_size']}"
                    + (f" E={a['n_experts']} k={a['experts_per_token']}" if a["n_experts"] else "") + ")")
    t.add_column("quantity")
    t.add_column("value", justify="right")
    t.add_row("parameters (total)", fmt_count(s["params_total"]))
    t.add_row("parameters (active per token)", fmt_count(s["params_active"]))
    t.add_row(f"FLOPs/token forward (seq {s['seq_len']}, causal)", fmt_flops(s["flops_per_token_forward"]))
    t.add_row("FLOPs/token training (fwd+bwd)", fmt_flops(s["flops_per_token_training"]))
    spans = a["layer_windows"]
    if spans:
        kind = a["window_kind"]
        t.add_row("attention layers", ", ".join(f"{spans.count(w)} × {f'{kind} {w}' if w else 'full'}"
                                                  for w in sorted(set(spans), reverse=True)))
    for d, v in s["kv_cache_bytes_per_token"].items():
        t.add_row(f"KV cache per token ({d}, mean over {s['seq_len']})" if spans else f"KV cache per token ({d})",
                  fmt_bytes(v))
    for d, v in s["weight_bytes"].items():
        t.add_row(f"weights ({d})", fmt_bytes(v))
    console.print(t)


@app.command()
def hardware(
    name: Annotated[str | None, typer.Argument(help="Preset (e.g. h100-sxm, tpu-v5e) or a YAML path; omit to list.")] = None,
    json_out: JsonOpt = False,
) -> None:
    """Chip specifications: peak FLOP/s, HBM, links, price — with their sources."""
    chips = [load_chip(name)] if name else [load_chip(n) for n in preset_chips()]
    if json_out:
        print_json(_chip_json(chips[0]) if name else [_chip_json(c) for c in chips])
        return
    t = Table(title="hardware")
    # the datasheet's "GB" of HBM are binary (80 GB = 80 GiB of HBM3 stacks); what an allocator gets is the usable
    # GiB, which exceeds the decimal reading (session 23, QA finding: 'usable' above 'hbm_bytes' read as a bug)
    hbm_col = "HBM (datasheet GB; usable)"
    for col in ("chip", "bf16", "fp8", "int8", hbm_col, "HBM BW", "fast link/chip", "domain", "scale-out/chip", "$/h",
                "price basis"):
        t.add_column(col, justify="right" if col not in ("chip", "price basis") else "left", no_wrap=col == hbm_col)
    for c in chips:  # HBM: the datasheet's decimal GB, then what an allocator gets in GiB
        p = c.peak_flops_per_s
        t.add_row(c.name, *(fmt_rate(p[d], "FLOP") if d in p else "—" for d in ("bf16", "fp8", "int8")),
                  f"{c.hbm_bytes / 1e9:.0f} GB ({fmt_bytes(c.usable_hbm_bytes)} usable)", fmt_rate(c.hbm_bandwidth_bytes_per_s, "B"),
                  fmt_rate(c.links.fast_bandwidth_bytes_per_s, "B"),
                  ("x".join(map(str, c.links.max_slice_shape)) + " torus") if c.links.is_torus
                  else f"{c.links.nvlink_domain_size} {c.links.fast_label}",
                  fmt_rate(c.links.scale_out_bandwidth_bytes_per_s, "B"), f"{c.price_per_chip_hour:.2f}",
                  c.price_basis)
    console.print(t)
    if name:
        _print_on_chip_and_fabric(chips[0])
        for field, src in chips[0].sources.items():
            console.print(f"[dim]{field}: {src}[/dim]")


def _chip_json(c: Chip) -> dict:
    """`hardware --json`: the spec, plus the derived SuperPod structure (book ch.12) where the spec has one."""
    d = c.as_dict()
    if c.superpod and not c.links.is_torus:
        d["superpod_structure"] = superpod(c).as_dict()
    return d


def _print_on_chip_and_fabric(c: Chip) -> None:
    """On-chip memories (book ch.2 VMEM, ch.12 SMEM/L2/registers) and the SuperPod levels (ch.12)."""
    if c.on_chip_memory:
        t = Table(title=f"on-chip memory of {c.name} (book ch.2, ch.12)")
        t.add_column("memory")
        t.add_column("value", justify="right")
        for k, v in c.on_chip_memory.items():
            t.add_row(k, fmt_rate(v, "B") if k.endswith("_per_s") else f"{v:.0f}" if k == "sm_count" else fmt_bytes(v))
        console.print(t)
    if c.superpod and not c.links.is_torus:
        sp = superpod(c)
        t = Table(title=f"{c.name} SuperPod (book ch.12): {sp.gpus} GPUs, {sp.nodes} nodes, {sp.su_count} SUs of "
                        f"{sp.nodes_per_su} nodes, {sp.total_switches} switches, node egress "
                        f"{fmt_rate(sp.node_egress_bytes_per_s, 'B')}")
        for col in ("level", "GPUs", "switches", "unit bandwidth", "per GPU"):
            t.add_column(col, justify="left" if col == "level" else "right")
        for lv in sp.levels:
            t.add_row(lv.name, str(lv.gpus), str(lv.switches), fmt_rate(lv.unit_bandwidth_bytes_per_s, "B"),
                      fmt_rate(lv.per_gpu_bytes_per_s, "B"))
        console.print(t)


def _parse_op(text: str, default_dtype: str = "bf16") -> rf.Op:
    """`matmul:B,D,F`, `attention:B,T,S,N,K,H`, `elementwise:n`, with an optional `@dtype` suffix (else
    `default_dtype`, the command's --dtype). The row keeps the suffix in its name."""
    body, _, dtype = text.partition("@")
    kind, _, dims_s = body.partition(":")
    try:
        dims = [float(x) for x in dims_s.split(",") if x.strip()]
    except ValueError:
        fail(f"bad op '{text}': sizes must be numbers")
    dtype = dtype or default_dtype
    name = f"{body}@{dtype}" if dtype != "bf16" else body
    want = {"matmul": 3, "attention": 6, "elementwise": 1, "dot": 1}
    if kind not in want:
        fail(f"unknown op kind '{kind}' (known: {', '.join(want)})")
    if len(dims) != want[kind]:
        fail(f"op '{kind}' takes {want[kind]} sizes, got {len(dims)} in '{text}'")
    dims = [DIM.check(d, f"op '{text}': size {i + 1}") for i, d in enumerate(dims)]
    if kind == "matmul":
        return rf.matmul(*dims, lhs_dtype=dtype, rhs_dtype=dtype, name=name)
    if kind == "attention":
        B, T, S, N, K, H = dims
        if int(N) % int(K):  # grouped-query attention: each KV head serves N/K query heads (book ch.4)
            fail(f"op '{text}': {int(N)} query heads are not a multiple of {int(K)} KV heads")
        return rf.attention(B, T, S, int(N), int(K), int(H), dtype=dtype, name=name)
    if kind == "dot":
        return rf.dot_product(dims[0], dtype)
    return rf.elementwise(dims[0], dtype=dtype, name=name)


@app.command()
def roofline(
    hardware_name: Annotated[str, typer.Option("--hardware", "-h", help="Chip preset or YAML path.")],
    model_name: Annotated[str | None, typer.Option("--model", "-m", help="Model: per-layer roofline.")] = None,
    op: Annotated[list[str] | None, typer.Option(help="Op(s): matmul:B,D,F  attention:B,T,S,N,K,H  elementwise:n, each with an optional "
                                                                "@dtype suffix (e.g. matmul:256,8192,8192@int8; default: --dtype)")] = None,
    tokens_per_chip: Annotated[int, typer.Option(help="Tokens per chip for the model roofline.")] = 4096,
    seq_len: Annotated[int | None, typer.Option(help="Sequence length (default: min(model's, tokens)).")] = None,
    dtype: Annotated[str, typer.Option(help="Compute dtype of the model's ops and of every --op without its own "
                                            "@dtype: bf16, fp8, int8.")] = "bf16",
    plot: Annotated[str | None, typer.Option(help="Write a log-log roofline PNG here.")] = None,
    ideal: Annotated[bool, typer.Option("--ideal", help="Print the book's ideal time beside meshplan's realistic "
                                                        "one (kernel efficiencies, launch overhead).")] = False,
    json_out: JsonOpt = False,
) -> None:
    """Roofline of ops, or of every op in one layer of a model, on one chip (book ch.1, 12)."""
    chip = load_chip(hardware_name)
    if not model_name and not op:
        fail("give --model or at least one --op")
    if tokens_per_chip <= 0:
        fail(f"--tokens-per-chip must be positive, got {tokens_per_chip}")
    if plot:
        from meshplan.report.plots import plot_path

        plot_path(plot)
    ops: list[rf.Op] = []
    if model_name:
        ops += rf.model_ops(load_model(model_name), tokens_per_chip, seq_len, dtype=dtype)
    ops += [_parse_op(o, dtype) for o in op or []]
    rows: list[rf.Roofline] = [rf.roofline(o, chip) for o in ops]
    if plot:
        from meshplan.report.plots import plot_roofline

        plot_roofline(rows, chip, plot, dtype=dtype)
    eff = default_efficiency(chip)
    real = [rf.realistic_time_s(o, chip, eff) for o in ops]
    crit = rf.chip_critical_batches(chip)
    if json_out:
        out = {"hardware": chip.name, "critical_intensity": chip.critical_intensity(dtype),
               "critical_batch": crit, "ops": [{**r.as_dict(), "realistic_s": t} for r, t in zip(rows, real, strict=True)]}
        if ideal:
            out["book_ideal"] = {"ops": [{"name": r.name, "time_s": r.t_lower_s, "realistic_s": t,
                                          "realistic_over_ideal": t / r.t_lower_s if r.t_lower_s else None}
                                         for r, t in zip(rows, real, strict=True)]}
        print_json(out)
        return
    t = Table(title=f"roofline on {chip.name} (critical intensity {chip.critical_intensity(dtype):.0f} FLOP/B)")
    cols = ["op", "FLOPs", "bytes", "intensity", "T_math", "T_mem", "lower", "upper", "bound"]
    cols += ["meshplan (realistic)", "realistic/ideal"] if ideal else []
    for col in cols:
        t.add_column(col, justify="left" if col in ("op", "bound") else "right")
    for r, real_s in zip(rows, real, strict=True):
        extra = [fmt_time(real_s), f"{real_s / r.t_lower_s:.2f}x" if r.t_lower_s else "—"] if ideal else []
        t.add_row(r.name, fmt_flops(r.flops), fmt_bytes(r.bytes), f"{r.intensity:.1f}", fmt_time(r.t_math_s),
                  fmt_time(r.t_mem_s), fmt_time(r.t_lower_s), fmt_time(r.t_upper_s), r.bound, *extra)
    console.print(t)
    console.print("critical batch (book ch.1, ch.7 §8.1: (C/W)·weight bytes/2, tokens per replica): "
                  + ", ".join(f"{k} {v:.0f}" for k, v in crit.items()), highlight=False)
    if ideal:
        console.print("[dim]ideal = the book's roofline (peak FLOPs, peak HBM bandwidth, perfect overlap); "
                      f"realistic = meshplan's kernel efficiencies ({eff.origin}) and launch overhead[/dim]")
    if plot:
        console.print(f"wrote {plot}")
