"""Fuzz every meshplan command as a hostile user would, in-process, and count tracebacks and hangs (issue #18).

    PYTHONPATH=src python benchmarks/fuzz.py [--n 5000] [--seed 0] [--timeout 20] [--json]

Each invocation starts from a valid command line and mutates it: a flag's value replaced by an odd one (0, -1, nan,
inf, 1e400, 2**63, 1.5, a 300-character name, unicode, ...), a required flag dropped, an unknown flag added, or a
file argument replaced by a generated hardware YAML / model config.json / profile JSON (a preset with one field
set to an odd value or removed, or random bytes). The contract checked: exit 0, or exit 2 with exactly one stderr
line starting `error:`; no exception escapes `main()`; nothing runs past `--timeout` seconds (each invocation runs in a forked child that is
killed at the timeout, so a hang inside C code is caught too).
`verify`, `calibrate` and `measure` compile or run JAX programs when their input is valid; for them only mutations
that are invalid by construction are drawn, so a long valid run is not mistaken for a hang.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import random
import select
import signal
import sys
import tempfile
import time
import traceback
from collections import Counter
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "src") not in sys.path:
    sys.path.insert(0, str(ROOT / "src"))

from meshplan.cli.app import main  # noqa: E402
from meshplan.specs.hardware import HARDWARE_DIR  # noqa: E402
from meshplan.specs.model import MODELS_DIR  # noqa: E402

MODELS = ["llama3-8b", "llama3.2-1b", "mixtral-8x7b", "llama3-70b", "gpt3-175b", "deepseek-v3"]
CHIPS = ["h100-sxm", "tpu-v5e", "a100-80gb", "tpu-v5p", "b200"]
ODD_INTS = ["0", "-1", "-5", "2147483648", "9223372036854775808", "1" + "0" * 30, "1.5", "nan", "inf", "", "abc",
            "1e3", "0x10", "١٢"]
ODD_FLOATS = ["0", "-1", "nan", "inf", "-inf", "1e-300", "1e400", "1e308", "", "abc", "1,5", "5e-324"]
ODD_TEXT = ["", " ", "a" * 300, "../../etc/passwd", "/proc/x/y", "\u00e9\u00e9", "nul\x01", "x.yaml", "x.json",
            "/dev/null", "-", "llama3-7b", "x\ny", "x\x1ey", "\u2028", "\x1b[31m"]


# --- valid templates: (command args, {flag: kind}) ----------------------------------------------------------

def templates(rng: random.Random) -> list[tuple[list[str], dict[str, str]]]:
    m, h = rng.choice(MODELS[:4]), rng.choice(CHIPS)
    n = str(rng.choice([1, 2, 4, 8, 12, 16, 24, 64, 256]))
    train = ["train", "-m", m, "--hardware", h, "--chips", n, "--seq-len", rng.choice(["2048", "4096"]),
             "--global-batch", rng.choice(["8", "64", "256"])]
    serve = ["serve", "-m", m, "--hardware", h, "--chips", n, "--input-len", "1024", "--output-len", "128"]
    return [
        (["model", m, "--json"], {"model": "name", "--seq-len": "int"}),
        (["hardware", h, "--json"], {"hardware": "hwname"}),
        (["hardware"], {}),
        (["roofline", "-h", h, "--op", "matmul:4096,8192,8192", "--json"], {"-h": "hwname", "--op": "op"}),
        (["roofline", "-h", h, "-m", m, "--tokens-per-chip", "4096"],
         {"-h": "hwname", "-m": "name", "--tokens-per-chip": "int", "--seq-len": "int", "--dtype": "text"}),
        (["collective", rng.choice(["allgather", "allreduce", "alltoall", "reducescatter", "permute"]),
          "--hardware", h, "--chips", "64", "--mesh", "a=8,b=8", "--axes", "a", "--bytes", "1GiB", "--json"],
         {"--hardware": "hwname", "--chips": "int", "--mesh": "mesh", "--axes": "text", "--bytes": "float",
          "--slice": "text"}),
        (["matmul", "-h", h, "-n", "8", "--mesh", "data=8", "--lhs", "B:data,D", "--rhs", "D,F",
          "--sizes", "B=8192,D=8192,F=28672", "--json"],
         {"-h": "hwname", "-n": "int", "--mesh": "mesh", "--sizes": "sizes", "--lhs": "text", "--rhs": "text"}),
        (train + ["--json"],
         {"-m": "name", "--hardware": "hwname", "--chips": "int", "--seq-len": "int", "--global-batch": "int",
          "--tokens": "float", "--dp": "int", "--tp": "int", "--pp": "int", "--fsdp": "int", "--zero": "int",
          "--offload": "float", "--offload-optimizer": "int", "--offload-params": "int", "--headroom": "float", "--microbatch": "int", "--recompute": "text", "--top": "int",
          "--profile": "profile", "--slice": "text", "--vpp": "int", "--cp": "int", "--ep": "int", **NEW_TRAIN}),
        (serve + ["--json"],
         {"-m": "name", "--hardware": "hwname", "--chips": "int", "--input-len": "int", "--output-len": "int",
          "--batch": "int", "--tp": "int", "--pp": "int", "--ep": "int", "--quant": "text",
          "--tpot-target": "float", "--ttft-target": "float", "--batching": "text", "--profile": "profile",
          "--engine": "choice:default,vllm,sglang,trtllm,lmdeploy", "--max-num-batched-tokens": "int",
          "--concurrency": "int", "--dense-kv-cache": "int"}),
        (["train", "-m", rng.choice(["mixtral-8x7b", "qwen3-30b-a3b", "llama3.2-1b"]), "--hardware", h, "--chips",
          rng.choice(["1", "8", "64"]), "--seq-len", "4096", "--global-batch", "256", "--top", "1", "--json"],
         {**NEW_TRAIN, "--ep": "int", "--pp": "int", "--vpp": "int", "--chips": "int"}),
        (train + ["--export", rng.choice(["torchtitan", "megatron", "nemo", "maxtext", "deepspeed"]), "--out",
                  "OUTDIR"], {"--export": "text", "--out": "outdir", "--chips": "int", "--tp": "int"}),
        (["train", "--from", "FRAMEWORK", "--hardware", h, "--json"],
         {"--from": "framework", "--hardware": "hwname", "--chips": "int", "--seq-len": "int"}),
        (serve + ["--export", rng.choice(["vllm", "sglang", "trtllm"]), "--out", "OUTDIR"],
         {"--export": "text", "--out": "outdir", "--tp": "int"}),
        (["serve", "--from", "FRAMEWORK", "--hardware", h, "--input-len", "1024", "--output-len", "128", "--json"],
         {"--from": "framework", "--hardware": "hwname", "--input-len": "int", "--output-len": "int"}),
        # session 22: trtllm-bench's own limits and the sequence cap
        (serve + ["--engine", rng.choice(["trtllm", "trtllm@0.17"]), "--harness", "trtllm-bench", "--json"],
         {"--harness": "choice:trtllm-bench,vllm-bench", "--engine": "choice:trtllm,trtllm@0.17,vllm",
          "--max-num-seqs": "int", "--batch": "int", "--input-len": "int", "--output-len": "int", "--pp": "int"}),
        (serve + ["--max-num-seqs", "64", "--json"],
         {"--max-num-seqs": "int", "--batch": "int", "--concurrency": "int", "--rate": "float"}),
        (serve + ["--simulate", "--rate", "5", "--requests", "50", "--json"],
         {"--rate": "float", "--requests": "int", "--seed": "int", "--input-dist": "text", "--chips": "int",
          "--concurrency": "int", "--engine": "choice:default,vllm,sglang,trtllm,lmdeploy",
          "--max-num-batched-tokens": "int", "--length-trace": "trace", "--dense-kv-cache": "int"}),
        # session 26: a closed-loop benchmark's request count, whose first round the closed form counts
        (serve + ["--concurrency", "32", "--requests", "320", "--json"],
         {"--concurrency": "int", "--requests": "int", "--chips": "int", "--input-len": "int", "--pp": "int",
          "--engine": "choice:default,vllm,sglang,trtllm,lmdeploy", "--max-num-batched-tokens": "int",
          "--batching": "text"}),
    ]


# flags added in session 7 (train): word choices, switches (no value) and the node limit
NEW_TRAIN = {
    "--moe-dispatcher": "choice:alltoall,deepep,hybridep", "--cuda-graph": "choice:none,attn,attn_mlp,full_iteration",
    "--weight-dtype": "choice:bf16,fp32", "--fp8-recipe": "choice:tensorwise,rowwise,blockwise,delayed",
    "--framework": "choice:megatron,nemo,nemo@24.07,torchtitan@2025.06,maxtext,nemo@1", "--dtype": "choice:bf16,fp8",
    "--pp-schedule": "choice:1f1b,zb1p,dualpipe,gpipe", "--attention-kernel": "choice:fused,fa2,sdpa,cudnn-9.10",
    "--cp-impl": "choice:ring,torch,allgather", "--zero3-fetch": "choice:allgather,broadcast",
    "--moe-node-limit": "int", "--pp-overlap": "switch", "--pp-head-in-split": "switch",
    "--moe-force-balance": "switch", "--ep-overlap": "switch", "--no-fused": "switch",
    "--fp8-scope": "choice:all,experts,dense",  # session 41 (dense: not a scope, an error line)
}

# verify/calibrate/measure: invalid-only mutations (a valid call compiles or runs JAX for minutes)
SLOW = [
    (["verify", "-m", "llama3-8b", "--devices", "8", "--tp", "2"], ["--devices", "--tp", "--seq-len", "--global-batch",
                                                                    "--microbatch", "--zero", "--layers",
                                                                    "--attention", "--framework", "--rank"]),
    (["verify", "--plan", "PLANFILE", "--no-loss-check"], ["--rank", "--plan", "--devices", "--tp", "-m"]),
    (["measure", "-m", "llama3.2-1b", "--steps", "1"], ["--seq-len", "--steps", "--layers", "--global-batch"]),
    (["calibrate", "--quick"], ["--bench", "--show", "--time-limit"]),
]
SLOW_BAD = ["0", "-1", "nan", "9223372036854775808", "1" + "0" * 30, "abc", ""]
SLOW_BAD_BENCH = ["nan", "abc", "matmul,nope", ","]
SLOW_BAD_LIMIT = ["0", "-1", "nan", "inf", "-inf", "abc", ""]  # a huge limit is valid: calibrate would run


class Files:
    """Generated input files: mutated presets and random bytes."""

    def __init__(self, root: Path, rng: random.Random):
        self.root, self.rng, self.count = root, rng, 0

    def _path(self, suffix: str) -> Path:
        self.count += 1
        return self.root / f"f{self.count}{suffix}"

    def hardware(self) -> str:
        data = yaml.safe_load((HARDWARE_DIR / f"{self.rng.choice(CHIPS)}.yaml").read_text())
        p = self._path(".yaml")
        if self.rng.random() < 0.1:
            p.write_bytes(self.rng.randbytes(self.rng.randint(0, 200)))
            return str(p)
        node, keys = data, []
        while isinstance(node, dict) and node and "value" not in node:
            k = self.rng.choice(list(node))
            keys.append(k)
            if not isinstance(node[k], dict) or "value" in node[k] or self.rng.random() < 0.3:
                break
            node = node[k]
        if self.rng.random() < 0.2:
            node.pop(keys[-1], None)
        else:
            node[keys[-1]] = {"value": self.rng.choice([0, -1, 1e-300, 1e300, float("nan"), float("inf"), "x", None,
                                                         True, [], 2**70, 0.5, 3])}
        p.write_text(yaml.safe_dump(data))
        return str(p)

    def model(self) -> str:
        cfg = json.loads((MODELS_DIR / f"{self.rng.choice(MODELS)}.json").read_text())
        p = self._path(".json")
        if self.rng.random() < 0.1:
            p.write_bytes(self.rng.randbytes(self.rng.randint(0, 200)))
            return str(p)
        for _ in range(self.rng.randint(1, 3)):
            key = self.rng.choice(list(cfg) + ["vocab_size", "hidden_size", "num_attention_heads"])
            cfg[key] = self.rng.choice([0, -3, 1, 2**40, 2**62, 10**30, 1.5, "x", None, [], {}, True, 7])
        p.write_text(json.dumps(cfg, default=str))
        return str(p)

    def outdir(self) -> str:
        return str(self._path("_out"))

    def framework(self) -> str:
        """A framework config for `--from`: an export of a real plan with one line garbled, or random bytes."""
        p = self._path(self.rng.choice([".toml", ".yaml", ".json", ".sh", ".py"]))
        if self.rng.random() < 0.3:
            p.write_bytes(self.rng.randbytes(self.rng.randint(0, 300)))
            return str(p)
        kind, fw = self.rng.choice([("train", "torchtitan"), ("train", "maxtext"), ("train", "megatron"),
                                    ("train", "deepspeed"), ("serve", "vllm"), ("serve", "sglang")])
        base = (["train", "-m", "llama3-8b", "--hardware", "h100-sxm", "--chips", "8", "--seq-len", "2048",
                 "--global-batch", "8"] if kind == "train" else
                ["serve", "-m", "llama3-8b", "--hardware", "h100-sxm", "--chips", "8", "--input-len", "512",
                 "--output-len", "128"])
        out = self._path("_export")
        _run_here(base + ["--export", fw, "--out", str(out)])
        files = sorted(out.glob("*")) if out.is_dir() else []
        if not files:
            p.write_text("")
            return str(p)
        lines = files[0].read_text().splitlines() or [""]
        i = self.rng.randrange(len(lines))
        lines[i] = self.rng.choice(["", "x = = 1", lines[i] + " nan", lines[i].replace("8", "-1"), "[[[", "\x00",
                                    lines[i].replace("2048", "1e400"), lines[i] * 3])
        target = files[0].with_name("garbled" + files[0].suffix)
        target.write_text("\n".join(lines))
        return str(target)

    def plan(self, broken: bool) -> str:
        """A `meshplan train --json` of a small problem (made once), or a file that cannot be one (verify --plan):
        truncated, binary, or a field of the wrong type or out of bounds."""
        if not hasattr(self, "_plan"):
            out = io.StringIO()
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()), \
                    contextlib.suppress(SystemExit):
                main(["train", "-m", "llama3.2-1b", "--hardware", "h100-sxm", "--chips", "8", "--seq-len", "2048",
                      "--global-batch", "16", "--top", "2", "--json"])
            self._plan = out.getvalue()
        p = self._path(".json")
        if not broken:
            p.write_text(self._plan)
            return str(p)
        data = json.loads(self._plan)
        edit = self.rng.randrange(8)
        if edit == 0:
            p.write_text(self._plan[:self.rng.randrange(len(self._plan))])
        elif edit == 1:
            p.write_bytes(self.rng.randbytes(self.rng.randint(1, 200)) + b"\xff")
        elif edit == 2:
            p.write_text("[" * 100_000)
        else:
            where, key, value = self.rng.choice([
                ("problem", "chips", self.rng.choice(["eight", True, 1e30, -8, 4096, 2.5, [8]])),
                ("problem", "model", self.rng.choice([5, "", None, ["x"], "llama3-7b"])),
                ("top", "plans", self.rng.choice([[], [1], {}, None, [{"config": 3}]])),
                ("top", "problem", self.rng.choice([None, [], "x"])),
                ("config", "dp", self.rng.choice([-8, 0, 7, "x", 2**70, 8.5, None]))])
            node = data if where == "top" else data["problem"] if where == "problem" else data["plans"][0]["config"]
            node[key] = value
            text = json.dumps(data)
            p.write_text(text.replace("4096", "NaN") if value == 4096 else text)
        return str(p)

    def trace(self) -> str:
        """A request-length trace for `serve --simulate --length-trace`: JSON or CSV, valid, out of bounds or bytes."""
        p = self._path(self.rng.choice([".json", ".csv", ".txt"]))
        r = self.rng.random()
        lens = [self.rng.choice([1, 7, 200, 0, -3, 2**40, 1.5, "x", None]) for _ in range(self.rng.randint(0, 6))]
        if r < 0.2:
            p.write_bytes(self.rng.randbytes(self.rng.randint(0, 200)))
        elif p.suffix == ".json":
            p.write_text(json.dumps(self.rng.choice([
                {"input_lens": lens, "output_lens": lens}, {"input_lens": lens, "output_lens": lens[:-1]},
                {"input_lens": "x"}, [], lens, {"input_lens": [100] * 3, "output_lens": [10**7] * 3}])))
        else:
            p.write_text("\n".join(self.rng.choice(["input,output", f"{a},{b}", f"{a}", f"{a},{b},{a}", ""])
                                   for a, b in zip(lens, reversed(lens), strict=True)))
        return str(p)

    def profile(self) -> str:
        p = self._path(".json")
        p.write_text(json.dumps(self.rng.choice([{}, [], {"chip": "h100-sxm"}, {"efficiency": {"matmul": -1}},
                                                 {"cpu_only": True, "chip": "h100-sxm"}, "x"])))
        return str(p)


def value_for(kind: str, rng: random.Random, files: Files) -> str:
    odd = rng.random() < 0.7
    if kind == "int":
        return rng.choice(ODD_INTS) if odd else str(rng.choice([1, 2, 3, 4, 8, 16, 64, 1024, 4096]))
    if kind == "float":
        return rng.choice(ODD_FLOATS) if odd else rng.choice(["0.5", "1", "15e12", "0.01", "100"])
    if kind == "name":
        return rng.choice(ODD_TEXT + [files.model()] * 3) if odd else rng.choice(MODELS)
    if kind == "hwname":
        return rng.choice(ODD_TEXT + [files.hardware()] * 3) if odd else rng.choice(CHIPS)
    if kind == "profile":
        return rng.choice([files.profile(), "/nonexistent.json", ""])
    if kind == "trace":
        return rng.choice([files.trace()] * 4 + ["/nonexistent.csv", "", "/dev/null"])
    if kind == "outdir":
        return rng.choice([files.outdir()] * 3 + ["/proc/x/y", "/dev/null", ""])
    if kind == "framework":
        return rng.choice([files.framework()] * 4 + ["/nonexistent.toml", ""])
    if kind == "op":
        k = rng.choice(["matmul:{},{},{}", "attention:{},{},{},{},{},{}", "elementwise:{}", "dot:{}", "conv:{}"])
        vals = [rng.choice(["1", "4096", "0", "-1", "nan", "inf", "1.5", "1e30", "x"]) for _ in range(6)]
        return k.format(*vals) + rng.choice(["", "@fp8", "@int4", "@xx"])
    if kind == "mesh":
        return rng.choice(["a=8,b=8", "a=0", "a=-1", "a=1e9", "a=nan", "=", "a=8,a=8", "", "a=99999999999999999999"])
    if kind == "sizes":
        return rng.choice(["B=1,D=1,F=1", "B=inf,D=1,F=1", "B=0", "B=nan,D=1,F=1", "B=1e400,D=1,F=1", "X", ""])
    if kind.startswith("choice:"):
        words = kind.removeprefix("choice:").replace("_mlp", ",mlp").split(",")
        if odd:
            w = rng.choice(words)
            return rng.choice(ODD_TEXT + [w.upper(), w + ",", "," + w, w + "," + w, "none," + w, w + "@", "@" + w])
        return rng.choice(words)
    return rng.choice(ODD_TEXT + ["none", "full", "fp8", "bf16", "static", "uniform", "16x16", "8", "0x0", "3x3x3x3"])


def mutate(args: list[str], kinds: dict[str, str], rng: random.Random, files: Files) -> list[str]:
    args = list(args)
    for _ in range(rng.choice([1, 1, 1, 2, 3])):
        op = rng.random()
        flags = list(kinds)
        if op < 0.75 and flags:
            f = rng.choice(flags)
            v = value_for(kinds[f], rng, files)
            if kinds[f] == "switch":  # a flag without a value
                args.append(f)
                continue
            if f in ("model", "hardware"):  # positional
                if len(args) > 1:
                    args[1] = v
                else:
                    args.append(v)
            elif f in args and args.index(f) + 1 < len(args):
                args[args.index(f) + 1] = v
            else:
                args += [f, v]
        elif op < 0.88:
            opts = [i for i, a in enumerate(args) if a.startswith("-") and i + 1 < len(args)
                    and not args[i + 1].startswith("--")]
            if opts:
                i = rng.choice(opts)
                del args[i:i + 2]
        else:
            args.append(rng.choice(["--bogus", "--json", "--help", "-x", "--chips"]))
    return args


def invocations(n: int, seed: int, root: Path) -> list[list[str]]:
    rng = random.Random(seed)
    files = Files(root, rng)
    out: list[list[str]] = []
    while len(out) < n:
        if rng.random() < 0.06:
            base, flags = rng.choice(SLOW)
            args = [files.plan(broken=False) if a == "PLANFILE" else a for a in base]
            f = rng.choice(flags)
            valid_zero = f in ("--zero", "--microbatch")  # 0 is a valid value of these two
            bad = rng.choice(SLOW_BAD_BENCH if f == "--bench" else SLOW_BAD_LIMIT if f == "--time-limit"
                             else SLOW_BAD[1:] if valid_zero else SLOW_BAD)
            if f == "--plan" or (f in ("--devices", "--tp", "-m") and "--plan" in base):
                # a broken plan file, or a layout flag beside --plan (refused: the plan brings its own)
                bad = files.plan(broken=True) if f == "--plan" else rng.choice(["2", "llama3-8b", "16"])
            if f in args:
                args[args.index(f) + 1] = bad
            else:
                args += [f, bad]
            out.append(args)
            continue
        base, kinds = rng.choice(templates(rng))
        base = [files.outdir() if a == "OUTDIR" else files.framework() if a == "FRAMEWORK" else a for a in base]
        out.append(mutate(base, kinds, rng, files) if rng.random() < 0.9 else base)
    return out


def _run_here(args: list[str]) -> tuple[str, str]:
    """Run `main(args)` in this process: ('ok'|'error'|'bad_error'|'traceback'|'exit<N>', detail)."""
    out, err = io.StringIO(), io.StringIO()
    code: Any = 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                main(args)
            except SystemExit as exc:
                code = exc.code
    except BaseException as exc:  # noqa: BLE001 - the point is to catch whatever escapes
        tb = traceback.extract_tb(exc.__traceback__)
        where = f"{Path(tb[-1].filename).name}:{tb[-1].lineno}" if tb else "?"
        return "traceback", f"{type(exc).__name__} at {where}: {' '.join(args)[:160]}"
    code = 0 if code is None else code
    e = err.getvalue()
    if code == 0:
        # `--help` prints usage on stdout; success leaves stderr empty apart from progress lines
        return ("ok", "") if "Traceback" not in e else ("traceback", " ".join(args)[:160])
    if code == 2:
        lines = e.strip().splitlines()
        if len(lines) == 1 and lines[0].startswith("error:"):
            return "error", ""
        return "bad_error", f"{e.strip()[:200]!r}: {' '.join(args)[:120]}"
    return f"exit{code}", " ".join(args)[:160]


def run_one(args: list[str], timeout_s: float) -> tuple[str, str]:
    """One invocation in a forked child (cheap: the modules are already imported), so that a hang anywhere, in C
    code included, is caught and killed at `timeout_s`, and a crash (a signal, the OOM killer) is counted too."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        os.close(r)
        try:
            res = _run_here(args)
        except BaseException as exc:  # noqa: BLE001
            res = ("traceback", f"{type(exc).__name__} in the harness: {' '.join(args)[:120]}")
        os.write(w, json.dumps(res).encode()[:60000])
        os._exit(0)
    os.close(w)
    try:
        ready, _, _ = select.select([r], [], [], timeout_s)
        if not ready:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return "hang", " ".join(args)[:200]
        data = b""
        while chunk := os.read(r, 65536):
            data += chunk
        _, status = os.waitpid(pid, 0)
    finally:
        os.close(r)
    if not data:
        return "crash", f"status {status}: {' '.join(args)[:160]}"
    kind, detail = json.loads(data)
    return kind, detail


