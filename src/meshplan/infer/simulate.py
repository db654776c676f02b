"""A small discrete-event simulation of continuous batching with chunked prefill under Poisson arrivals.

Each replica runs iteration-level scheduling (Orca, Yu et al. OSDI'22; vLLM): every step admits waiting
requests FCFS up to the batch limit, decodes one token for each sequence past its prompt and spends the rest of
the step token budget on prompt chunks (Sarathi-Serve, Agrawal et al. OSDI'24). An engine that prefills first
(config.mixes_prompts False: SGLang without --enable-mixed-chunk) instead runs a step of prompt chunks alone, with
the whole budget, whenever a prompt is waiting, and decodes in the steps without one. A step costs `step_cost` of
its decode and prefill tokens; the step token budget is the layout's max_num_batched_tokens (step_token_budget).
Requests go to replicas round-robin. Seeded: the same inputs give the same percentiles.

Arrivals, as serving benchmarks issue them: a Poisson process at `rate` requests/s; `rate = inf` sends every
request at t = 0 (TensorRT-LLM's "QPS INF", vLLM benchmark_serving's default --request-rate inf); request lengths are
fixed at the workload's means, drawn from a distribution, or replayed from a benchmark's own sample (a length trace:
a dataset's requests differ in length, and the longest ones set how long a closed batch of them runs); `concurrency`
C caps the requests in flight (vLLM --max-concurrency, NIM/GenAI-Perf concurrency): request j is sent at its time in
the arrival process or as soon as one of the C in flight finishes, whichever is later (vLLM benchmark_serving: each
request waits for its Poisson time, then for the semaphore), so at an infinite rate the first C go at t = 0 and each
finished one is replaced at once. A request joins the first step scheduled
after it arrives: a replacement misses the step the engine schedules as its predecessor ends, and an engine that
schedules one step ahead (config.schedules_ahead) picks each step's batch as the previous step starts.
A request's `arrival` is when the engine can see it; where the layout names a server path (config.frontend), each
client's TTFT adds that path's first-token latency (config.frontend_first_token_s) and a closed-loop client's next
request reaches the engine that much after its predecessor's last token.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from meshplan.cost.efficiency import Efficiency
from meshplan.errors import MeshplanError
from meshplan.infer.config import (
    ServeConfig,
    Workload,
    clients_per_replica,
    frontend_first_token_s,
    frontend_token_s,
    kv_on_demand,
    kv_reserved_per_sequence,
    mixes_prompts,
    prefill_len,
    prefill_room,
    prompt_chunk,
    schedules_ahead,
    step_token_budget,
)
from meshplan.infer.step import step_cost
from meshplan.specs.hardware import Chip
from meshplan.specs.model import ModelConfig
from meshplan.validate import CLI_RULES, MAX_SIM_TOKENS

_MAX_TRACE_BYTES = 64 * 2**20  # MAX_SIM_REQUESTS rows of two lengths take about 2 MB
_INT = re.compile(r"-?[0-9]{1,30}")  # ASCII digits only (str.isdigit also takes '²', which int() refuses)

DISTRIBUTIONS = ("fixed", "exponential", "uniform")
SIM_REQUESTS = 200  # requests simulated where the user names no count


@dataclass(frozen=True)
class SimSpec:
    rate: float  # requests per second to the whole deployment
    n_requests: int = SIM_REQUESTS
    seed: int = 0
    input_dist: str = "fixed"
    output_dist: str = "fixed"
    concurrency: int | None = None  # closed-loop client: at most this many requests outstanding (None = open loop)
    # (input, output) tokens of each request, replayed in order and cycled past the end (a benchmark's own sample,
    # `load_length_trace`); replaces input_dist/output_dist
    lengths: tuple[tuple[int, int], ...] = ()


@dataclass
class _Req:
    arrival: float
    inp: int
    out: int
    sent: float = 0.0  # its time in the arrival process (a closed loop sends it no earlier)
    prefilled: int = 0
    prompt: int = 0  # tokens the prefill pass covers (config.prefill_len), set when a replica takes the request
    generated: int = 0
    first_token: float = -1.0
    finish: float = -1.0
    times: list[float] = field(default_factory=list)


def _lengths(rng: np.random.Generator, dist: str, mean: int, n: int) -> np.ndarray:
    """`fixed` = the mean; `exponential` with that mean; `uniform` on [1, 2*mean - 1]."""
    if dist == "fixed":
        return np.full(n, mean, dtype=int)
    if dist == "exponential":
        return np.maximum(np.rint(rng.exponential(mean, n)), 1).astype(int)
    if dist == "uniform":
        return rng.integers(1, max(2 * mean, 2), n)
    raise MeshplanError(f"unknown length distribution '{dist}' (known: {', '.join(DISTRIBUTIONS)})")


def load_length_trace(path: str | Path) -> tuple[tuple[int, int], ...]:
    """(input, output) tokens per request, in order, from a JSON object with `input_lens` and `output_lens` lists (the
    keys vLLM's benchmark_serving --save-result writes) or a CSV of two integer columns, input then output (a header
    line allowed). Every length in [1, MAX_SEQ_TOKENS], 1 to MAX_SIM_REQUESTS requests."""
    p = Path(path)
    try:
        if p.stat().st_size > _MAX_TRACE_BYTES:
            raise MeshplanError(f"length trace {p.name} is over {_MAX_TRACE_BYTES // 2**20} MiB")
        text = p.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise MeshplanError(f"cannot read length trace {p}: {exc}") from None
    if p.suffix.lower() == ".json":
        try:
            d = json.loads(text)
            ins, outs = d["input_lens"], d["output_lens"]
        except (ValueError, KeyError, TypeError, RecursionError):
            raise MeshplanError(f"length trace {p.name}: expected a JSON object with 'input_lens' and 'output_lens' "
                                "lists") from None
        if not (isinstance(ins, list) and isinstance(outs, list)) or len(ins) != len(outs):
            raise MeshplanError(f"length trace {p.name}: 'input_lens' and 'output_lens' must be lists of one length")
        rows = list(zip(ins, outs, strict=True))
    else:
        rows = []
        for n, line in enumerate(text.splitlines(), 1):
            cells = [c.strip() for c in line.split(",")]
            if not line.strip() or (n == 1 and not _INT.fullmatch(cells[0])):
                continue  # a blank line or the header
            if len(cells) != 2 or not all(_INT.fullmatch(c) for c in cells):
                raise MeshplanError(f"length trace {p.name} line {n}: expected 'input,output' (two integers), "
                                    f"got {line[:40]!r}")
            rows.append((int(cells[0]), int(cells[1])))
    CLI_RULES["requests"].check(len(rows), f"requests in {p.name}")
    seq = CLI_RULES["input_len"]
    return tuple((seq.check(i, f"input length in {p.name}"), seq.check(o, f"output length in {p.name}"))
                 for i, o in rows)


def make_requests(spec: SimSpec, w: Workload) -> list[_Req]:
    if spec.rate <= 0 or spec.n_requests <= 0:
        raise MeshplanError(f"--rate and --requests must be positive (got {spec.rate}, {spec.n_requests})")
    if spec.concurrency is not None and spec.concurrency <= 0:
        raise MeshplanError(f"--concurrency must be positive, got {spec.concurrency}")
    if spec.lengths and (spec.input_dist, spec.output_dist) != ("fixed", "fixed"):
        raise MeshplanError("a length trace gives every request's lengths: it does not combine with "
                            "--input-dist/--output-dist")
    trace = [spec.lengths[j % len(spec.lengths)] for j in range(spec.n_requests)] if spec.lengths else None
    generated = sum(o for _, o in trace) if trace else spec.n_requests * w.output_len
    if generated > MAX_SIM_TOKENS:  # the simulation steps every generated token
        raise MeshplanError(f"{generated:,} output tokens to simulate (requests x output length); at "
                            f"most {MAX_SIM_TOKENS:,} (about 20 s on one core): simulate fewer requests")
    rng = np.random.default_rng(spec.seed)
    gaps = rng.exponential(1.0 / spec.rate, spec.n_requests) if math.isfinite(spec.rate) else np.zeros(spec.n_requests)
    arrivals = np.cumsum(gaps)  # Poisson process; all at t = 0 for an infinite rate
    if trace:
        ins, outs = (np.array(col) for col in zip(*trace, strict=True))
    else:
        ins = _lengths(rng, spec.input_dist, w.input_len, spec.n_requests)
        outs = _lengths(rng, spec.output_dist, w.output_len, spec.n_requests)
    return [_Req(float(a), int(i), int(o), float(a)) for a, i, o in zip(arrivals, ins, outs, strict=True)]


class _Replica:
    def __init__(self, m: ModelConfig, chip: Chip, cfg: ServeConfig, eff: Efficiency, max_batch: int,
                 concurrency: int | None = None, kv_tokens: float | None = None):
        self.m, self.chip, self.cfg, self.eff, self.max_batch = m, chip, cfg, eff, max_batch
        self.concurrency = concurrency
        # KV tokens the replica's cache holds (None: the slots alone limit admission, as at fixed lengths, where the
        # slot count was sized from the same cache); the engine's reservation rule (config.kv_reserved_per_sequence):
        # a request's whole input + output at admission, or only its current tokens where KV is allocated on demand
        self.kv_tokens = kv_tokens
        self.on_demand = kv_on_demand(cfg, chip)
        self.ahead = schedules_ahead(cfg, chip)  # the scheduler picks step n+1 while step n runs
        self.mixes = mixes_prompts(cfg, chip)  # decodes ride in the steps that carry prompts
        self.frontend_s = frontend_first_token_s(cfg, chip)
        # whether streamed tokens cost the loop (config.frontend_token_s); elsewhere the step's cost does not depend on
        # how many tokens it emits, which stays out of the cache key
        self.streams = frontend_token_s(cfg, chip) > 0.0
        self._cache: dict[tuple, float] = {}
        self.last_ctx = 0.0  # mean decode context of the last step

    def _cost(self, n_dec: int, ctx: float, n_pre: int, pre_ctx: float, seqs: int, n_chunks: int = 0,
              streamed: int | None = None) -> float:
        """`streamed`: tokens the step emits to the server path (default: its decodes and chunks, step_cost's)."""
        key = (n_dec, round(ctx / 64), round(n_pre / 16), round(pre_ctx / 64), seqs, n_chunks, streamed)
        if key not in self._cache:
            self._cache[key] = step_cost(self.m, self.chip, self.cfg, self.eff, n_dec, ctx, n_pre, pre_ctx,
                                         seqs, n_chunks or None, streamed_tokens=streamed).time_s
        return self._cache[key]

    def _kv_tokens_of(self, r: _Req) -> int:
        return r.inp + (r.generated if self.on_demand else r.out)

    def _kv_admits(self, running: list[_Req], r: _Req) -> bool:
        """Whether the cache has room for `r` beside the running requests (a request alone is always admitted: an
        engine whose cache cannot hold one request rejects it at once, which the simulation does not model)."""
        if self.kv_tokens is None or not running:
            return True
        return sum(self._kv_tokens_of(x) for x in running) + self._kv_tokens_of(r) <= self.kv_tokens

    def run(self, reqs: list[_Req]) -> None:
        if self.concurrency is not None:  # closed loop: request j >= C waits for the (j-C)-th one to finish
            for r in reqs[self.concurrency:]:
                r.arrival = math.inf
        for r in reqs:  # LMDeploy TurboMind prefills all but the prompt's last token (config.prefill_len)
            r.prompt = prefill_len(self.cfg, self.chip, r.inp)
        waiting, running, t, i, done = [], [], 0.0, 0, 0
        start = None  # when the step that just ended began (None: the engine was idle)
        held = 0  # slots of sequences that ended in the step just run, still held by an engine one step ahead
        while i < len(reqs) or waiting or running:
            # The batch of the step starting at t was picked at `horizon`: at t by a serial loop (vLLM V1
            # EngineCore.run_busy_loop: schedule -> execute -> update outputs, in turn), at the start of the
            # previous step by one that schedules ahead (config.schedules_ahead). A request is in it only if it
            # arrived before that instant: a closed-loop client's next request, sent once the previous request's
            # last token has left the engine, misses the step the engine schedules at that same moment (vLLM
            # benchmark_serving --max-concurrency sends it after the previous stream ends). An idle engine
            # starts whatever has arrived.
            idle = not running and not waiting
            horizon = start if (self.ahead and start is not None and not idle) else t
            while i < len(reqs) and (reqs[i].arrival < horizon or (idle and reqs[i].arrival <= t)):
                waiting.append(reqs[i])
                i += 1
            # a waiting request takes a free slot FCFS (vLLM's waiting queue, TensorRT-LLM's capacity scheduler).
            # An engine one step ahead picked this step's batch before the last step ended, while the sequences that
            # ended in it still held their slots (SGLang event_loop_overlap: get_next_batch_to_run, then
            # process_batch_result of the previous batch): their slots are reused one step later
            while waiting and len(running) < self.max_batch - held and self._kv_admits(running, waiting[0]):
                running.append(waiting.pop(0))
            if not running and waiting:  # every slot held by an ended sequence: that step decodes only them
                start, t, held = t, t + self._cost(held, self.last_ctx, 0, 0.0, held), 0
                continue
            if not running:
                t, start = max(t, reqs[i].arrival), None
                continue
            start = t
            t = self._step(running, t)
            finished = sum(r.finish >= 0 for r in running)
            running = [r for r in running if r.finish < 0]
            held = finished if self.ahead else 0
            if self.concurrency is not None:
                # the client sees the last token after its way out of the server and its next request reaches the
                # engine after the way in: together the server path's first-token latency (frontend_first_token_s);
                # no earlier than its own time in the arrival process. Both are non-decreasing in j, so the requests
                # still reach the engine in order
                for j in range(done + self.concurrency, min(done + finished + self.concurrency, len(reqs))):
                    reqs[j].arrival = max(reqs[j].sent, t + self.frontend_s)
                done += finished

    def _step(self, running: list[_Req], t: float) -> float:
        dec = [r for r in running if r.prefilled >= r.prompt]
        alone = not self.mixes and len(dec) < len(running)
        if alone:
            # prefill first (config.mixes_prompts): a step with a waiting prompt prefills prompts alone, with the whole
            # step budget; the running sequences decode in the next step without one (SGLang get_next_batch_to_run)
            dec = []
        # under attention DP each rank has one prompt's room (prefill_room) and the step as many as it has ranks
        room = prefill_room(self.cfg, self.chip, len(dec))
        budget, chunks = room * self.cfg.attention_dp_size, []
        for r in running:
            if r.prefilled < r.prompt and budget > 0:
                c = prompt_chunk(self.cfg, self.chip, r.prompt - r.prefilled, min(budget, room))
                if c > budget and chunks:
                    # whole prompts only (TensorRT-LLM without chunked context): FCFS, the first prompt that does not
                    # fit ends the step's prefill; the step's first prompt runs whole even past the budget (the
                    # engine's max_num_tokens must admit its longest prompt; and no prompt waits forever behind
                    # the decodes)
                    break
                chunks.append((r, c))
                budget -= c
        ctx = float(np.mean([r.inp + r.generated for r in dec])) if dec else 0.0
        if not alone:  # the decode context of the last decoding step (a prompt-only step decodes nothing)
            self.last_ctx = ctx
        n_pre = sum(c for _, c in chunks)
        pre_ctx = float(np.mean([r.prefilled + c / 2 for r, c in chunks])) if chunks else 0.0
        # tokens out to the server path: one per decode, one per prompt whose last chunk this is (its first token)
        firsts = sum(1 for r, c in chunks if r.prefilled + c >= r.prompt == r.inp) if self.streams else 0
        t += self._cost(len(dec), ctx, n_pre, pre_ctx, len(chunks) if alone else len(running), len(chunks),
                        len(dec) + firsts if self.streams else None)
        for r in dec:
            r.generated += 1
            r.times.append(t)
            if r.first_token < 0:  # the first token from a decode step (engine_first_token_decode_step)
                r.first_token = t
        for r, c in chunks:
            r.prefilled += c
            if r.prefilled >= r.prompt == r.inp:  # the prompt's last chunk yields the first token (prefill_len)
                r.generated, r.first_token = 1, t
                r.times.append(t)
        for r in running:
            if r.generated >= r.out and r.finish < 0:
                r.finish = t
        return t


def _pct(xs: list[float]) -> dict[str, float]:
    if not xs:
        return {"p50": 0.0, "p90": 0.0, "p99": 0.0, "mean": 0.0}
    a = np.asarray(xs)
    return {"p50": float(np.percentile(a, 50)), "p90": float(np.percentile(a, 90)),
            "p99": float(np.percentile(a, 99)), "mean": float(a.mean())}


def simulate(m: ModelConfig, chip: Chip, n_chips: int, cfg: ServeConfig, eff: Efficiency, w: Workload,
             max_batch: int, spec: SimSpec, kv_batch: int | None = None) -> dict:
    """TTFT, TPOT (per request) and ITL (per token gap) percentiles (p50/p90/p99, mean) and achieved output throughput
    under the arrivals of `spec`. `max_batch`: the sequences a replica runs at once (its slots); `kv_batch`: the
    sequences of the workload's mean lengths its KV cache holds (memory.max_batch_per_replica; default max_batch).
    Session 23, QA finding: a cache sized from a client count of 8 made requests drawn longer than the mean queue
    for memory the replica had (simulated TTFT 3-8x the closed form's)."""
    if max_batch <= 0:
        raise MeshplanError("the simulation needs a batch limit of at least 1 sequence per replica")
    reqs = make_requests(spec, w)
    replicas = n_chips // cfg.chips_per_replica
    conc = clients_per_replica(n_chips, cfg, spec.concurrency)
    # requests of different lengths fill the cache in tokens, not in slots: the replica's cache holds max_batch
    # sequences of the workload's reservation (memory.max_batch_per_replica sized it so)
    varied = len({(r.inp, r.out) for r in reqs}) > 1
    kv_tokens = (kv_batch or max_batch) * kv_reserved_per_sequence(cfg, chip, w) if varied else None
    for k in range(replicas):
        _Replica(m, chip, cfg, eff, max_batch, conc, kv_tokens).run(reqs[k::replicas])
    # a request's arrival is when the engine can see it; the client's TTFT adds the server path's ways in and out
    # (config.frontend_first_token_s); the later tokens' gaps are the engine's
    frontend_s = frontend_first_token_s(cfg, chip)
    ttft = [r.first_token - r.arrival + frontend_s for r in reqs]
    tpot = [(r.finish - r.first_token) / (r.out - 1) for r in reqs if r.out > 1]
    # every gap between two tokens of a request, pooled over the requests (vLLM benchmark_serving's "Mean ITL":
    # np.mean of all requests' itl lists); TPOT above weighs each request once, the pooled gaps weigh each token
    # once, and the two differ where requests differ in length
    itl = [b - a for r in reqs for a, b in zip(r.times, r.times[1:], strict=False)]
    span = max(r.finish for r in reqs) - reqs[0].arrival
    return {"rate_requests_per_s": spec.rate, "requests": spec.n_requests, "seed": spec.seed,
            "concurrency": spec.concurrency, "max_num_batched_tokens": step_token_budget(chip, cfg),
            "input_dist": "trace" if spec.lengths else spec.input_dist,
            "output_dist": "trace" if spec.lengths else spec.output_dist, "max_batch_per_replica": max_batch,
            "ttft_s": _pct(ttft), "tpot_s": _pct(tpot), "itl_s": _pct(itl),
            "throughput_tokens_per_s": sum(r.out for r in reqs) / span if span > 0 else 0.0}
