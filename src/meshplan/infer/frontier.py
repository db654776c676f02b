"""Latency-throughput frontier over batch sizes, the best batch for latency targets, and the layout search.

Book ch.8 'Pareto': small batches give the lowest TPOT, throughput rises with batch until memory (or the
compute roofline) stops it. The search tries every layout (tp, pp, ep, replicas) that divides the chips and
the model's heads, and every batch on the grid, and keeps the highest output throughput meeting the targets.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

from meshplan.cost.efficiency import Efficiency
from meshplan.errors import InfeasibleError, MeshplanError
from meshplan.infer.config import ServeConfig, Workload, check_layout, clients_per_replica, engine_max_num_seqs
from meshplan.infer.harness import harness_settings
from meshplan.infer.memory import max_batch_per_replica
from meshplan.infer.metrics import ServePoint, budget_batch_limit, evaluate
from meshplan.math.integers import divisors
from meshplan.specs.hardware import Chip
from meshplan.specs.model import ModelConfig


@dataclass(frozen=True)
class Targets:
    tpot_s: float | None = None
    ttft_s: float | None = None

    def met(self, p: ServePoint) -> bool:
        return (self.tpot_s is None or p.tpot_s <= self.tpot_s) and (self.ttft_s is None or p.ttft_s <= self.ttft_s)

    def describe(self) -> str:
        parts = [f"TPOT <= {self.tpot_s * 1e3:.3g} ms"] if self.tpot_s is not None else []
        parts += [f"TTFT <= {self.ttft_s * 1e3:.3g} ms"] if self.ttft_s is not None else []
        return " and ".join(parts) or "no target"


def batch_grid(max_batch: int) -> list[int]:
    """Powers of two up to the largest batch that fits, plus that batch."""
    grid, b = [], 1
    while b < max_batch:
        grid.append(b)
        b *= 2
    return grid + [max_batch] if max_batch >= 1 else []


def frontier(m: ModelConfig, chip: Chip, n_chips: int, cfg: ServeConfig, eff: Efficiency, w: Workload,
             mode: str = "continuous", batches: Iterable[int] | None = None,
             clients: int | None = None, requests: int | None = None) -> list[ServePoint]:
    """Metrics at each batch on the grid (or `batches`), smallest first; only batches that fit. `clients`: a closed
    loop of that many clients, each batch then the engine's limit per replica; `requests`: the benchmark's request
    count, whose first round the mean TTFT counts (evaluate)."""
    mb = max_batch_per_replica(m, chip, cfg, eff, w)
    grid_batches = list(batches or batch_grid(mb))
    if batches is None and mode == "continuous" and mb >= 1:
        # the most sequences the step token budget lets decode at once: past it throughput stays flat while TTFT grows
        # (metrics.budget_batch_limit), so the grid holds that batch itself
        grid_batches.append(budget_batch_limit(cfg, chip, w, mb))
    grid = sorted(set(b for b in grid_batches if 1 <= b <= mb))
    # under `clients` every limit at or above the clients per replica runs the same batch (evaluate): one evaluation
    # serves them all
    cap = min(mb, clients_per_replica(n_chips, cfg, clients) or mb)
    points: dict[int, ServePoint] = {}
    for b in grid:
        if min(b, cap) not in points:
            points[min(b, cap)] = evaluate(m, chip, n_chips, cfg, eff, w, b, mode, clients=clients,
                                             requests=requests)
    return [points[min(b, cap)] for b in grid]


def best_point(points: Iterable[ServePoint], targets: Targets = Targets()) -> ServePoint | None:
    """Highest output throughput among points meeting the targets (ties: lower TPOT)."""
    ok = [p for p in points if targets.met(p)]
    return max(ok, key=lambda p: (p.throughput_tokens_per_s, -p.tpot_s)) if ok else None




def layouts(m: ModelConfig, chip: Chip, n_chips: int, base: ServeConfig, tp: int | None = None,
            pp: int | None = None, ep: int | None = None, attention_dp: bool | None = None) -> list[ServeConfig]:
    """Every valid layout; pinned degrees stay fixed. TP stays inside one fast domain on GPUs (NVLink). An MoE model
    is also tried with attention data parallel over tp > 1 chips unless `attention_dp` pins it (True or False)."""
    out = []
    fast = chip.links.fast_domain_size
    for t in ([tp] if tp else divisors(n_chips)):
        if tp is None and t > fast:
            continue
        adps = [attention_dp] if attention_dp is not None else ([False, True] if m.is_moe and t > 1 else [False])
        for p in ([pp] if pp else divisors(n_chips // t if n_chips % t == 0 else 1)):
            for e in ([ep] if ep else (divisors(t) if m.is_moe else [1])):
                for a in adps:
                    cfg = replace(base, tp=t, pp=p, ep=e, attention_dp=a)
                    try:
                        check_layout(m, chip, n_chips, cfg)
                    except InfeasibleError:
                        continue
                    out.append(cfg)
    return out


@dataclass(frozen=True)
class SearchResult:
    best: ServePoint
    ranked: list[ServePoint]  # best point of each layout, best first
    searched: int
    skipped: dict[str, int] = field(default_factory=dict)  # layouts that cannot run here: reason -> count


def search(m: ModelConfig, chip: Chip, n_chips: int, base: ServeConfig, eff: Efficiency, w: Workload,
           targets: Targets = Targets(), mode: str = "continuous", tp: int | None = None, pp: int | None = None,
           ep: int | None = None, batch: int | None = None, clients: int | None = None,
           attention_dp: bool | None = None, harness: str | None = None,
           requests: int | None = None) -> SearchResult:
    """Try layouts and batches; raise with the best reachable latency when no layout meets the targets. `clients`:
    rank every candidate under a closed loop of that many clients (frontier, evaluate), a benchmark of `requests` in
    all where given. `attention_dp`: pinned on or
    off, None tries both for MoE models (layouts). `harness`: each layout runs with the engine limits that benchmark
    harness picks for it (infer/harness.py, e.g. trtllm-bench's max_batch_size and max_num_tokens)."""
    cands = layouts(m, chip, n_chips, base, tp, pp, ep, attention_dp)
    skipped: Counter[str] = Counter()
    if harness is not None:
        runnable = []
        for c in cands:
            try:
                runnable.append(harness_settings(harness, m, chip, c, w).apply(c, chip))
            except InfeasibleError as exc:  # the harness refuses this layout; another may run
                skipped[f"tp={c.tp} pp={c.pp}: {exc}"] += 1
        cands = runnable
    if not cands:
        if skipped:
            raise InfeasibleError(f"{harness} accepts no layout of {m.name} on {n_chips} x {chip.name} "
                                  f"(e.g. {next(iter(skipped))})")
        pinned = " with the pinned degrees" if any(v is not None for v in (tp, pp, ep, attention_dp)) else ""
        raise InfeasibleError(f"no valid layout of {m.name} on {n_chips} x {chip.name}{pinned}")
    ranked, fastest, searched, unfit = [], [], 0, 0
    for cfg in cands:
        try:
            pts = frontier(m, chip, n_chips, cfg, eff, w, mode, [batch] if batch else None, clients, requests)
        except InfeasibleError as exc:  # this layout cannot be placed here; another may be fine
            skipped[f"tp={cfg.tp} pp={cfg.pp}{' attention-dp' if cfg.attention_dp else ''}: {exc}"] += 1
            continue
        searched += len(pts)
        unfit += not pts  # placed, but no batch fits its memory
        if pts:
            fastest.append(min(pts, key=lambda p: p.tpot_s))
        b = best_point(pts, targets)
        if b is not None:
            ranked.append(b)
    if not ranked:
        if skipped and not fastest and not unfit:
            reason, _ = skipped.most_common(1)[0]
            raise InfeasibleError(f"no layout of {m.name} can be placed on {n_chips} x {chip.name} "
                                  f"({sum(skipped.values())} skipped; e.g. {reason})")
        if skipped and not fastest:  # the placed layouts do not fit memory; say that first, then the skipped ones
            reason, _ = skipped.most_common(1)[0]
            what = f"batch {batch}" if batch else "even batch 1"
            raise InfeasibleError(f"{m.name} does not fit on {n_chips} x {chip.name} in any layout at {what} "
                                  f"({w.input_len}+{w.output_len} tokens per sequence; {unfit} placed layouts do not "
                                  f"fit, {sum(skipped.values())} more skipped, e.g. {reason}); add chips or quantize")
        err = _no_layout_error(m, chip, n_chips, w, targets, fastest, batch)
        if not fastest and batch:
            capped = _seq_cap_error(m, chip, eff, w, cands, batch)
            if capped is not None:
                raise capped
        if not fastest and not batch and tp is None and pp is None and ep is None:
            why = _why_no_layout(m, chip, n_chips, base, eff, w, cands)
            err = InfeasibleError(str(err).replace("; add chips", why + "; add chips", 1))
        raise err
    ranked.sort(key=lambda p: (-p.throughput_tokens_per_s, p.tpot_s))
    return SearchResult(ranked[0], ranked, searched, dict(skipped))


def _no_layout_error(m, chip, n_chips, w, targets, fastest, batch) -> MeshplanError:
    if not fastest:
        what = f"batch {batch}" if batch else "even batch 1"
        return InfeasibleError(f"{m.name} does not fit on {n_chips} x {chip.name} in any layout at {what} "
                               f"({w.input_len}+{w.output_len} tokens per sequence); add chips or quantize")
    t = min(fastest, key=lambda p: p.tpot_s)
    f = min(fastest, key=lambda p: p.ttft_s)
    return InfeasibleError(
        f"no layout meets {targets.describe()}: the best reachable TPOT is {t.tpot_s * 1e3:.3g} ms "
        f"(tp={t.config.tp} pp={t.config.pp} ep={t.config.ep}, batch {t.batch}) and the best TTFT is "
        f"{f.ttft_s * 1e3:.3g} ms (tp={f.config.tp} pp={f.config.pp}, batch {f.batch})")


def _seq_cap_error(m: ModelConfig, chip: Chip, eff: Efficiency, w: Workload, tried: list[ServeConfig],
                   batch: int) -> InfeasibleError | None:
    """Where `batch` fits a layout's memory but not the engine's cap on sequences at once (config.engine_max_num_seqs:
    vLLM max_num_seqs, --max-num-seqs), the error that says so; None where memory is what stops it."""
    for c in tried:
        uncapped = max_batch_per_replica(m, chip, replace(c, max_num_seqs=10**9), eff, w)
        cap = engine_max_num_seqs(c, chip)
        if cap is not None and cap < batch <= uncapped:
            how = "--max-num-seqs" if c.max_num_seqs is not None else f"the {c.engine} default"
            return InfeasibleError(f"batch {batch} is more than {c.engine} runs at once: {cap} sequences per replica "
                                   f"({how}; the memory holds {uncapped}). Raise --max-num-seqs, or serve "
                                   f"--concurrency {batch} to queue the rest")
    return None


def _why_no_layout(m: ModelConfig, chip: Chip, n_chips: int, base: ServeConfig, eff: Efficiency, w: Workload,
                   tried: list[ServeConfig]) -> str:
    """Which layouts divide this chip count, and the nearest smaller count (idle chips left over) that serves."""
    shown = ", ".join(f"tp={c.tp} pp={c.pp}" for c in tried[:3]) + (" ..." if len(tried) > 3 else "")
    why = f": the layouts that divide {n_chips} chips ({shown or 'none'}) cannot hold a replica"
    budget = base.max_num_batched_tokens
    if budget and any(max_batch_per_replica(m, chip, replace(c, max_num_batched_tokens=None), eff, w) >= 1
                      for c in tried):  # it is the step's activations at this token budget that do not fit
        return f"{why} with a step budget of {budget:,} tokens (--max-num-batched-tokens): lower it"
    for k in range(n_chips - 1, max(0, n_chips - 64), -1):  # bounded: at most 63 smaller counts
        for cfg in layouts(m, chip, k, base):
            if max_batch_per_replica(m, chip, cfg, eff, w) >= 1:
                return f"{why}; {k} of them would serve it (tp={cfg.tp} pp={cfg.pp})"
    return why
