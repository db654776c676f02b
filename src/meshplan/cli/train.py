"""`meshplan train`: the training planner."""

from __future__ import annotations

from dataclasses import replace
from typing import Annotated

import typer
from rich.table import Table

from meshplan.cli.app import Pin, app, console, fail, print_json
from meshplan.cli.net import SliceOpt, parse_slice_shape
from meshplan.cost.efficiency import resolve_efficiency
from meshplan.cost.topology import make_cluster
from meshplan.errors import MeshplanError
from meshplan.math.transformer import RECOMPUTE_HELP
from meshplan.specs.hardware import load_chip, price_label, with_price
from meshplan.specs.model import load_model
from meshplan.train.costmodel import (
    ATTENTION_KERNELS,
    CP_IMPLS,
    CUDA_GRAPH_SCOPES,
    FP8_SCOPES,
    MOE_DISPATCHERS,
    Options,
    fp8_recipes,
)
from meshplan.train.frameworks import framework_options
from meshplan.train.ideal import ideal_training
from meshplan.train.planner import plan
from meshplan.train.space import PP_SCHEDULES, Pins, Problem, expert_tp_degree
from meshplan.units import fmt_bytes, fmt_time
from meshplan.validate import TRAIN_TOKENS


def build_problem(model: str, hardware: str, chips: int, seq_len: int, global_batch: int,
                  slice_shape: str | None = None) -> Problem:
    for name, v in (("--chips", chips), ("--seq-len", seq_len), ("--global-batch", global_batch)):
        if v <= 0:
            fail(f"{name} must be positive, got {v}")
    chip, shape = load_chip(hardware), parse_slice_shape(slice_shape)
    if shape:
        make_cluster(chip, chips, shape)  # a shape that does not divide the chips or fit the pod fails here, clearly
    return Problem(load_model(model), chip, chips, seq_len, global_batch, shape)


def parse_tokens(text: str | None) -> float | None:
    if text is None:
        return None
    try:
        v = float(text.replace("_", ""))
    except ValueError:
        fail(f"--tokens must be a number such as 15e12, got '{text}'")
    return TRAIN_TOKENS.check(v, "--tokens")


