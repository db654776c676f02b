"""Published closed-loop serving measurements from NVIDIA's aiconfigurator (issue #14, session 25): import and load.

Source: ai-dynamo/aiconfigurator (Apache-2.0) at commit 095f58a51, aic-core/src/aiconfigurator_core/systems/
silicon_sample.csv, "real e2e measurements with provenance; a 2026-04 dump of the internal benchmark DB"
(docs/design/prediction_regression_gate_design.md §2.5). Each row is one aggregated deployment (one engine doing
prefill and decode) of a model on a system with an engine release, benchmarked by a closed loop of
`silicon_concurrency` clients at fixed input/output lengths: its mean TTFT and mean TPOT in ms. The figures carry
over; no code of that project does.

    python benchmarks/aic_silicon.py --upstream path/to/silicon_sample.csv   # rewrites data/aic_silicon_subset.csv

The import keeps the rows meshplan can state exactly (chosen in session 25 before any prediction was compared,
except the three Llama 3.1 70B tables, whose predictions were looked at once before the split was computed; no
constant was chosen from them): mode agg, systems h100_sxm and h200_sxm, models with a preset (Llama 3.1 8B and 70B,
Qwen3 32B; the MoE Qwen3 235B-A22B FP8 and gpt-oss-120b, added second, and DeepSeek-V3 / R1 on the deepseek-v3
preset, added third, each before any comparison of its rows), one pipeline stage. Rules, the same for every row:
  - source key (the split's unit, benchmarks/_split.py): one measurement campaign, 'aic-silicon-2026-04:' + system /
    backend / release / model, the folder structure of the rows' own source_file provenance;
  - systems (session 33, decided before any prediction of their rows was looked at): also b200_sxm, b300_sxm and
    gb200 (presets b200, b300, gb200-nvl72), their fp8 and bf16 rows only: a Blackwell fp4 row runs FP4 tensor cores
    (NVFP4 / MXFP4 GEMMs), which meshplan does not model, so it is dropped, gpt-oss's included;
  - weights: precision fp8 -> fp8, unset -> the checkpoint's bf16, fp4 -> mxfp4 for gpt-oss (its released MXFP4
    experts; Hopper has no FP4 GEMM) and dropped elsewhere; KV dtype unstated (serving_assumptions.yaml
    missing_kv_dtype); Qwen/Qwen3-235B-A22B-FP8 on its own preset, qwen3-235b-a22b-fp8 (session 30: the release's
    128x128 block scales, which an engine's MoE kernel runs at another rate than per-tensor FP8), its campaign name,
    ids and split unchanged;
  - MoE layout: the experts over the TP group, moe_tp_size x moe_ep_size = tp_size (else dropped), ep = moe_ep_size;
    attention data parallel where attention_dp_size equals tp_size, none where it is 1 or unset (else dropped);
  - engine: the current preset of the backend (vllm, sglang, trtllm: the PyTorch backend of TensorRT-LLM 1.x), or
    the oldest listed release preset (meshplan's engine_releases) at or after the row's release where there is one
    (session 27: vLLM 0.11.2 and 0.12.0 rows -> vllm@0.14; rows of unstated release keep the current preset);
  - server path unstated: the engine's own HTTP server (infer.config.LAUNCH_SERVER_PATHS; trtllm-serve has none
    known), since a client timing TTFT over HTTP always crosses one (serving_assumptions.yaml aic_server_path);
  - concurrency: the row's batch_size, which equals the provenance's `silicon_concurrency=N` on every Hopper row kept;
    a row where the two disagree is dropped (session 33, before any prediction of it was looked at: the GB200 Qwen3
    32B campaign's batch_size is a half or a quarter of its client count, a per-worker figure whose deployment the
    row does not state); so is a row whose attention, not data parallel, is split over a TP degree that does not
    divide the model's query heads (GB200 SGLang DeepSeek-R1 at TP 72 with 128 heads: the row's layout fields are not
    the deployment's);
  - clients: a closed loop of `silicon_concurrency` clients (the closed-form's `clients`), lengths fixed, sending
    concurrency x 10 requests in all (serving_assumptions.yaml aic_requests_per_client, the project's documented
    practice; added in session 26, after the split).
"""

from __future__ import annotations

import csv
import re
import sys
from pathlib import Path

from _split import (  # sibling module: benchmarks/ is on the path of every script and test that loads this
    closed_loop_entry,
    import_main,
    read_subset_csv,
    repeat_id,
    split_of,
    write_subset_csv,
)

DATA = Path(__file__).resolve().parent / "data"
SUBSET = DATA / "aic_silicon_subset.csv"
COMMIT = "095f58a51"
URL = ("https://github.com/ai-dynamo/aiconfigurator/blob/095f58a51/aic-core/src/aiconfigurator_core/systems/"
       "silicon_sample.csv")
