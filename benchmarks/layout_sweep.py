"""Plan layouts the way frameworks accept them, for every model and chip preset, and count what meshplan refuses.

    PYTHONPATH=src python benchmarks/layout_sweep.py [--n 1500] [--serve-n 600] [--search-n 300] [--seed 0] [--json]
                                                     [--show 20]

Issue #14's last target is that every published layout plans: no "does not map", no "does not fit" where the job ran.
The published rows cover a few hundred layouts; held-out runs bring others. This sweep draws layouts a framework would
launch, from every model preset on every chip preset, and runs `meshplan train` (and `serve`) with every degree pinned,
in process, through the CLI's own `main()`:

- train: chips in {8, 16, 64, 256, 1024} (a TPU's own slice sizes); tp a divisor of the query heads with the KV heads
  dividing or divided by it (Megatron-Core's rule, megatron/core/transformer/attention.py), at most the chip's fast
  domain for GPUs; pp dividing the layers (Megatron-Core without uneven stages); cp 1-4 at 8K+ tokens; for MoE an ep
  dividing the experts and dp x cp x tp (Megatron-Core expert-data-parallel groups, parallel_state.py); dp the rest;
  a micro-batch dividing the per-replica batch; recompute none / selective / full; dtype bf16 or fp8 where the chip
  has an FP8 peak; a framework preset (megatron, nemo, torchtitan, deepspeed; maxtext / jax on TPU).
- serve: tp over the chips (pp the rest), weights in bf16 or fp8 (KV in fp8 at times), engine default/vllm/sglang/
  trtllm on GPUs, ep and attention DP for MoE, driven at its best point, a fixed batch, closed-loop clients or
  simulated Poisson arrivals; requests inside the model's context window.
- search: training problems with no degree pinned, as a user first asks (meshplan searches every layout); a memory
  refusal where the model's states sharded over every chip (16 B per parameter) take under a quarter of HBM is a
  suspect.

Outcomes: ok (exit 0 and a sane plan: 0 < MFU <= 1, HFU <= 1, a finite positive step, tokens/s that equal the
batch's tokens over the step, the pinned degrees kept; serving: positive finite TTFT, TPOT and throughput, and
end-to-end latency = TTFT + (output - 1) x TPOT outside the simulation), refused for memory ("does not fit"), refused otherwise (the message, grouped), an
exception escaping main() (a defect), or a plan that is not sane (a defect). A "does not fit" is flagged as suspect
when the training states alone (bf16 weights, fp32 grads and Adam, sharded as pinned) take under a quarter of HBM at
micro-batch 1 with full recompute - a bound, not a prediction; suspects are listed for review, not counted as
defects. Deterministic for a seed.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import platform
import random
import signal
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "src") not in sys.path:
    sys.path.insert(0, str(ROOT / "src"))

from meshplan.cli.app import main  # noqa: E402
from meshplan.math.transformer import param_counts  # noqa: E402
from meshplan.specs.hardware import load_chip, preset_chips  # noqa: E402
from meshplan.specs.model import load_model, preset_models  # noqa: E402
from meshplan.train.frameworks import VERSIONS  # noqa: E402

GPU_CHIPS = (8, 16, 64, 256, 1024)
TPU_CHIPS = (8, 16, 64, 256, 512, 2048)  # beyond a slice: multi-slice over DCN
# the presets and, since session 42, each of their listed releases (`--framework nemo@25.04`)
GPU_FRAMEWORKS = ("megatron", "nemo", "torchtitan", "deepspeed", None) + tuple(
    f"{base}@{version}" for base in ("megatron", "nemo", "torchtitan", "deepspeed") for version in VERSIONS.get(base, {}))
TPU_FRAMEWORKS = ("maxtext", "jax", None)
ENGINES = ("default", "vllm", "sglang", "trtllm")


class Timeout(Exception):
    pass


def _alarm(signum, frame):  # pragma: no cover - only under a hang
    raise Timeout()


def run_cli(args: list[str], timeout_s: float) -> tuple[str, int, str, str]:
    """(outcome, exit code, stdout, stderr) of one in-process invocation; outcome 'exception' or 'hang' for a defect."""
    out, err = io.StringIO(), io.StringIO()
    signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = main(args)
        rc = 0 if rc is None else int(rc)
        outcome = "ran"
    except SystemExit as exc:
        rc = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        outcome = "ran"
    except Timeout:
        rc, outcome = -1, "hang"
    except Exception as exc:  # noqa: BLE001 - the sweep's point is to catch what escapes
        rc, outcome = -2, "exception"
        err.write(f"{type(exc).__name__}: {exc}")
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    return outcome, rc, out.getvalue(), err.getvalue()


def divisors(n: int, limit: int | None = None) -> list[int]:
    return [d for d in range(1, (limit or n) + 1) if n % d == 0]


def _tp_choices(m, chip) -> list[int]:
    """Megatron-Core: num_attention_heads % tp == 0 and (kv_heads % tp == 0 or tp % kv_heads == 0)."""
    cap = chip.links.nvlink_domain_size if chip.kind == "gpu" and chip.links.nvlink_domain_size > 1 else 8
    kv = max(m.n_kv_heads, 1)
    return [t for t in (1, 2, 4, 8, 16) if t <= min(cap, 16) and m.n_heads % t == 0 and (kv % t == 0 or t % kv == 0)]


def train_case(rng: random.Random, models: list[str], chips: list[str]) -> dict | None:
    name, hw = rng.choice(models), rng.choice(chips)
    m, chip = load_model(name), load_chip(hw)
    n = rng.choice(TPU_CHIPS if chip.kind == "tpu" else GPU_CHIPS)
    seq = rng.choice((2048, 4096, 8192))
    tp = rng.choice(_tp_choices(m, chip) or [1])
    pp = rng.choice([p for p in (1, 2, 4, 8, 16) if m.n_layers % p == 0 and p <= n // tp] or [1])
    cp = rng.choice([c for c in (1, 2, 4) if c == 1 or seq >= 8192])
    if n % (tp * pp * cp):
        return None
    dp = n // (tp * pp * cp)
    ep = 1
    if m.is_moe:
        ep = rng.choice([e for e in divisors(m.n_experts, 64) if (dp * cp * tp) % e == 0] or [1])
    gbs = dp * rng.choice((1, 2, 4, 8, 16))
    mb = rng.choice([b for b in (1, 2, 4) if (gbs // dp) % b == 0])
    recompute = rng.choice(("none", "selective", "full"))
    dtype = "fp8" if chip.peak_flops_per_s.get("fp8") and rng.random() < 0.3 else "bf16"
    framework = rng.choice(TPU_FRAMEWORKS if chip.kind == "tpu" else GPU_FRAMEWORKS)
    args = ["train", "-m", name, "--hardware", hw, "--chips", str(n), "--seq-len", str(seq), "--global-batch",
            str(gbs), "--dp", str(dp), "--tp", str(tp), "--pp", str(pp), "--cp", str(cp), "--microbatch", str(mb),
            "--recompute", recompute, "--dtype", dtype, "--top", "1", "--json"]
    if m.is_moe:
        args += ["--ep", str(ep)]
    if framework:
        args += ["--framework", framework]
    # the knobs a published run states beside its degrees, each drawn now and then
    if rng.random() < 0.3:  # FSDP over the data ranks (torchtitan's dp_shard, ZeRO-3) instead of replicas
        args[args.index("--dp")] = "--fsdp"
    elif rng.random() < 0.5:
        args += ["--zero", str(rng.choice((0, 1, 2)))]
    if pp > 1 and rng.random() < 0.5:
        vpps = [v for v in (2, 4) if m.n_layers % (pp * v) == 0]
        if vpps:
            args += ["--vpp", str(rng.choice(vpps))]
        args += ["--pp-schedule", rng.choice(("1f1b", "zb1p", "gpipe"))]
    if dtype == "fp8" and rng.random() < 0.5:
        args += ["--fp8-recipe", rng.choice(("tensorwise", "rowwise", "blockwise", "delayed"))]
    if dtype == "fp8" and m.is_moe and rng.random() < 0.3:  # session 41: FP8 on the routed experts alone
        args += ["--fp8-scope", "experts"]
    if m.is_moe and ep > 1 and rng.random() < 0.5:
        args += ["--moe-dispatcher", rng.choice(("alltoall", "deepep", "hybridep"))]
    if chip.kind == "gpu" and rng.random() < 0.2:
        args += ["--cuda-graph", rng.choice(("none", "attn", "attn,mlp", "full_iteration"))]
    if cp > 1 and rng.random() < 0.3:
        args += ["--cp-impl", rng.choice(("ring", "torch", "allgather"))]
    return {"args": args, "model": name, "hardware": hw, "chips": n, "tp": tp, "pp": pp, "dp": dp, "cp": cp, "ep": ep,
            "gbs": gbs, "seq": seq}


def serve_case(rng: random.Random, models: list[str], chips: list[str]) -> dict | None:
    name, hw = rng.choice(models), rng.choice(chips)
    m, chip = load_model(name), load_chip(hw)
    n = rng.choice((1, 2, 4, 8, 16))
    tp = rng.choice([t for t in _tp_choices(m, chip) if t <= n and n % t == 0] or [1])
    pp = n // tp
    if pp > 1 and m.n_layers % pp:
        return None
    quant = "fp8" if chip.peak_flops_per_s.get("fp8") and rng.random() < 0.4 else "bf16"
    # requests inside the model's context window (a longer one is refused by design: config.py)
    lengths = [(i, o) for i in (128, 1024, 4096) for o in (128, 1024) if i + o <= m.max_seq_len]
    if not lengths:
        return None
    inp, outp = rng.choice(lengths)
    args = ["serve", "-m", name, "--hardware", hw, "--chips", str(n), "--tp", str(tp), "--pp", str(pp),
            "--input-len", str(inp), "--output-len", str(outp),
            "--quant", quant, "--json"]
    if chip.kind == "gpu":
        args += ["--engine", rng.choice(ENGINES)]
    if m.is_moe and rng.random() < 0.5:
        args += ["--ep", str(rng.choice([e for e in divisors(m.n_experts, tp) if tp % e == 0] or [1]))]
        if tp > 1 and rng.random() < 0.5:
            args += ["--attention-dp"]
    # how the benchmark drives the engine: its best point, a fixed batch, closed-loop clients, Poisson arrivals
    mode = rng.choice(("best", "batch", "clients", "simulate"))
    if mode == "batch":
        args += ["--batch", str(rng.choice((1, 8, 64, 256)))]
    elif mode == "clients":
        c = rng.choice((1, 16, 128))
        args += ["--concurrency", str(c), "--requests", str(c * rng.choice((1, 4)))]
    elif mode == "simulate":
        args += ["--simulate", "--rate", str(rng.choice((0.5, 4.0, 32.0))), "--requests", "60"]
    if rng.random() < 0.2:
        args += ["--kv-quant", "fp8"]
    return {"args": args, "model": name, "hardware": hw, "chips": n, "tp": tp, "pp": pp, "mode": mode,
            "output_len": outp}


def search_case(rng: random.Random, models: list[str], chips: list[str]) -> dict | None:
    """A training problem with no degree pinned (meshplan searches), as a user first asks it."""
    name, hw = rng.choice(models), rng.choice(chips)
    chip = load_chip(hw)
    n = rng.choice(TPU_CHIPS if chip.kind == "tpu" else GPU_CHIPS)
    seq = rng.choice((2048, 4096, 8192))
    gbs = n * rng.choice((1, 2, 4))
    args = ["train", "-m", name, "--hardware", hw, "--chips", str(n), "--seq-len", str(seq), "--global-batch",
            str(gbs), "--top", "1", "--json"]
    fw = rng.choice(TPU_FRAMEWORKS if chip.kind == "tpu" else GPU_FRAMEWORKS)
    if fw:
        args += ["--framework", fw]
    return {"args": args, "model": name, "hardware": hw, "chips": n, "gbs": gbs, "seq": seq, "tp": 0, "pp": 0,
            "cp": 0, "dp": n, "ep": 1, "mode": "search"}


def states_fraction(case: dict) -> float:
    """A lower bound on the training states' share of HBM per chip at the pinned layout: bf16 weights and gradients
    (2 + 2 B) and Adam's fp32 master and moments (12 B) sharded over the whole data-parallel group (ZeRO-1, the
    Megatron distributed optimizer), the dense weights over tp x pp, the experts over pp x ep x the largest expert-TP
    the layout allows (ETP <= tp, ep x ETP dividing dp x cp x tp); under FSDP all 16 B over every rank of a stage. Activations and buffers excluded. For flagging
    suspect refusals only."""
    from meshplan.infer.memory import expert_params

    m, chip = load_model(case["model"]), load_chip(case["hardware"])
    pc = param_counts(m)
    experts = (pc.n_layers - pc.n_dense_layers) * m.n_experts * expert_params(m) if m.is_moe else 0.0
    dense = float(pc.total) - experts
    tp, pp, ep, dp, cp = case["tp"], case["pp"], max(case.get("ep", 1), 1), case["dp"], case["cp"]
    etp = max(t for t in range(1, tp + 1) if tp % t == 0 and (dp * cp * tp) % (ep * t) == 0)
    params = dense / (tp * pp) + experts / (pp * ep * etp)
    if "--fsdp" in case["args"]:
        # FSDP / ZeRO-3 shards the weights and gradients too; no state splits over more than the stage's dp x cp x tp
        # ranks (whole experts sharded over efsdp = dp x cp x tp / ep hold E / (pp x dp x cp x tp) a rank: session 41)
        return float(pc.total) * 16.0 / (pp * tp * dp * cp) / chip.hbm_bytes
    return params * (4.0 + 12.0 / (dp * cp)) / chip.hbm_bytes


def weights_fraction(case: dict) -> float:
    """The served weights' share of HBM per chip: every parameter at the --quant width over tp x pp (the experts split
    over the tp ranks whatever the ep, which divides tp). For flagging suspect serving refusals only."""
    m, chip = load_model(case["model"]), load_chip(case["hardware"])
    width = 1.0 if case["args"][case["args"].index("--quant") + 1] == "fp8" else 2.0
    return float(param_counts(m).total) * width / (case["tp"] * case["pp"]) / chip.hbm_bytes


def suspect_bound(kind: str, case: dict) -> tuple[float, float]:
    """(a lower bound on the memory's share of HBM, the share under which a memory refusal is a suspect) for one
    refused case; (inf, 0) where no bound applies. Pinned training at micro-batch 1 with full recompute: the states
    (`states_fraction`) under a quarter. Searched training: the whole model's states sharded over every chip (FSDP /
    ZeRO-3, 16 B per parameter) under a quarter. Serving without a pinned batch (a pinned batch's KV may well not
    fit): the weights (`weights_fraction`) under a half."""
    args = case["args"]
    if kind == "train":
        pinned_least = "full" in args and args[args.index("--microbatch") + 1] == "1"
        return (states_fraction(case), 0.25) if pinned_least else (math.inf, 0.0)
    if kind == "search":
        states = float(param_counts(load_model(case["model"])).total) * 16.0 / case["chips"]
        return states / load_chip(case["hardware"]).hbm_bytes, 0.25
    return (weights_fraction(case), 0.5) if case["mode"] != "batch" else (math.inf, 0.0)


def sane_train(doc: dict, case: dict) -> str | None:
    plans = doc.get("plans") or []
    if not plans:
        return "no plan in the output"
    p = plans[0]
    step = p.get("step_time_s")
    if not (isinstance(step, float) and math.isfinite(step) and step > 0):
        return f"step_time_s {step!r}"
    if not (0 < p["mfu"] <= 1.0) or not (0 < p["hfu"] <= 1.0):
        return f"mfu {p['mfu']:.3g} hfu {p['hfu']:.3g}"
    want = case["gbs"] * case["seq"] / step
    if abs(p["tokens_per_s"] / want - 1) > 1e-6:
        return f"tokens_per_s {p['tokens_per_s']:.6g} != batch tokens / step {want:.6g}"
    c = p["config"]
    for k in ("tp", "pp", "cp") if case.get("mode") != "search" else ():
        if c[k] != case[k]:
            return f"pinned {k}={case[k]} came back {c[k]}"
    return None


def sane_serve(doc: dict, case: dict) -> str | None:
    """Finite, positive latencies and throughput; a request's end-to-end latency is its first token plus
    (output - 1) token steps (the closed forms' definition; the simulation reports its own means, not checked)."""
    text = json.dumps(doc)
    if "NaN" in text or "Infinity" in text:
        return "NaN or Infinity in the output"
    for k in ("ttft_s", "tpot_s", "throughput_tokens_per_s"):
        if not (isinstance(doc.get(k), (int, float)) and doc[k] > 0):
            return f"{k} {doc.get(k)!r}"
    if case["mode"] != "simulate":
        e2e = doc["ttft_s"] + (case["output_len"] - 1) * doc["tpot_s"]
        if abs(doc["e2e_latency_s"] / e2e - 1) > 1e-6:
            return f"e2e_latency_s {doc['e2e_latency_s']:.6g} != ttft + (output - 1) x tpot = {e2e:.6g}"
    return None


def classify(outcome: str, rc: int, stderr: str) -> str:
    if outcome != "ran":
        return outcome
    if rc == 0:
        return "ok"
    if rc == 2 and stderr.count("\n") <= 1 and stderr.startswith("error:"):
        return "refused: memory" if "fit" in stderr else "refused: other"
    return "bad exit"


def sweep(kind: str, n: int, seed: int, timeout_s: float) -> dict:
    rng = random.Random(seed)
    models, chips = preset_models(), preset_chips()
    make = {"train": train_case, "serve": serve_case, "search": search_case}[kind]
    counts: Counter = Counter()
    messages: Counter = Counter()
    examples: dict[str, list[str]] = {}  # the first command line of each refusal message
    defects: list[dict] = []
    suspects: list[dict] = []
    t0 = time.perf_counter()
    done = 0
    while done < n:
        case = make(rng, models, chips)
        if case is None:
            continue
        done += 1
        outcome, rc, out, err = run_cli(case["args"], timeout_s)
        cls = classify(outcome, rc, err)
        if cls == "ok":
            try:
                doc = json.loads(out)
                bad = sane_serve(doc, case) if kind == "serve" else sane_train(doc, case)
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                bad = f"unreadable JSON: {exc}"
            if bad:
                cls = "insane plan"
                defects.append({"args": case["args"], "why": bad})
        elif cls in ("exception", "hang", "bad exit"):
            defects.append({"args": case["args"], "why": err.strip()[-400:]})
        elif cls == "refused: other":
            key = err.strip()[:160]
            messages[key] += 1
            examples.setdefault(key, case["args"])
        elif cls == "refused: memory":
            frac, limit = suspect_bound(kind, case)
            if frac < limit:
                suspects.append({"args": case["args"], "states_fraction": round(frac, 3), "why": err.strip()[:160]})
        counts[cls] += 1
    return {"kind": kind, "n": n, "seed": seed, "wall_s": round(time.perf_counter() - t0, 1), "counts": dict(counts),
            "refusals": [(msg, c, examples[msg]) for msg, c in messages.most_common()], "defects": defects, "suspects": suspects}


def report(res: dict, show: int) -> None:
    print(f"\n## {res['kind']}: {res['n']} layouts, seed {res['seed']}, {res['wall_s']} s")
    print("| outcome | count |\n|---|---|")
    for k, v in sorted(res["counts"].items(), key=lambda kv: -kv[1]):
        print(f"| {k} | {v} |")
    if res["refusals"]:
        print("\nrefusals other than memory (message, count):")
        for msg, c, args in res["refusals"][:show]:
            print(f"- {c} x {msg}\n  e.g. `meshplan {' '.join(args)}`")
    for title, rows in (("defects", res["defects"]), ("suspect memory refusals", res["suspects"])):
        if rows:
            print(f"\n{title} ({len(rows)}):")
            for r in rows[:show]:
                print(f"- `meshplan {' '.join(r['args'])}`: {r.get('why', '')} {r.get('states_fraction', '')}")


def main_(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=1500, help="training layouts to draw")
    ap.add_argument("--serve-n", type=int, default=600, help="serving layouts to draw")
    ap.add_argument("--search-n", type=int, default=300, help="training problems with no degree pinned (searched)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds per invocation before it counts as a hang")
    ap.add_argument("--show", type=int, default=20, help="rows of each list to print")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    res = [sweep("train", a.n, a.seed, a.timeout), sweep("serve", a.serve_n, a.seed, a.timeout),
           sweep("search", a.search_n, a.seed, a.timeout)]
    if a.json:
        print(json.dumps(res, indent=1))
        return 0
    print(f"# layout_sweep.py (python {platform.python_version()}, {platform.machine()}, {time.strftime('%Y-%m-%d')})")
    for r in res:
        report(r, a.show)
    return 0


if __name__ == "__main__":
    sys.exit(main_())