@app.command()
def train(
    # required unless --from FILE states them (checked below)
    model: Annotated[str | None, typer.Option("--model", "-m", help="Preset or HF config.json.")] = None,
    hardware: Annotated[str | None, typer.Option("--hardware", help="Chip preset or YAML.")] = None,
    chips: Annotated[int | None, typer.Option(help="Number of chips.")] = None,
    seq_len: Annotated[int | None, typer.Option(help="Sequence length (tokens).")] = None,
    global_batch: Annotated[int | None, typer.Option(help="Global batch in sequences.")] = None,
    tokens: Annotated[str | None, typer.Option(help="Training tokens: adds wall-clock days and cost.")] = None,
    dp: Pin = None, fsdp: Pin = None, tp: Pin = None, pp: Pin = None, vpp: Pin = None, cp: Pin = None,
    ep: Pin = None, microbatch: Pin = None,
    etp: Annotated[int | None, typer.Option(
        help="Expert tensor parallel size (Megatron-Core --expert-tensor-parallel-size): 1 = whole experts on each "
             "rank, the EP group on consecutive ranks (Megatron-Bridge's MoE recipes, the nemo preset), or the --tp "
             "degree (Megatron-LM's default). Unset: the framework's (ETP = TP without one).")] = None,
    recompute: Annotated[str | None, typer.Option(help=RECOMPUTE_HELP)] = None,
    zero: Annotated[int | None, typer.Option(help="ZeRO stage over the dp group: 0, 1, 2, or 3 (= FSDP over those ranks: --dp 32 --zero 3 is --fsdp 32).")] = None,
    offload: Annotated[float | None, typer.Option(help="Fraction of activations offloaded to host memory.")] = None,
    offload_optimizer: Annotated[int | None, typer.Option(
        help="1: optimizer state and Adam on the host CPU (ZeRO-Offload); 0: on the device. Unset: searched.")] = None,
    offload_params: Annotated[int | None, typer.Option(
        help="1: weights on the host, streamed per layer (ZeRO-Infinity); 0: on the device. Unset: searched.")] = None,
    offload_delayed_update: Annotated[bool | None, typer.Option(
        "--offload-delayed-update/--no-offload-delayed-update",
        help="With optimizer offload, ZeRO-Offload's one-step delayed update: the host's Adam overlaps the next step.")
    ] = None,
    sequence_parallel: Annotated[bool, typer.Option("--sp/--no-sp", help="Sequence parallelism with TP.")] = True,
    distribute_saved_activations: Annotated[bool | None, typer.Option(
        "--distribute-saved-activations/--no-distribute-saved-activations",
        help="Full recompute keeps 1/tp of each checkpointed layer input per TP rank and all-gathers it in the "
             "backward (Megatron-LM --distribute-saved-activations, DeepSpeed partition_activations); needs --no-sp."
    )] = None,
    sparsecore_reduce: Annotated[bool | None, typer.Option(
        "--sparsecore-reduce/--no-sparsecore-reduce",
        help="TPU: the gradient reductions run on the SparseCores (XLA's SparseCore all-reduce offload, MaxText "
             "ENABLE_SPARSECORE_OFFLOADING_FOR_ALL_REDUCE on v6e), so their merges take no TensorCore time."
    )] = None,
    iota_embedding: Annotated[bool | None, typer.Option(
        "--iota-embedding/--no-iota-embedding",
        help="TPU: the token embedding as a one-hot matmul on the MXU (MaxText use_iota_embed, set by the v6e "
             "recipes), 2 x tokens x vocab x d_model FLOPs forward and again for the table gradient, not a gather."
    )] = None,
    dtype: Annotated[str, typer.Option(help="Matmul precision: bf16 or fp8.")] = "bf16",
    weight_dtype: Annotated[str | None, typer.Option(
        help="Stored weights without a separate fp32 master (MaxText's weight_dtype): bf16 or fp32; gradients and "
             "Adam moments take it too. Unset: mixed precision with an fp32 master copy.")] = None,
    headroom: Annotated[float, typer.Option(help="Fraction of HBM kept free.")] = 0.05,
    tp_overlap: Annotated[bool | None, typer.Option("--tp-overlap/--no-tp-overlap",
                                                    help="Collective-matmul TP overlap (default: on for TPU).")] = None,
    framework: Annotated[str | None, typer.Option(
        help="Apply a framework's behaviour: megatron, nemo, torchtitan, maxtext, deepspeed or jax (src/meshplan/"
             "train/frameworks.py), or NAME@VERSION for a release that behaved differently (e.g. nemo@24.07: TE delayed "
             "scaling); explicit flags win. Only layouts the framework can run are ranked (its --export judges).")] = None,
    fused: Annotated[bool | None, typer.Option("--fused/--no-fused",
                                               help="Pointwise ops fused (torch.compile, XLA; default); --no-fused "
                                                    "for eager PyTorch.")] = None,
    fused_loss: Annotated[bool | None, typer.Option(
        "--fused-loss/--no-fused-loss",
        help="Fused cross-entropy (Megatron, XLA; default); --no-fused-loss for an eager PyTorch loss on fp32 "
             "logits (torchtitan), which holds twice the loss memory.")] = None,
    fp8_weight_cache: Annotated[bool | None, typer.Option(
        "--fp8-weight-cache/--no-fp8-weight-cache",
        help="With --dtype fp8: weights cast once per step (Transformer Engine; default); --no-fp8-weight-cache "
             "casts them on every forward (torchao float8, torchtitan).")] = None,
    fp8_fused_casts: Annotated[bool | None, typer.Option(
        "--fp8-fused-casts/--no-fp8-fused-casts",
        help="With --dtype fp8: casts fused as Transformer Engine fuses them (norms emit fp8, fused "
             "cast-transpose, delayed scaling; default); --no-fp8-fused-casts for torchao's dynamic scaling, an "
             "amax pass and a cast per operand (torchtitan).")] = None,
    fp8_recipe: Annotated[str | None, typer.Option(
        help="With --dtype fp8: the scaling recipe (src/meshplan/cost/data/fp8_recipes.yaml): tensorwise (dynamic "
             "per-tensor: torchao's default, TE current scaling), rowwise (torchao rowwise: slower GEMMs, operands "
             "requantised for the backward), blockwise (DeepSeek-V3 1x128/128x128 tiles; MXFP8 on Blackwell) or "
             "delayed (TE amax history). Default: delayed with fused casts, tensorwise without.")] = None,
    fp8_scope: Annotated[str | None, typer.Option(
        help="With --dtype fp8: which GEMMs run in FP8: all (every linear but the output layer; default) or experts "
             "(the routed experts' grouped GEMMs only, the rest bf16: torchtitan's quantize.grouped_mm converters "
             "alone). MoE models only for experts.")] = None,
    dp_overlap: Annotated[bool | None, typer.Option(
        "--dp-overlap/--no-dp-overlap",
        help="Data-parallel gradient reduction hidden behind the backward (default: yes on GPU, bucketed DDP; no "
             "on TPU, where XLA runs it after a scanned layer loop).")] = None,
    ep_overlap: Annotated[bool | None, typer.Option(
        "--ep-overlap/--no-ep-overlap",
        help="MoE all-to-alls hidden behind another micro-batch's compute (DeepSeek-V3 DualPipe, Megatron-Core "
             "A2A overlap); default off: exposed (GShard).")] = None,
    moe_node_limit: Annotated[int | None, typer.Option(
        help="Node-limited MoE routing: each token reaches at most this many nodes and crosses the network once "
             "per node (DeepSeek-V3 uses 4).")] = None,
    moe_force_balance: Annotated[bool | None, typer.Option(
        "--moe-force-balance/--no-moe-force-balance",
        help="MoE routing by random logits, as benchmarks run it (Megatron-Core --moe-router-force-load-balancing): "
             "no expert load imbalance; default off: the busiest rank carries a learned router's skew.")] = None,
    moe_dispatcher: Annotated[str | None, typer.Option(
        help="MoE token dispatcher: alltoall (default: Megatron-Core's, one copy per routed expert), deepep or "
             "hybridep (the flex dispatcher: one copy per destination rank, one per node across nodes).")] = None,
    cuda_graph: Annotated[str | None, typer.Option(
        help="CUDA-graph capture, as Megatron-Core names its scopes: comma-separated attn, mlp, moe, moe_router, "
             "moe_preprocess, or full_iteration, or none (default: eager, every kernel issued by the CPU).")] = None,
    zero3_fetch: Annotated[str | None, typer.Option(
        help="How FSDP/ZeRO-3 fetches weights: allgather (default: FSDP, DeepSpeed since ZeRO-Infinity) or "
             "broadcast (the ZeRO paper's owner broadcast, DeepSpeed before April 2021: one link per fetch, "
             "blocking).")] = None,
    cp_impl: Annotated[str | None, typer.Option(
        help="How context parallelism runs attention: ring (default: Ring Attention passing GQA-sized K/V blocks, "
             "Megatron-Core/Transformer Engine) or torch (PyTorch's context_parallel as torchtitan runs it: K/V "
             "repeated to every head, all-gathered per layer, fp32 merges) or allgather (GQA-sized K/V all-gathered "
             "per layer, gradients reduce-scattered: the JAX program of meshplan verify).")] = None,
    attention_kernel: Annotated[str | None, typer.Option(
        help="Fused attention kernel: fused (default: the chip's best, FA3/cuDNN on Hopper as Megatron-Core and "
             "MaxText run it), fa2 (the flash-attn package's FlashAttention-2: nanotron, llm-foundry) or sdpa "
             "(PyTorch SDPA, which picks its bundled FA2 first: torchtitan). Both FA2s run at about half FA3's "
             "rate on Hopper. cudnn-9.10: cuDNN's kernel as release 9.10 ran it (mid-2025 stacks, e.g. NeMo 25.04; "
             "on Blackwell 20-25% slower than today's; other chips as fused).")] = None,
    pp_schedule: Annotated[str | None, typer.Option(
        help="Pipeline schedule: 1f1b (default; interleaved with --vpp), zb1p (zero-bubble ZB-H1: weight-gradient "
             "GEMMs fill the bubble), dualpipe (DeepSeek-V3: two directions, twice the model state per rank) or gpipe "
             "(all forwards, then all backwards: every micro-batch's activations held; with --vpp looped breadth-first, "
             "where ZeRO-2 reduces each chunk's gradients once a step).")] = None,
    pp_overlap: Annotated[bool | None, typer.Option(
        "--pp-overlap/--no-pp-overlap",
        help="Interleaved pipeline sends hidden behind the next model chunk (Megatron-Core overlap_p2p_comm; on in "
             "the megatron and nemo presets).")] = None,
    pp_head_in_split: Annotated[bool | None, typer.Option(
        "--pp-head-in-split/--no-pp-head-in-split",
        help="Count the embedding and the loss as a layer each in the pipeline split (Megatron "
             "account_for_embedding/loss_in_pipeline_split).")] = None,
    slice_shape: SliceOpt = None,
    profile: Annotated[str | None, typer.Option(help="Calibrated profile JSON from `meshplan calibrate`.")] = None,
    top: Annotated[int, typer.Option(help="How many plans to show.")] = 5,
    price: Annotated[float | None, typer.Option(help="Dollars per chip-hour (default: the catalog's, with its "
                                                     "basis; `meshplan hardware H`).")] = None,
    plot: Annotated[str | None, typer.Option(help="Write PNGs (memory, schedule, MFU vs chips) to this folder.")] = None,
    ideal: Annotated[bool, typer.Option("--ideal", help="Also the book's ideal step (peak FLOPs, comms hidden, no "
                                                        "bubble) beside each plan; --json key 'book_ideal'.")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="Print the DESIGN.md JSON object.")] = False,
    html: Annotated[str | None, typer.Option(help="Write the result as a self-contained HTML page.")] = None,
    from_file: Annotated[str | None, typer.Option(
        "--from", help="Predict a framework's own config (torchtitan .toml, Megatron arguments, MaxText .yml, NeMo "
                       ".yaml, DeepSpeed .json) and show the best layouts beside it.")] = None,
    export: Annotated[str | None, typer.Option(
        help="Write the plan as a framework's config: torchtitan, megatron, nemo, maxtext or deepspeed (plans with "
             "that framework's behaviour).")] = None,
    out_dir: Annotated[str | None, typer.Option("--out", help="Folder --export writes to.")] = None,
    rank: Annotated[int | None, typer.Option(
        help="Which plan --export writes (default: the best the framework can express).")] = None,
) -> None:
    """Search every parallel layout; predict step time, MFU, memory; explain the best."""
    from meshplan.cli.export import export_pins, framework_exporter, framework_plans, train_framework, train_from

    if from_file is None:
        for flag, v in (("--model", model), ("--hardware", hardware), ("--chips", chips), ("--seq-len", seq_len),
                        ("--global-batch", global_batch)):
            if v is None:
                fail(f"missing option {flag} (or read a framework's config with --from FILE)")
    elif hardware is None:
        fail("missing option --hardware (a framework's config does not name the chip)")
    elif export or plot or html or ideal or tokens:
        fail("--from predicts a framework's file; it does not combine with --export, --plot, --html, --ideal or "
             "--tokens")
    framework = train_framework(export, framework)
    if export is None and (out_dir is not None or rank is not None):
        fail("--out and --rank go with --export FRAMEWORK")
    if from_file is None:
        problem = build_problem(model, hardware, chips, seq_len, global_batch, slice_shape)
        problem = replace(problem, chip=with_price(problem.chip, price))
    if dtype not in ("bf16", "fp8"):
        fail(f"--dtype must be bf16 or fp8, got '{dtype}'")
    if not 0 <= headroom < 1:
        fail(f"--headroom is a fraction in [0, 1), got {headroom}")
    if top < 1:
        fail(f"--top must be at least 1, got {top}")
    if dtype == "fp8" and from_file is None:
        problem.chip.peak("fp8")
    pins = Pins(dp=dp, fsdp=fsdp, tp=tp, pp=pp, vpp=vpp, cp=cp, ep=ep, microbatch=microbatch,
                recompute=recompute, zero=zero, offload=offload, sequence_parallel=sequence_parallel,
                offload_optimizer=offload_optimizer, offload_params=offload_params)
    # the search keeps to what the framework can run (its exporter's PINS), for --export and for --framework alike
    pins = export_pins(export or framework_exporter(framework), pins)
    if moe_node_limit is not None and moe_node_limit < 1:
        raise MeshplanError(f"--moe-node-limit must be at least 1 node, got {moe_node_limit}")
    _check_choice("--zero3-fetch", zero3_fetch, ("allgather", "broadcast"))
    _check_choice("--cp-impl", cp_impl, tuple(CP_IMPLS))
    _check_choice("--moe-dispatcher", moe_dispatcher, MOE_DISPATCHERS)
    _check_choice("--pp-schedule", pp_schedule, PP_SCHEDULES)
    graph_scopes = None if cuda_graph is None else _graph_scopes(cuda_graph)
    _check_choice("--attention-kernel", attention_kernel, ATTENTION_KERNELS)
    _check_choice("--fp8-recipe", fp8_recipe, tuple(fp8_recipes()))
    _check_choice("--fp8-scope", fp8_scope, FP8_SCOPES)
    _check_choice("--weight-dtype", weight_dtype, ("bf16", "fp32"))
    w_bytes = {"bf16": 2.0, "fp32": 4.0}.get(weight_dtype or "")
    explicit = dict(
        expert_tp=_expert_tp(etp, tp, sequence_parallel),
        tp_overlap=tp_overlap, fused_elementwise=fused, zero3_fetch=zero3_fetch, fused_loss=fused_loss,
        fp8_weight_cache=fp8_weight_cache, fp8_fused_casts=fp8_fused_casts, ep_overlap=ep_overlap,
        dp_overlap=dp_overlap, moe_node_limit=moe_node_limit, moe_force_balance=moe_force_balance,
        moe_dispatcher=moe_dispatcher, cp_impl=cp_impl, pp_schedule=pp_schedule, attention_kernel=attention_kernel,
        fp8_recipe=fp8_recipe, fp8_scope=fp8_scope, offload_delayed_update=offload_delayed_update, pp_overlap=pp_overlap,
        pp_head_in_split=pp_head_in_split, weight_dtype_bytes=w_bytes, grad_reduce_bytes=w_bytes,
        cuda_graph_scopes=graph_scopes, distribute_saved_activations=distribute_saved_activations,
        sparsecore_reduce=sparsecore_reduce, iota_embedding=iota_embedding)
    if from_file is not None:
        train_from(from_file, model=model, hardware=hardware, chips=chips, seq_len=seq_len, global_batch=global_batch,
                   slice_shape=parse_slice_shape(slice_shape), profile=profile, headroom=headroom, top=top,
                   json_out=json_out, pins=pins, explicit=explicit,
                   check_flags=lambda prob, file_pins, file_dtype: _check_combinations(prob, file_pins, file_dtype,
                                                                                       explicit))
        return
    _check_combinations(problem, pins, dtype, explicit)
    eff = resolve_efficiency(problem.chip, profile)
    opts = framework_options(framework, Options(compute_dtype=dtype, headroom=headroom), explicit)
    result = plan(problem, pins, eff, opts, top=top, tokens=parse_tokens(tokens))
    skipped = None
    if export is None:  # --framework: rank only what the framework can run (its exporter judges, as --export does)
        result, skipped = framework_plans(framework, problem, result, opts, model,
                                          more=lambda n: plan(problem, pins, eff, opts, top=n))
    if export:
        from meshplan.cli.export import write_train_export

        write_train_export(export, out_dir, rank, problem, result, opts, model,
                           more=lambda n: plan(problem, pins, eff, opts, top=n))
    if plot:
        from meshplan.report.train_plots import write_train_plots

        write_train_plots(plot, problem, pins, eff, opts, result)
    if html:
        from meshplan.report.train_plots import mfu_scaling
        from meshplan.web.page import train_view, write_html

        inputs = dict(model=model, hardware=hardware, chips=chips, seq_len=seq_len, global_batch=global_batch,
                      dtype=dtype, framework=framework, dp=dp, fsdp=fsdp, tp=tp, pp=pp, vpp=vpp, cp=cp, ep=ep,
                      microbatch=microbatch, recompute=recompute, zero=zero)
        write_html(html, train_view(result.as_dict(), inputs, mfu_scaling(problem, pins, eff, opts)))
    out = result.as_dict()
    if skipped:
        out["framework_skipped"] = skipped
    if ideal:  # book ch.6: model FLOPs / (N x C) at the bf16 peak, the MFU basis (DESIGN.md)
        for p in out["plans"]:
            p["book_ideal"] = ideal_training(p, chips, problem.chip.peak("bf16"))
    if json_out:
        # what was planned, so that `meshplan verify --plan` can rebuild the same problem
        print_json({**out, "problem": {"model": model, "hardware": hardware, "chips": chips, "seq_len": seq_len,
                                       "global_batch": global_batch, "framework": framework}})
        return
    show(problem, result, opts)
    if skipped:
        console.print(f"note: {skipped}", markup=False, highlight=False)
    if ideal and out["plans"]:
        b, p = out["plans"][0]["book_ideal"], out["plans"][0]
        console.print(f"book (ideal, ch.6): step {fmt_time(b['step_time_s'])} at MFU 1 (peak FLOPs, comms hidden, "
                      f"no bubble; {fmt_time(b['step_time_with_recompute_s'])} with recomputation) vs meshplan "
                      f"{fmt_time(p['step_time_s'])} (MFU {p['mfu']:.1%}): {b['realistic_over_ideal']:.2f}x",
                      highlight=False)