TITLE = ("ai-dynamo/aiconfigurator silicon_sample.csv: real end-to-end serving measurements (2026-04 dump of "
         "NVIDIA's benchmark DB), mean TTFT and TPOT of a closed loop at fixed lengths")
MODELS = {"meta-llama/Llama-3.1-70B": "llama3.1-70b", "meta-llama/Llama-3.1-8B-Instruct": "llama3.1-8b",
          "nvidia/Llama-3.1-8B-Instruct-FP8": "llama3.1-8b", "Qwen/Qwen3-32B": "qwen3-32b",
          "Qwen/Qwen3-235B-A22B-FP8": "qwen3-235b-a22b-fp8", "openai/gpt-oss-120b": "gpt-oss-120b",
          "deepseek-ai/DeepSeek-V3": "deepseek-v3", "deepseek-ai/DeepSeek-R1": "deepseek-v3"}
# the campaign's name where two checkpoints share a preset (DeepSeek-R1 is DeepSeek-V3's architecture and FP8 format)
CAMPAIGN_NAMES = {"deepseek-ai/DeepSeek-R1": "deepseek-r1",
                  # the FP8 release's own preset (its quantization_config: 128x128 block scales, session 30) keeps the
                  # campaign name, ids and split it had on the bf16 architecture preset
                  "Qwen/Qwen3-235B-A22B-FP8": "qwen3-235b-a22b"}
MOE_FAMILIES = {"qwen3-235b-a22b-fp8": ["serving_moe", "serving_moe_fine_grained"],  # 128 experts, top-8
                "gpt-oss-120b": ["serving_moe"],  # 128 experts, top-4
                "deepseek-v3": ["serving_moe", "serving_moe_fine_grained"]}  # 256 experts, top-8
SYSTEMS = {"h100_sxm": "h100-sxm", "h200_sxm": "h200", "b200_sxm": "b200", "b300_sxm": "b300", "gb200": "gb200-nvl72"}
BLACKWELL = {"b200_sxm", "b300_sxm", "gb200"}  # FP4 tensor cores: their fp4 rows are dropped (module docstring)
WEIGHTS = {"fp8": "fp8", "": "bf16"}
FIELDS = ("id", "source_key", "split", "model", "hardware", "engine", "weight_dtype", "tp", "ep", "attention_dp",
          "input_len", "output_len", "concurrency", "ttft_ms", "tpot_ms", "upstream_id", "model_path",
          "backend_version", "provenance")


def _weights(model: str, precision: str, system: str) -> str | None:
    if precision == "fp4" and system in BLACKWELL:
        return None
    if model == "gpt-oss-120b" and precision == "fp4":
        return "mxfp4"
    return WEIGHTS.get(precision)


def _heads(model: str) -> int:
    from meshplan.specs.model import load_model

    return load_model(model).n_heads


def _moe_layout(r: dict, tp: int) -> tuple[int, bool] | None:
    """(ep, attention data parallel) of an MoE row, None where the row's layout is outside the rules."""
    mtp, mep = _int(r["moe_tp_size"] or 1), _int(r["moe_ep_size"] or 1)
    adp = _int(r["attention_dp_size"] or 1)
    if mtp * mep != tp or adp not in (1, tp):
        return None
    return mep, adp == tp and tp > 1


def _release(v: str) -> tuple[int, ...]:
    """The leading numbers of a release name: '0.12.0' -> (0, 12, 0), '1.0.0rc3' -> (1, 0, 0)."""
    return tuple(int(x) for x in re.findall(r"\d+", v.split("rc")[0]))


def release_preset(engine: str, version: str) -> str:
    """The engine preset a row of `engine` at release `version` runs: the oldest listed release preset
    (meshplan.infer.config.engine_releases, e.g. vllm@0.14) whose release is at or after the row's, compared to the
    preset's precision (0.12.0 is within 0.14); else the current preset, also for rows whose release states no number."""
    from meshplan.infer.config import base_engine, engine_releases

    row = _release(version) if version else ()
    if not row:  # unstated, or a name without a number ('gpt-oss-dev')
        return engine
    fits = sorted((_release(name.split("@", 1)[1]), name) for name in engine_releases() if base_engine(name) == engine)
    for pre, name in fits:
        if row[:len(pre)] <= pre:
            return name
    return engine


def _int(v: str) -> int:
    return int(float(v))


