"""The one validation layer for what enters meshplan: CLI flags, hardware YAML fields, model config sizes.

Every bound is a pydantic constraint (`Field(ge=..., le=...)`, `allow_inf_nan=False`) with the reason it exists, so
the CLI, the spec loaders and (later) an API share one table and one message format:
`--chips must be an integer in [1, 1048576] (more accelerators than any system has), got 2147483648`.
Bounds are generous: each is at least ~10x beyond the largest real system or model published to date, and exists so
that no enumeration, float product or sleep can blow up (2**53 keeps integers exact as floats).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import Annotated, Any

from pydantic import Field, TypeAdapter, ValidationError

from meshplan.errors import MeshplanError

# The largest GPU clusters announced (2024-25) hold ~1e5-2e5 accelerators; a TPU v5p pod is 8,960 chips.
MAX_CHIPS = 1 << 20
# Longest context windows shipped are ~1e7 tokens (Llama 4 Scout, 2025).
MAX_SEQ_TOKENS = 1 << 24
# Global batches in published runs are at most ~1e4-1e5 sequences (e.g. 16M tokens / 4096 = 4,096 sequences).
MAX_BATCH = 1 << 24
# Published pre-training runs use ~1e13-4e13 tokens (Llama 3: 15.6e12; Qwen3: 36e12).
MAX_TRAIN_TOKENS = 1e16
# The largest published dense/MoE models hold ~2e12 parameters.
MAX_PARAMS = 1e15
# NAME_MAX on Linux, macOS and Windows file systems: a longer name cannot be a file.
MAX_NAME_CHARS = 255
# A simulation replays every request (about 0.1-0.2 ms each on one core): 1e5 keeps it within seconds.
MAX_SIM_REQUESTS = 100_000
# ... and steps every generated token (about 2 us each on one core): 1e7 tokens is about 20 s.
MAX_SIM_TOKENS = 10_000_000


@dataclass(frozen=True)
class Rule:
    """A bounded number: integer or finite float, within [lo, hi] (lo excluded when `open_lo`)."""

    lo: float
    hi: float
    why: str = ""
    integer: bool = True
    open_lo: bool = False
    allow_inf: bool = False  # +inf is meaningful (an arrival rate of inf: every request at once); nan never is

    @cached_property
    def adapter(self) -> TypeAdapter:
        kind = int if self.integer else float
        lo = {"gt": self.lo} if self.open_lo else {"ge": self.lo}
        return TypeAdapter(Annotated[kind, Field(le=self.hi, allow_inf_nan=False, **lo)])

    def describe(self) -> str:
        lo = f"({_fmt(self.lo)}" if self.open_lo else f"[{_fmt(self.lo)}"
        what = "an integer" if self.integer else "a number" if self.allow_inf else "a finite number"
        hi = "inf]" if self.allow_inf else f"{_fmt(self.hi)}]"
        return f"{what} in {lo}, {hi}" + (f" ({self.why})" if self.why else "")

    def check(self, value: Any, label: str) -> Any:
        """`value` if it obeys the rule, else a one-line MeshplanError naming `label` and the bound."""
        if isinstance(value, bool):
            raise MeshplanError(f"{label} must be {self.describe()}, got {value!r}")
        if self.allow_inf and value == math.inf:
            return value
        try:
            return self.adapter.validate_python(value)
        except ValidationError:
            raise MeshplanError(f"{label} must be {self.describe()}, got {_show(value)}") from None


def _fmt(x: float) -> str:
    """Exact integers as integers (2**53 = 9007199254740992), other bounds in %g (1e+16, 0.99)."""
    return str(int(x)) if isinstance(x, int) or (float(x).is_integer() and abs(x) < 1e9) else f"{x:g}"


def _show(value: Any) -> str:
    s = repr(value)
    return s if len(s) <= 40 else s[:37] + "..."


def _pos(hi: float, why: str) -> Rule:
    return Rule(1, hi, why)


_CHIPS = _pos(MAX_CHIPS, "more accelerators than any system has")
_DEGREE = _pos(MAX_CHIPS, "a parallel degree above the largest chip count")
_SEQ = _pos(MAX_SEQ_TOKENS, "longer than any model's context")
_BATCH = _pos(MAX_BATCH, "larger than any published batch")

# CLI flags by parameter name: the same name means the same quantity in every command.
CLI_RULES: dict[str, Rule] = {
    "chips": _CHIPS,
    # `verify --devices`: simulated CPU devices of this host (XLA_FLAGS); XLA aborts the process on a count it
    # cannot parse, and thousands of host devices outgrow a host's memory and compile time
    "devices": Rule(1, 1024, "simulated CPU devices on one host"),
    **{k: _DEGREE for k in ("dp", "fsdp", "tp", "pp", "vpp", "cp", "ep", "moe_node_limit")},
    "microbatch": _BATCH, "global_batch": _BATCH, "batch": _BATCH,
    "seq_len": _SEQ, "input_len": _SEQ, "output_len": _SEQ,
    "tokens_per_chip": Rule(1, MAX_SEQ_TOKENS * 64, "more tokens than any chip holds"),
    "zero": Rule(0, 3, "ZeRO stages are 0-3"),
    "offload": Rule(0, 1, "a fraction", integer=False),
    "offload_optimizer": Rule(0, 1, "1 keeps it on the host"),
    "offload_params": Rule(0, 1, "1 keeps it on the host"),
    "headroom": Rule(0, 0.99, "a fraction of HBM", integer=False),
    "rate": Rule(0, 1e6, "requests per second; inf sends them all at once", integer=False, open_lo=True,
                 allow_inf=True),
    "requests": Rule(1, MAX_SIM_REQUESTS, "a benchmark or simulation of at most this many requests"),
    "seed": Rule(0, 2**32 - 1, "numpy seeds are 32-bit"),
    "tpot_target": Rule(0, 3600, "seconds", integer=False, open_lo=True),
    "ttft_target": Rule(0, 86400, "seconds", integer=False, open_lo=True),
    "top": Rule(1, 10_000, "plans to show"),
    "rank": Rule(1, 10_000, "a plan's place among at most --top plans"),
    "concurrency": Rule(1, MAX_SIM_REQUESTS, "closed-loop clients, at most the requests a simulation holds"),
    "max_num_batched_tokens": Rule(1, MAX_SEQ_TOKENS, "tokens in one engine step"),
    "steps": Rule(1, 100_000, "timed steps"),
    "layers": Rule(1, 100_000, "layers"),
    "price": Rule(0, 1e4, "dollars per chip-hour", integer=False, open_lo=True),
}
# Any other number from the command line: an integer within exact float range, a float that is finite.
_ANY_INT = Rule(-(2**53), 2**53, "beyond exact float range")
_ANY_FLOAT = Rule(-1e300, 1e300, "", integer=False)
_TEXT_PARAMS_BOUNDED = ("model", "hardware", "name", "model_name", "hardware_name", "profile")

# Quantities inside op and size specs (`--op matmul:B,D,F`, `--sizes B=...`).
DIM = Rule(1, 2**53, "an array dimension")
TRAIN_TOKENS = Rule(0, MAX_TRAIN_TOKENS, "more tokens than any training run", integer=False, open_lo=True)
NBYTES = Rule(0, 2.0**60, "bytes (an exabyte)", integer=False, open_lo=True)

# A calibrated profile's efficiency fields (cost/efficiency.py profile_efficiency). A fraction of the datasheet peak
# above 1 contradicts the chip's spec; 1.05 leaves room for boost clocks above the nominal one. The rest: physical
# bounds wide enough for any chip, narrow enough that a hand-edited profile cannot give a negative time.
PROFILE_FRACTION = Rule(0.0, 1.05, "a fraction of the chip's datasheet peak", integer=False, open_lo=True)
PROFILE_RULES: dict[str, Rule] = {name: Rule(lo, hi, why, integer=False) for name, (lo, hi, why) in {
    "matmul_half_dim": (0.0, 1e6, "a GEMM dimension"),
    "matmul_rows_half": (0.0, 1e6, "GEMM rows"),
    "kernel_overhead_s": (0.0, 1.0, "seconds per kernel"),
    "step_overhead_s": (0.0, 3600.0, "seconds per step"),
    "memory_reserved_bytes": (0.0, 1e13, "bytes"),
    "attention_bwd_flops_ratio": (1.0, 10.0, "backward over forward FLOPs"),
    "unfused_elementwise_factor": (1.0, 100.0, "HBM passes per fused pass"),
    "comm_compute_interference": (0.0, 10.0, "a fractional slow-down"),
    "attention_tile_fwd": (0.0, 1000.0, "attention tile visits per query tile"),
    "attention_tile_bwd": (0.0, 1000.0, "attention tile visits per query tile"),
    "attention_cudnn910_tile_fwd": (0.0, 1000.0, "attention tile visits per query tile"),
    "attention_cudnn910_tile_bwd": (0.0, 1000.0, "attention tile visits per query tile"),
}.items()}

# Hardware YAML fields (dotted names as in the file). Ranges hold every accelerator built so far with ~100x margin.
HARDWARE_RULES: dict[str, Rule] = {
    "peak_flops_per_s": Rule(1e9, 1e18, "FLOP/s: GFLOP/s to EFLOP/s per chip", integer=False),
    "hbm_bytes": Rule(1e6, 1e14, "bytes of HBM per chip", integer=False),
    "hbm_usable_bytes": Rule(1e6, 1e14, "bytes of usable HBM per chip", integer=False),
    "hbm_bandwidth_bytes_per_s": Rule(1e8, 1e15, "bytes/s of HBM bandwidth", integer=False),
    "host_bandwidth_bytes_per_s": Rule(1e6, 1e14, "bytes/s over the host link", integer=False),
    "host_memory_bytes": Rule(1e6, 1e15, "bytes of host memory per chip", integer=False),
    "links.scale_out_bandwidth_bytes_per_s": Rule(1e6, 1e14, "bytes/s per chip", integer=False),
    "links.nvlink_bandwidth_bytes_per_s": Rule(1e6, 1e14, "bytes/s per chip", integer=False),
    "links.ici_bandwidth_per_link_bytes_per_s": Rule(1e6, 1e14, "bytes/s per link", integer=False),
    "links.fast_hop_latency_s": Rule(1e-10, 1.0, "seconds per hop", integer=False),
    "links.collective_op_latency_s": Rule(0.0, 1e-2, "seconds per collective op", integer=False),
    "links.scale_out_hop_latency_s": Rule(1e-10, 1.0, "seconds per hop", integer=False),
    "links.nvlink_domain_size": Rule(1, 1 << 16, "GPUs in one NVLink domain"),
    "links.pcie_bandwidth_bytes_per_s": Rule(1e6, 1e14, "bytes/s per chip", integer=False),
    "links.pcie_domain_size": Rule(1, 64, "GPUs on one node's PCIe fabric"),
    "links.xgmi_link_bandwidth_bytes_per_s": Rule(1e6, 1e14, "bytes/s per link", integer=False),
    "links.xgmi_domain_size": Rule(2, 64, "GPUs in one fully connected Infinity Fabric node"),
    "links.ici_links_per_chip": Rule(1, 64, "ICI links per chip"),
    "links.torus_dims": Rule(1, 6, "torus dimensions"),
    "links.chips_per_host": Rule(1, 1024, "chips per host"),
    "price_per_chip_hour": Rule(0, 1e4, "dollars per chip-hour", integer=False, open_lo=True),
}


def hardware_rule(dotted: str) -> Rule | None:
    """The rule for a hardware field (`peak_flops_per_s.bf16` takes the peak rule)."""
    return HARDWARE_RULES.get(dotted) or HARDWARE_RULES.get(dotted.split(".")[0])


def check_name(text: str, what: str) -> str:
    """A preset name or path: bounded length, no NUL (neither can name a file)."""
    if len(text) > MAX_NAME_CHARS * 16 or any(len(part) > MAX_NAME_CHARS for part in text.split("/")):
        raise MeshplanError(f"{what} name is too long ({len(text)} characters; a file name has at most "
                            f"{MAX_NAME_CHARS})")
    if "\x00" in text:
        raise MeshplanError(f"{what} name contains a NUL character")
    return text


def flag(name: str) -> str:
    return "--" + name.rstrip("_").replace("_", "-")


def check_cli_params(params: dict[str, Any], command: str = "") -> None:
    """Check every parsed CLI parameter of `command` against its rule (by name), before the command runs."""
    for name, value in params.items():
        if value is None or isinstance(value, bool):
            continue
        rule = CLI_RULES.get(name)
        if rule is not None:
            rule.check(value, flag(name))
        elif isinstance(value, int):
            _ANY_INT.check(value, flag(name))
        elif isinstance(value, float):
            _ANY_FLOAT.check(value, flag(name))
        elif isinstance(value, str) and name in _TEXT_PARAMS_BOUNDED:
            check_name(value, command if name == "name" else name.removesuffix("_name"))


def finite_positive(value: float, label: str) -> float:
    """A float that physics needs finite and positive (a size, a time, a rate)."""
    if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
        raise MeshplanError(f"{label} must be a finite positive number, got {_show(value)}")
    return value