def _expert_tp(etp: int | None, tp: int | None, sequence_parallel: bool) -> bool | None:
    """Options.expert_tp for `--etp` (None = not given): 1 -> False (whole experts); the TP degree -> True. Any other
    size is refused (meshplan models ETP = 1 or TP); ETP 1 under TP needs sequence parallelism (Megatron-Core
    arguments.py: "When using MoE and tensor parallelism, sequence parallelism must be used")."""
    if etp is None:
        return None
    if etp == 1:
        if not sequence_parallel and (tp or 1) > 1:
            raise MeshplanError("--etp 1 needs sequence parallelism with --tp > 1 (Megatron-Core requires SP for MoE "
                                "with TP): drop --no-sp")
        return False
    if tp is None or etp != tp:
        raise MeshplanError(f"--etp is 1 or the --tp degree (pin --tp {etp} for ETP = TP), got --etp {etp}"
                            + (f" with --tp {tp}" if tp is not None else " with --tp unpinned"))
    return True


def _check_choice(flag: str, value: str | None, choices: tuple[str, ...]) -> None:
    """A clear error for a word-valued flag outside its choices (None = not given)."""
    if value is not None and value not in choices:
        allowed = " or ".join(choices) if len(choices) == 2 else "one of " + ", ".join(choices)
        raise MeshplanError(f"{flag} must be {allowed}, got '{value}'")