def select(upstream: Path) -> list[dict]:
    """The rows kept (module docstring), in the upstream order, with their source key and split."""
    out, seen = [], {}
    with upstream.open() as f:
        for r in csv.DictReader(f):
            if (r["mode"] != "agg" or r["system"] not in SYSTEMS or r["model_path"] not in MODELS
                    or _int(r["pp_size"] or 1) != 1 or not r["batch_size"]):
                continue
            model, hw = MODELS[r["model_path"]], SYSTEMS[r["system"]]
            weights = _weights(model, r["precision"], r["system"])
            layout = _moe_layout(r, _int(r["tp_size"])) if model in MOE_FAMILIES else (1, False)
            stated = re.search(r"silicon_concurrency=(\d+)", r["silicon_data_source"])
            if weights is None or layout is None or (stated and int(stated.group(1)) != _int(r["batch_size"])):
                continue
            if not layout[1] and _heads(model) % _int(r["tp_size"]):
                continue  # attention split over a TP degree that does not divide its heads: not a layout an engine runs
            # the campaign's release; the Llama 3.1 70B rows (one dated dump, 2026-04-06.csv) name none
            release = r["backend_version"] or "unversioned"
            name = CAMPAIGN_NAMES.get(r["model_path"], model)
            key = f"aic-silicon-2026-04:{r['system']}/{r['backend']}/{release}/{name}"
            tp, c = _int(r["tp_size"]), _int(r["batch_size"])
            rid = (f"aic_{r['system']}_{r['backend']}_{release}_{name}_{r['precision'] or 'bf16'}_tp{tp}"
                   f"{f'_ep{layout[0]}' if layout[0] > 1 else ''}{'_adp' if layout[1] else ''}_"
                   f"{r['isl']}_{r['osl']}_c{c}").replace(".", "p").replace("-", "_")
            out.append({
                "id": repeat_id(seen, rid),
                "source_key": key, "split": split_of(key), "model": model, "hardware": hw, "engine": r["backend"],
                "weight_dtype": weights, "tp": tp, "ep": layout[0], "attention_dp": int(layout[1]),
                "input_len": _int(r["isl"]),
                "output_len": _int(r["osl"]), "concurrency": c, "ttft_ms": float(r["silicon_ttft_ms"]),
                "tpot_ms": float(r["silicon_tpot_ms"]), "upstream_id": r["id"], "model_path": r["model_path"],
                "backend_version": r["backend_version"], "provenance": r["silicon_data_source"]})
    return out


def write_subset(rows: list[dict], path: Path = SUBSET) -> None:
    write_subset_csv(path, f"# Subset of ai-dynamo/aiconfigurator@{COMMIT} aic-core/src/aiconfigurator_core/systems/"
                     "silicon_sample.csv\n"
                     "# (Apache-2.0; measured figures, NVIDIA). Rows and columns kept, renamed and mapped by "
                     "benchmarks/aic_silicon.py (its docstring states the rules); ttft_ms/tpot_ms, concurrency, tp and\n"
                     "# lengths are the upstream silicon_ttft_ms/silicon_tpot_ms, batch_size, tp_size and isl/osl "
                     "verbatim; provenance is the upstream silicon_data_source.\n", FIELDS, rows)


def load(path: Path = SUBSET) -> list[dict]:
    """The subset as serving_measurements_new.yaml entries (serving_accuracy.predict reads them unchanged)."""
    from serving_accuracy import _assumptions  # the one reader of serving_assumptions.yaml (sibling module)

    from meshplan.infer.config import LAUNCH_SERVER_PATHS

    rounds = int(_assumptions()["aic_requests_per_client"]["value"])
    entries = []
    for r in read_subset_csv(path):
        c = int(r["concurrency"])
        entries.append(closed_loop_entry(
            r, families=["serving_ttft_itl_under_load", "serving_aic_silicon", *MOE_FAMILIES.get(r["model"], [])],
            source={"key": r["source_key"], "title": TITLE, "url": URL,
                    "where": f"row {r['upstream_id']} ({r['model_path']}, {r['engine']} "
                             f"{r['backend_version'] or 'release unstated'}): closed loop, concurrency {c}",
                    "date": "2026-04 (DB dump)"},
            engine=release_preset(r["engine"], r["backend_version"]),
            measured={"output_tokens_per_s": None, "tpot_s": float(r["tpot_ms"]) / 1e3,
                      "ttft_s": float(r["ttft_ms"]) / 1e3},
            notes=f"aiconfigurator silicon sample; provenance: {r['provenance']}",
            benchmark_requests=c * rounds, ep=int(r["ep"]), attention_dp=bool(int(r["attention_dp"])),
            frontend=LAUNCH_SERVER_PATHS.get(r["engine"])))
    return entries


def main(argv: list[str] | None = None) -> int:
    return import_main(argv, __doc__, "aiconfigurator's silicon_sample.csv", select, write_subset, SUBSET)


if __name__ == "__main__":
    sys.exit(main())
