"""A training layout: how the chips are split, and the arrays of many layouts the search evaluates.

Degrees follow torchtitan's naming: `dp` replicas (pure data parallel), `fsdp` fully-sharded group
(ZeRO-3), `tp` tensor parallel (with sequence parallelism), `pp` pipeline stages with `vpp` virtual
stages each (interleaved 1F1B), `cp` context parallel (ring attention), `ep` expert parallel (carved out
of the data-parallel ranks, as in Megatron). dp·fsdp·tp·pp·cp = chips.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

import numpy as np

from meshplan.errors import MeshplanError
from meshplan.math.transformer import RECOMPUTE_POLICIES

RECOMPUTE_CODES = {name: i for i, name in enumerate(RECOMPUTE_POLICIES)}  # none, selective, full, gemm-last
DEGREES = ("dp", "fsdp", "tp", "pp", "vpp", "cp", "ep", "microbatch", "zero")
# host offload of model state, 0 or 1 each: the optimizer (ZeRO-Offload, Ren et al. 2021) and the weights
# (ZeRO-Infinity, Rajbhandari et al. 2021)
OFFLOAD_FLAGS = ("offload_optimizer", "offload_params")


@dataclass(frozen=True)
class ParallelConfig:
    """One layout. `zero` is the ZeRO stage over the `dp` group (1: optimizer, 2: + gradients);
    FSDP (`fsdp` > 1) is ZeRO-3 over its own group. `offload` is the fraction of saved activations
    moved to host memory; `offload_optimizer` keeps the fp32 master and Adam moments on the host and runs the update
    on its CPU (ZeRO-Offload); `offload_params` keeps the weights on the host, streamed in layer by layer
    (ZeRO-Infinity)."""

    dp: int = 1
    fsdp: int = 1
    tp: int = 1
    pp: int = 1
    vpp: int = 1
    cp: int = 1
    ep: int = 1
    microbatch: int = 1
    recompute: str = "none"
    zero: int = 0
    offload: float = 0.0
    sequence_parallel: bool = True
    offload_optimizer: int = 0
    offload_params: int = 0

    @property
    def chips(self) -> int:
        return self.dp * self.fsdp * self.tp * self.pp * self.cp

    @property
    def data_parallel(self) -> int:
        return self.dp * self.fsdp

    def mesh(self) -> dict[str, int]:
        """Logical mesh, outermost first: pipeline, data, fsdp, context, tensor (tensor innermost gets
        the fastest links)."""
        return {"pipeline": self.pp, "data": self.dp, "fsdp": self.fsdp, "context": self.cp, "tensor": self.tp}

    def as_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        parts = [f"{k}={getattr(self, k)}" for k in ("dp", "fsdp", "tp", "pp", "cp", "ep") if getattr(self, k) > 1]
        if self.pp > 1 and self.vpp > 1:
            parts.append(f"vpp={self.vpp}")
        parts.append(f"mb={self.microbatch}")
        parts.append(f"recompute={self.recompute}")
        if self.zero and self.dp * (self.cp if self.fsdp == 1 else 1) > 1:  # ZeRO over the dp (×cp) replicas
            parts.append(f"zero={self.zero}")
        if self.offload:
            parts.append(f"offload={self.offload:g}")
        parts += [f"{k}=1" for k in OFFLOAD_FLAGS if getattr(self, k)]
        return " ".join(parts)


@dataclass
class LayoutArrays:
    """Many layouts as parallel numpy arrays (one entry per layout), for vectorised evaluation."""

    dp: np.ndarray
    fsdp: np.ndarray
    tp: np.ndarray
    pp: np.ndarray
    vpp: np.ndarray
    cp: np.ndarray
    ep: np.ndarray
    microbatch: np.ndarray
    recompute: np.ndarray  # codes into RECOMPUTE_POLICIES
    zero: np.ndarray
    offload: np.ndarray
    sequence_parallel: bool = True
    offload_optimizer: np.ndarray | None = None  # 0/1 per layout; None = no layout offloads it
    offload_params: np.ndarray | None = None

    def __post_init__(self) -> None:
        for k in OFFLOAD_FLAGS:
            if getattr(self, k) is None:
                setattr(self, k, np.zeros(len(self), np.int64))

    def __len__(self) -> int:
        return int(self.dp.shape[0])

    @classmethod
    def from_configs(cls, configs: list[ParallelConfig]) -> LayoutArrays:
        cols = {f.name: [] for f in fields(cls) if f.name != "sequence_parallel"}
        for c in configs:
            for k in cols:
                v = getattr(c, k)
                cols[k].append(RECOMPUTE_CODES[v] if k == "recompute" else v)
        arrays = {k: np.asarray(v, dtype=float if k == "offload" else np.int64) for k, v in cols.items()}
        sp = configs[0].sequence_parallel if configs else True
        return cls(**arrays, sequence_parallel=sp)

    def take(self, idx: np.ndarray, **values: int) -> LayoutArrays:
        """The layouts at `idx`, with the named columns set to one value (e.g. offload_optimizer=1)."""
        cols = {f.name: getattr(self, f.name)[idx] for f in fields(self) if f.name != "sequence_parallel"}
        cols.update({k: np.full(len(idx), v, np.int64) for k, v in values.items()})
        return LayoutArrays(**cols, sequence_parallel=self.sequence_parallel)

    @classmethod
    def concat(cls, *parts: LayoutArrays) -> LayoutArrays:
        """The layouts of `parts`, in order (one problem: the first's sequence_parallel)."""
        cols = {f.name: np.concatenate([getattr(p, f.name) for p in parts]) for f in fields(cls)
                if f.name != "sequence_parallel"}
        return cls(**cols, sequence_parallel=parts[0].sequence_parallel)

    def config(self, i: int) -> ParallelConfig:
        kw = {k: int(getattr(self, k)[i]) for k in DEGREES + OFFLOAD_FLAGS}
        return ParallelConfig(**kw, recompute=RECOMPUTE_POLICIES[int(self.recompute[i])],
                              offload=float(self.offload[i]), sequence_parallel=self.sequence_parallel)


def check_recompute(name: str) -> str:
    if name not in RECOMPUTE_CODES:
        raise MeshplanError(f"unknown recompute policy '{name}' (known: {', '.join(RECOMPUTE_POLICIES)})")
    return name