def _graph_scopes(text: str) -> tuple[str, ...]:
    """`--cuda-graph attn,mlp` -> ("attn", "mlp"); `none` -> (); an empty item or `none` among scopes is refused."""
    items = text.replace(" ", "").split(",")
    if "" in items or ("none" in items and len(items) > 1):
        raise MeshplanError(f"--cuda-graph must be none or a comma list of {', '.join(CUDA_GRAPH_SCOPES)}, got "
                            f"'{text[:60]}'")
    for scope in items:
        if scope != "none":
            _check_choice("--cuda-graph", scope, CUDA_GRAPH_SCOPES)
    return tuple(x for x in items if x != "none")


def _check_combinations(problem: Problem, pins: Pins, dtype: str, explicit: dict) -> None:
    """A flag that cannot apply to the model, chip or pinned layout is refused in one line, not ignored (flags
    from a --framework preset are not checked: a preset applies to every model)."""
    def given(*names: str) -> list[str]:
        return ["--" + n.replace("_", "-") for n in names if explicit[n] not in (None, False)]

    moe = given("moe_dispatcher", "moe_force_balance", "moe_node_limit", "ep_overlap") + (
        ["--etp"] if explicit["expert_tp"] is not None else [])
    if moe and not problem.model.is_moe:
        fail(f"{moe[0]} needs a MoE model ({problem.model.name} has no experts)")
    pp = given("pp_overlap", "pp_head_in_split") + (["--pp-schedule"] if explicit["pp_schedule"] not in (None, "1f1b")
                                                    else [])
    if pp and pins.pp == 1:
        fail(f"{pp[0]} needs pipeline parallelism and the layout pins pp=1: drop it")
    fp8 = given("fp8_recipe", "fp8_weight_cache", "fp8_fused_casts", "fp8_scope")
    if fp8 and dtype != "fp8":
        fail(f"{fp8[0]} goes with --dtype fp8 (the matmuls are {dtype})")
    if explicit["fp8_scope"] == "experts" and not problem.model.is_moe:
        fail(f"--fp8-scope experts needs a MoE model ({problem.model.name} has no experts)")
    if explicit["sparsecore_reduce"] and problem.chip.kind != "tpu":
        fail(f"--sparsecore-reduce needs a TPU ({problem.chip.name} is a {problem.chip.kind.upper()})")
    if explicit["iota_embedding"] and problem.chip.kind != "tpu":
        fail(f"--iota-embedding needs a TPU ({problem.chip.name} is a {problem.chip.kind.upper()})")
    if explicit["cuda_graph_scopes"] and problem.chip.kind != "gpu":
        fail(f"--cuda-graph needs a GPU ({problem.chip.name} is a {problem.chip.kind.upper()})")
    if explicit["distribute_saved_activations"]:
        # Megatron-LM's checks (arguments.py: TP > 1 and full recompute granularity; Megatron-Core's TransformerConfig
        # refuses it with sequence parallelism, whose saved layer input is already split over TP)
        if pins.sequence_parallel:
            fail("--distribute-saved-activations goes with --no-sp (under SP the saved layer input is already 1/tp)")
        if pins.recompute not in (None, "full"):
            fail(f"--distribute-saved-activations needs full recompute (the layout pins {pins.recompute})")
        if pins.tp == 1:
            fail("--distribute-saved-activations needs tensor parallelism and the layout pins tp=1: drop it")