WARM_UP = [["hardware", "--json"], *(["model", m, "--json"] for m in MODELS),
           ["train", "-m", "llama3-8b", "--hardware", "h100-sxm", "--chips", "8", "--seq-len", "2048",
            "--global-batch", "8", "--json"],
           ["serve", "-m", "llama3-8b", "--hardware", "tpu-v5e", "--chips", "8", "--input-len", "1024",
            "--output-len", "128", "--json"]]


def fuzz(n: int = 5000, seed: int = 0, timeout_s: float = 20.0, progress: bool = False) -> dict[str, Any]:
    counts: Counter[str] = Counter()
    details: dict[str, Counter[str]] = {}
    per_command: Counter[str] = Counter()
    examples: dict[str, str] = {}  # one invocation per traceback cause
    t0 = time.perf_counter()
    for args in WARM_UP:  # imports and spec caches warmed once in the parent; every forked child inherits them
        _run_here(args)
    with tempfile.TemporaryDirectory() as tmp:
        calls = invocations(n, seed, Path(tmp))
        for i, args in enumerate(calls):
            kind, detail = run_one(args, timeout_s)
            counts[kind] += 1
            per_command[args[0]] += 1
            if kind not in ("ok", "error"):
                key = detail.split(": ")[0] if kind == "traceback" else detail
                details.setdefault(kind, Counter())[key] += 1
                examples.setdefault(key, " ".join(args)[:300])
            if progress and (i + 1) % 250 == 0:
                print(f"  {i + 1}/{n}: {dict(counts)}", file=sys.__stderr__, flush=True)
    return {"invocations": n, "seed": seed, "timeout_s": timeout_s, "wall_s": round(time.perf_counter() - t0, 1),
            "counts": dict(counts), "per_command": dict(per_command),
            "problems": {k: dict(v.most_common(20)) for k, v in details.items()}, "examples": examples}


def cli() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=5000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=20.0)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    res = fuzz(a.n, a.seed, a.timeout, progress=not a.json)
    if a.json:
        print(json.dumps(res, indent=2))
        return
    c = res["counts"]
    print(f"{res['invocations']} invocations in {res['wall_s']} s (seed {res['seed']}, timeout {res['timeout_s']} s)")
    print(f"  exit 0: {c.get('ok', 0)}   exit 2 with one error line: {c.get('error', 0)}")
    print(f"  tracebacks: {c.get('traceback', 0)}   hangs: {c.get('hang', 0)}   crashes: {c.get('crash', 0)}   "
          f"malformed errors: {c.get('bad_error', 0)}   other exits: "
          f"{sum(v for k, v in c.items() if k.startswith('exit'))}")
    print(f"  per command: {res['per_command']}")
    for kind, d in res["problems"].items():
        print(f"  {kind}:")
        for k, v in d.items():
            print(f"    {v:4d}  {k}" + (f"\n          e.g. {res['examples'][k]}" if kind == "traceback" else ""))


if __name__ == "__main__":
    cli()