def assumptions(problem: Problem, opts: Options, config: dict | None = None) -> str:
    """The framework behaviour the plan assumes, in words (each is a flag; docs/cost_model.md); `config`: the plan's
    layout, where a choice depends on it (the experts' TP split: space.expert_tp_degree)."""
    tp, dp = opts.overlaps(problem.chip.kind)
    fp8 = opts.compute_dtype == "fp8"
    parts = [f"{opts.compute_dtype} matmuls" + (", fp8 weights cast once per step" if fp8 and opts.fp8_weight_cache
                                                else "") + (", fused fp8 casts (TE)" if fp8 and opts.fp8_fused_casts
                                                            else ", unfused fp8 casts (torchao)" if fp8 else "")
             + (f", {opts.fp8_scaling} fp8 scaling" if fp8 else "")
             + (", fp8 in the routed experts only" if fp8 and opts.fp8_scope == "experts" else ""),
             "TP collectives overlapped" if tp else "TP collectives exposed",
             "DP reduction behind the backward" if dp else "DP reduction after the backward",
             "fused pointwise" if opts.fused_elementwise else "eager pointwise",
             "fused loss" if opts.fused_loss else "eager fp32 loss",
             f"ZeRO-3 fetch by {opts.zero3_fetch}"]
    parts.append({"torch": "CP by PyTorch all-gather (repeated K/V, fp32 merges)", "ring": "CP by Ring Attention",
                  "allgather": "CP by all-gathered K/V"}[opts.cp_impl])
    if opts.attention_kernel != "fused":
        parts.append({"fa2": "FlashAttention-2", "sdpa": "PyTorch SDPA (its FlashAttention-2)",
                      "cudnn-9.10": "cuDNN 9.10 fused attention (mid-2025)"}[opts.attention_kernel])
    if opts.pp_schedule != "1f1b":
        parts.append({"zb1p": "zero-bubble (ZB-H1) pipeline", "dualpipe": "DualPipe pipeline",
                      "gpipe": "GPipe (all-forward-all-backward) pipeline"}[opts.pp_schedule])
    if opts.distribute_saved_activations:
        parts.append("full recompute's saved layer inputs split over TP, gathered in the backward")
    if problem.chip.kind == "tpu":
        parts.append("gradient reductions merged on the SparseCores" if opts.sparsecore_reduce
                     else "gradient reductions merged on the TensorCore")
        parts.append("embedding as a one-hot matmul (MaxText use_iota_embed)" if opts.iota_embedding
                     else "embedding by gather")
    if problem.model.is_moe:
        parts.append("MoE all-to-alls overlapped" if opts.ep_overlap else "MoE all-to-alls exposed")
        split = bool(opts.expert_tp)
        if config is not None and split:  # EP beyond the context x data ranks leaves whole experts (MoE folding)
            c = config
            split = float(expert_tp_degree(True, c["tp"], c["cp"], c["dp"] * c["fsdp"], c["ep"],
                                           c["sequence_parallel"] and c["tp"] > 1)) > 1
        parts.append("experts split over TP (ETP = TP)" if split else "whole experts per rank (ETP 1)")
        if opts.grouped_mm_kernel == "torch":
            parts.append("expert GEMMs by torch._grouped_mm")
    return "; ".join(parts)


def show(problem: Problem, result, opts: Options | None = None) -> None:
    best = result.plans[0]
    t = Table(title=f"{problem.model.name} on {problem.chips}× {problem.chip.name}, seq {problem.seq_len}, "
                    f"batch {problem.global_batch} — {result.searched} layouts in {result.search_time_s:.2f} s "
                    f"({result.feasible} fit)")
    for col in ("#", "layout", "step", "MFU", "HFU", "tok/s/chip", "compute", "exp. comm", "bubble", "memory"):
        t.add_column(col, justify="left" if col == "layout" else "right")
    for i, pl in enumerate(result.plans, 1):
        from meshplan.train.config import ParallelConfig

        cfg = ParallelConfig(**pl["config"])
        ts = pl["time_s"]
        t.add_row(str(i), cfg.describe(), fmt_time(pl["step_time_s"]), f"{pl['mfu']:.1%}", f"{pl['hfu']:.1%}",
                  f"{pl['tokens_per_s_per_chip']:.0f}", fmt_time(ts["compute"]), fmt_time(ts["exposed_comm"]),
                  fmt_time(ts["bubble"]), fmt_bytes(pl["memory_bytes_per_chip"]["total"]))
    console.print(t)
    mem = best["memory_bytes_per_chip"]
    host = best["ledger"]["host_bytes"]["memory"]  # offloaded activations, optimizer state, weights
    console.print("memory per chip (best): " + ", ".join(f"{k} {fmt_bytes(v)}" for k, v in mem.items())
                  + (f"; in host memory {fmt_bytes(host)}" if host else ""))
    console.print(f"mesh: {best['mesh']}")
    console.print(f"bottleneck: {best['bottleneck']} — {best['explanation']}")
    for note in best.get("notes", []):
        console.print(f"note: {note}")
    if opts is not None:
        console.print(f"[dim]assumes: {assumptions(problem, opts, best['config'])} (flags: meshplan train --help)"
                      "[/dim]")
    if "training" in best:
        tr = best["training"]
        console.print(f"{tr['tokens']:.3g} tokens: {tr['days']:.1f} days, ${tr['cost_usd']:,.0f} "
                      f"({tr['chip_hours']:,.0f} chip-hours at {price_label(problem.chip)})")
    if result.infeasible:
        reason, count = next(iter(result.infeasible.items()))
        console.print(f"[dim]rejected layouts: most often '{reason}' ({count})[/dim]")
