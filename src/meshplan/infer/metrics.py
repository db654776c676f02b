"""Serving metrics at one batch: TTFT, TPOT, end-to-end latency, output tokens/s, memory, cost per token.

Two batching modes:
* "continuous" (default; Orca/vLLM iteration-level scheduling with chunked prefill, Sarathi-Serve): in steady
  state each step decodes B sequences and prefills the prompts of the B/O requests that replace those finishing,
  i.e. B*I/O prompt tokens per step. TPOT = that mixed step; throughput = B/TPOT per replica. A new request's
  TTFT = its prompt in chunks of the step token budget, each chunk riding one mixed step. An engine that prefills
  first (SGLang's default: config.mixes_prompts) runs those prompt tokens in steps of their own instead, q per decode
  step (prefill_first_steps): TPOT = the decode step + q prompt steps, and a prompt's chunks carry no decodes.
* "static" (book ch.7 'batched prefill + generate'; TensorRT-LLM gptSessionBenchmark): the B prompts prefill
  together (TTFT), then O-1 decode steps at the mean context; throughput = B*O / e2e.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from meshplan.cost.efficiency import Efficiency
from meshplan.errors import MeshplanError
from meshplan.infer.config import (
    ServeConfig,
    Workload,
    chunked_prefill,
    clients_per_replica,
    frontend_first_token_s,
    kv_reserved_per_sequence,
    mixes_prompts,
    prefill_len,
    prefill_room,
    prompt_chunk,
    replica_token_budget,
    schedules_ahead,
)
from meshplan.infer.memory import MemoryBreakdown, memory_per_chip
from meshplan.infer.step import StepCost, decode_step, prefill_step, step_cost
from meshplan.specs.hardware import Chip
from meshplan.specs.model import ModelConfig

MODES = ("continuous", "static")


@dataclass(frozen=True)
class ServePoint:
    """Metrics of one layout at one batch. `batch` is sequences in flight per replica."""

    config: ServeConfig
    mode: str
    batch: int
    replicas: int
    n_chips: int
    ttft_s: float
    tpot_s: float
    e2e_latency_s: float
    throughput_tokens_per_s: float  # OUTPUT tokens/s of the whole deployment
    input_tokens_per_s: float
    input_time_fraction: float  # share of chip time spent on prompts (splits the cost)
    memory: MemoryBreakdown
    step: StepCost
    price_per_chip_hour: float
    # sequences per replica that decode at once: `batch`, or fewer where the step token budget cannot take the prompts
    # of more (budget_batch_limit)
    running_batch: int
    queue_wait_s: float = 0.0  # mean wait for a slot of the clients beyond the batch limit (admission_queue_wait_s)
    # a closed-loop benchmark's first round (evaluate's `requests`): its mean TTFT with the server path, None without
    first_round_ttft_s: float | None = None
    # a closed loop whose rounds stay in phase (in_phase_ttft_s priced its TTFT): True; spread (the steady state): False;
    # None without a closed loop of clients
    rounds_in_phase: bool | None = None
    # where rounds_in_phase: the TTFT were the clients' phases spread (the steady state), the other regime; measured
    # TensorRT-LLM loops mostly lie at or beyond the grouped one (benchmarks/README.md session 32)
    spread_ttft_s: float | None = None

    @property
    def throughput_per_chip(self) -> float:
        return self.throughput_tokens_per_s / self.n_chips

    @property
    def deployment_batch(self) -> int:
        return self.batch * self.replicas

    def cost_per_million_tokens(self) -> dict[str, float]:
        """Dollars per million input and output tokens at the catalog price, chip time split by the share
        spent on prompts vs generation; `blended` divides by all tokens (book ch.8: price/3600/(tok/s/chip))."""
        usd_per_s = self.n_chips * self.price_per_chip_hour / 3600.0
        f = self.input_time_fraction
        out = usd_per_s * (1 - f) / self.throughput_tokens_per_s * 1e6
        inp = usd_per_s * f / self.input_tokens_per_s * 1e6 if self.input_tokens_per_s > 0 else 0.0
        blended = usd_per_s / (self.throughput_tokens_per_s + self.input_tokens_per_s) * 1e6
        return {"input": inp, "output": out, "blended": blended}

    def as_dict(self) -> dict:
        return {
            "config": {**self.config.as_dict(), "replicas": self.replicas, "chips": self.n_chips},
            "mode": self.mode,
            "batch": self.batch,
            "running_batch": self.running_batch,
            "deployment_batch": self.deployment_batch,
            "ttft_s": self.ttft_s,
            "tpot_s": self.tpot_s,
            "e2e_latency_s": self.e2e_latency_s,
            "throughput_tokens_per_s": self.throughput_tokens_per_s,
            "throughput_tokens_per_s_per_chip": self.throughput_per_chip,
            "input_tokens_per_s": self.input_tokens_per_s,
            "memory_bytes_per_chip": self.memory.as_dict(),
            "fits": self.memory.fits,
            "cost_per_million_tokens": self.cost_per_million_tokens(),
            "decode_step": self.step.as_dict(),
        }


def scheduler_wait_s(busy_step_s: float, others: float, ahead: bool = False, closed_loop: bool = False,
                     queued: bool = False, residual_s: float | None = None, arrival_delay_s: float = 0.0) -> float:
    """Wait of a new request for the engine's next iteration: iteration-level scheduling (Orca, Yu et al. OSDI'22;
    vLLM/TensorRT-LLM/SGLang schedulers) admits it only at a step boundary, so one arriving at a random moment
    while other sequences keep the engine busy waits the mean residual of a fixed-length step, busy_step_s / 2
    (`residual_s` where the steps differ in length: step_residual_s).
    A closed-loop client (`closed_loop`: a fixed number of clients, each sending its next request when the previous
    one's last token arrives) sends it just as a step ends, after the engine has picked the next step's batch (vLLM
    V1 EngineCore.run_busy_loop and TensorRT-LLM's Executor::Impl::executionLoop schedule the next step right after
    handing out the last one's tokens), so it waits that whole step: busy_step_s. Where the request reaches the
    engine `arrival_delay_s` after that step boundary (the server path between the client and the engine:
    config.frontend_first_token_s, the last token's way out and the next request's way in), it arrives that far into
    the running steps and waits what is left of the one it lands in, busy_step_s - (delay mod busy_step_s), as the
    simulation's closed loop has it (simulate._Replica.run).
    An engine that schedules one step ahead (`ahead`, config.schedules_ahead) has already picked the next step's
    batch when the request arrives, so it also waits one more whole step.
    A request that was already waiting for a slot (`queued`: more clients than the engine's batch limit) is admitted
    into the step the engine schedules as the slot frees: no wait beyond the queue's (admission_queue_wait_s); an
    engine one step ahead sees the freed slot one step later (its next batch was picked before the step ended).
    An idle engine (no other sequence) starts it at once."""
    if others <= 0:
        return 0.0
    if queued:
        return busy_step_s if ahead else 0.0
    random = busy_step_s / 2.0 if residual_s is None else residual_s
    closed = busy_step_s - math.fmod(arrival_delay_s, busy_step_s) if busy_step_s > 0 else 0.0
    return (closed if closed_loop else random) + (busy_step_s if ahead else 0.0)


def step_residual_s(share: float, long_s: float, short_s: float) -> float:
    """Mean wait of a request arriving at a random moment for the running step to end, when a share of the steps
    lasts long_s and the rest short_s: the mean residual life of a renewal process, E[S^2] / (2 E[S]) (Kleinrock,
    Queueing Systems vol. 1, 1975, §5.2): a random moment more likely falls in a long step (length-biased
    sampling). Equal steps give S / 2."""
    mean = share * long_s + (1.0 - share) * short_s
    return (share * long_s**2 + (1.0 - share) * short_s**2) / (2.0 * mean) if mean > 0 else 0.0


def prefill_queue_wait_s(arrivals_per_s: float, work_s: float, others: float) -> float:
    """Mean wait of a prompt behind the prompts that arrived before it: the engine serves prompt work first come,
    first served (vLLM/Sarathi FCFS waiting queue; TensorRT-LLM's FCFS capacity scheduler), each prompt a fixed
    `work_s` of prefill time beyond the decodes, prompts arriving at random at `arrivals_per_s`: an M/D/1 queue,
    whose mean wait is the Pollaczek-Khinchine formula with a deterministic service time,
    W = lambda S^2 / (2 (1 - rho)), rho = lambda S (Kleinrock, Queueing Systems vol. 1, 1975, §5.6). The prompts
    come from `others` other clients, so no more than all of theirs can be ahead (finite source): W <= others * S,
    which is also the wait when rho >= 1."""
    rho = arrivals_per_s * work_s
    if rho <= 0.0:
        return 0.0
    most = others * work_s
    return most if rho >= 1.0 else min(arrivals_per_s * work_s**2 / (2.0 * (1.0 - rho)), most)


def admission_queue_wait_s(clients: float, slots: int, requests_per_s: float) -> float:
    """Mean wait for a slot when a closed loop of `clients` runs against an engine that holds at most `slots`
    sequences (vLLM max_num_seqs, TensorRT-LLM max_batch_size, or its KV capacity): at steady state the slots stay
    full and the other clients - slots requests wait FCFS (vLLM's waiting queue, TensorRT-LLM's capacity
    scheduler). Little's law on the waiting queue (Little 1961; Kleinrock, Queueing Systems vol. 1, 1975, §2.1):
    W = (requests waiting) / (throughput) = (C - B) / X, X = the engine's request throughput, which equals
    C / X - (time in service) with X = B / (time in service). Zero when every client has a slot."""
    if clients <= slots:
        return 0.0
    if requests_per_s <= 0:
        raise MeshplanError(f"request throughput must be positive, got {requests_per_s}")
    return (clients - slots) / requests_per_s


def prompt_chunks(cfg: ServeConfig, chip: Chip, w: Workload, others: int) -> tuple[int, int, int]:
    """(tokens the prefill pass covers, tokens per chunk, chunks) of one prompt beside `others` decoding sequences:
    engines whose first token comes from a decode step prefill all but the prompt's last token (config.prefill_len);
    the chunk is the step budget less the others' decode tokens (config.prefill_room), or the whole prompt where the
    engine does not chunk (config.prompt_chunk)."""
    prompt = prefill_len(cfg, chip, w.input_len)
    # a prefill-first engine's prompt steps carry no decodes: the whole budget (config.mixes_prompts)
    room = prefill_room(cfg, chip, others if mixes_prompts(cfg, chip) else 0)
    chunk = prompt_chunk(cfg, chip, prompt, room)
    return prompt, chunk, math.ceil(prompt / chunk) if prompt > 0 else 0


def ttft_continuous(m: ModelConfig, chip: Chip, cfg: ServeConfig, eff: Efficiency, w: Workload,
                    batch: int, busy_step_s: float = 0.0, others_arrivals_per_s: float = 0.0,
                    closed_loop: bool = False, queue_wait_s: float | None = None,
                    residual_s: float | None = None, decode: StepCost | None = None,
                    prompt_work_s: float | None = None) -> float:
    """The wait for a slot (`queue_wait_s`, admission_queue_wait_s, when more clients than slots: the request is
    then admitted as a slot frees), else the wait for the next iteration (scheduler_wait_s of the running batch's
    step `busy_step_s`), the wait
    behind the other clients' prompts (prefill_queue_wait_s at `others_arrivals_per_s`), then the
    prompt split into chunks of the step budget (max_num_batched_tokens minus the other sequences' decode
    tokens); each chunk rides one mixed step with the batch's other B-1 decodes (Sarathi-Serve chunked prefill,
    Agrawal et al. OSDI'24 §4.2: decodes are scheduled first, prefill fills the rest of the token budget).
    `decode`: the pure decode step of `batch` sequences where the caller has it (else computed here).
    `prompt_work_s`: a prompt's own share of the engine's time where the caller knows it (a prefill-first engine runs
    the waiting prompts together, several to a step: metrics._continuous), else its chunk steps less the decodes."""
    others = max(batch - 1, 0)
    # engines whose first token comes from a decode step prefill all but the prompt's last token, then decode it
    # beside the batch (serving.yaml engine_first_token_decode_step)
    prompt, chunk, n_chunks = prompt_chunks(cfg, chip, w, others)
    # a prefill-first engine runs the prompt's steps without the others' decodes (config.mixes_prompts)
    riders = others if mixes_prompts(cfg, chip) else 0
    s = step_cost(m, chip, cfg, eff, riders, w.mean_decode_context, chunk, prompt / 2.0, max(batch, 1) if riders else 1)
    # the last chunk holds what the full ones leave: a prompt a few tokens past one chunk takes one full step and one
    # step with those few tokens, not two full ones
    prefill_s = 0.0
    if n_chunks:
        rest = prompt - (n_chunks - 1) * chunk
        last = s if rest >= chunk else step_cost(m, chip, cfg, eff, riders, w.mean_decode_context, rest,
                                                 prompt - rest / 2.0, max(batch, 1) if riders else 1)
        prefill_s = (n_chunks - 1) * s.time_s + last.time_s
    queued = queue_wait_s is not None
    ttft = (queue_wait_s or 0.0) + scheduler_wait_s(busy_step_s, others, schedules_ahead(cfg, chip), closed_loop,
                                                    queued, residual_s, frontend_first_token_s(cfg, chip)) + prefill_s
    if others_arrivals_per_s > 0:
        # a prompt's own work: its share of full chunk steps (prompt / chunk of them: the room its last chunk leaves
        # goes to the next prompt in line) less the decode steps the other sequences would have run anyway. Under
        # attention DP only the prompts of its own rank queue ahead of it (each rank schedules its own requests FCFS:
        # config.attention_dp_limits_per_rank), a 1/ranks share of the arrivals and of the other sequences
        # (a prefill-first engine's prompt step holds no decodes: its whole time is the prompt's)
        dec = decode_step(m, chip, cfg, eff, others, w.mean_decode_context).time_s if riders else 0.0
        dp = cfg.attention_dp_size
        # a pipeline's micro-batches each carry a waiting prompt (step._pipeline_parts: one chunk per micro-batch), so
        # under a queue the pp stages serve up to pp prompts per step: the queue's server is that many times faster
        # than one prompt's own pass (the M/D/c queue's load rho = lambda S / c, here as one server of S / c)
        servers = min(float(cfg.pp), float(max(batch, 1)))
        own = (prompt / chunk if chunk > 0 else 0.0) * max(s.time_s - dec, 0.0)
        work = (own if prompt_work_s is None else prompt_work_s) / servers
        ttft += prefill_queue_wait_s(others_arrivals_per_s / dp, work, others / dp)
    if prompt < w.input_len:  # the first token from the decode step after the prefill (prefill_len)
        ttft += (decode or decode_step(m, chip, cfg, eff, max(batch, 1), w.mean_decode_context)).time_s
    return ttft


def mean_step_s(m: ModelConfig, chip: Chip, cfg: ServeConfig, eff: Efficiency, w: Workload, batch: int,
                prompts_per_step: float, pure: StepCost | None = None) -> StepCost:
    """The mean step (its time and each term, averaged over the steps) of `batch` decoding sequences when
    `prompts_per_step` prompts of w.input_len arrive per step. Prompt tokens are not spread evenly over the steps: the
    engine schedules the decodes first and fills the rest of the step token budget with the waiting prompt
    (Sarathi-Serve, Agrawal et al. OSDI'24 §4.2; vLLM V1 Scheduler.schedule: running requests, then waiting ones
    up to max_num_batched_tokens), so a step carries one chunk of min(budget - decodes, prompt) tokens (a whole
    prompt where the engine does not chunk) or none; only when prompts arrive faster than one chunk per step does
    every step carry them. A share p = (prompt tokens per step) / (tokens a prompt-carrying step holds) of the steps
    carries a chunk, the rest are pure decodes, and the mean step is p x chunk step + (1 - p) x decode step: each
    inter-token gap is one step, so a request's mean ITL is this mean (vLLM benchmark_serving TPOT = (e2e - TTFT)
    / (output - 1); genai-perf ITL alike). A step that carries a chunk is longer than the decode step by more than
    its share of the prompt when the decode is HBM-bound and the chunk compute-bound, so this mean is above the
    cost of one step carrying the mean prompt tokens. `pure`: the pure decode step of `batch` sequences where the
    caller has it."""
    return _mix(*_prompt_steps(m, chip, cfg, eff, w, batch, prompts_per_step, pure)[:3])


def _mix(share: float, step: StepCost, pure: StepCost) -> StepCost:
    """The mean of `step` in a share of the steps and `pure` in the others, term by term."""
    parts = {k: share * step.parts.get(k, 0.0) + (1.0 - share) * pure.parts.get(k, 0.0)
             for k in step.parts.keys() | pure.parts.keys()}
    return StepCost(share * step.time_s + (1.0 - share) * pure.time_s, parts, max(parts, key=parts.get))


def _prompt_steps(m, chip, cfg, eff, w, batch, prompts_per_step,
                  pure: StepCost | None = None) -> tuple[float, StepCost, StepCost, tuple[float, StepCost] | None]:
    """(share of the steps that carry prompt tokens, such a step, a pure decode step, and for an engine that prefills
    first its prefill_first_steps, else None): mean_step_s. `pure`: the pure decode step of `batch` sequences where the
    caller has it."""
    mean_tokens = prompts_per_step * w.input_len
    pure = pure or decode_step(m, chip, cfg, eff, batch, w.mean_decode_context)
    if mean_tokens <= 0:
        return 0.0, pure, pure, None
    if not mixes_prompts(cfg, chip):
        # prefill first: each decode step comes with q prompt-only steps (prefill_first_steps); as one "step" of the
        # mean, the decode step plus those q, in every step (share 1)
        q, pre = prefill_first_steps(m, chip, cfg, eff, w, prompts_per_step)
        # one output token: the prompt step yields it and no request decodes (session 23, QA finding: a phantom
        # decode step per prompt step took TTFT 70% past Little's law)
        dec = pure if w.output_len > 1 else StepCost(0.0, {k: 0.0 for k in pure.parts}, pure.bound)
        parts = {k: dec.parts.get(k, 0.0) + q * pre.parts.get(k, 0.0) for k in dec.parts.keys() | pre.parts.keys()}
        return 1.0, StepCost(dec.time_s + q * pre.time_s, parts, max(parts, key=parts.get)), pure, (q, pre)
    carried = max(prompt_chunk(cfg, chip, w.input_len, prefill_room(cfg, chip, batch)), mean_tokens)
    share = mean_tokens / carried
    step = step_cost(m, chip, cfg, eff, batch, w.mean_decode_context, carried, w.input_len / 2.0, batch,
                     prefill_seqs=prompts_per_step / share)
    return share, step, pure, None


def prefill_first_steps(m: ModelConfig, chip: Chip, cfg: ServeConfig, eff: Efficiency, w: Workload,
                        prompts_per_step: float) -> tuple[float, StepCost]:
    """(prompt-only steps per decode step, such a step) of an engine that prefills waiting prompts first, in steps of
    their own (config.mixes_prompts False; SGLang get_next_batch_to_run): after a decode step in which prompts
    arrived, the next step prefills them, as many as the step budget holds (several short prompts together, a long
    one in chunks). With P = prompts_per_step x prompt tokens arriving per decode step, a prompt step carries
    max(one prompt's chunk, min(P, budget)) tokens and q = P / that many run per decode step (q < 1: some decode
    steps have no prompt after them)."""
    prompt = prefill_len(cfg, chip, w.input_len)
    mean_tokens = prompts_per_step * prompt
    if mean_tokens <= 0:
        return 0.0, decode_step(m, chip, cfg, eff, 0.0, 0.0)
    room = prefill_room(cfg, chip, 0)  # one prompt's room: one rank's under attention DP
    # the step holds a room per attention-DP rank (the simulator's prompt-only step alike; session 23, QA finding:
    # one rank's room made attention-DP TPOT 15% high)
    carried = max(prompt_chunk(cfg, chip, prompt, room), min(mean_tokens, float(room * cfg.attention_dp_size)))
    n = max(carried / prompt, 1.0)  # prompts (or chunks) in such a step
    return mean_tokens / carried, step_cost(m, chip, cfg, eff, 0.0, 0.0, carried, prompt / 2.0, n, prefill_seqs=n)


def slot_turnover_steps(cfg: ServeConfig, chip: Chip, w: Workload, batch: int) -> int:
    """Steps one request holds a slot of the batch: its prompt's chunk steps (the last one yields the first token),
    its O - 1 decode steps, and one more on an engine one step ahead (it reuses a freed slot a step later:
    scheduler_wait_s). O steps for a prompt that fits one step; a prompt longer than the step budget holds its slot
    for its extra chunks without a token (Sarathi-Serve chunked prefill, Agrawal et al. OSDI'24), which is what keeps
    throughput x time in the system = sequences in the batch (Little's law) for long prompts."""
    prompt, _, chunks = prompt_chunks(cfg, chip, w, max(batch - 1, 0))
    first_decode = int(prompt < w.input_len)  # the first token from a decode step (engine_first_token_decode_step)
    return w.output_len + max(chunks, 1) - 1 + first_decode + int(schedules_ahead(cfg, chip))


def budget_batch_limit(cfg: ServeConfig, chip: Chip, w: Workload, batch: int) -> int:
    """The most of `batch` sequences that can decode at once in steady state within the engine's step token budget.
    Each step carries its b decode tokens and the prompt tokens of the requests that replace the finishing ones,
    b x P / turnover (P the prefilled prompt, turnover = slot_turnover_steps), and a step holds no more tokens than
    the replica's budget (replica_token_budget): b + b x P / turnover <= budget, the conservation that trtllm-bench
    sizes its own max_num_tokens by (max_batch_size x (1 + ISL / OSL): tensorrt_llm/bench/build/tuning.py
    finetune_setting). An engine that does not chunk prompts fits only whole prompts beside the decodes, at least one
    per step (prompt_chunk). Past this limit the other sequences wait for their prefill: TTFT grows, output tokens/s
    does not (Sarathi-Serve, Agrawal et al. OSDI'24 §4.2: the budget bounds each step's tokens)."""
    prompt = prefill_len(cfg, chip, w.input_len)
    if not mixes_prompts(cfg, chip):
        # prefill first: prompts run in steps of their own, as many as they need; the decode step holds the batch
        return batch
    dp = cfg.attention_dp_size
    budget_per_rank = replica_token_budget(chip, cfg) / dp
    chunks = chunked_prefill(cfg, chip)

    def sustained(b: int) -> bool:
        need = b * prompt / slot_turnover_steps(cfg, chip, w, b)
        room = budget_per_rank - b / dp  # prompt tokens a rank's step has beside its share of the decodes
        cap = max(room, 0.0) if chunks else max(math.floor(room / prompt), 1) * prompt
        return need <= cap * dp

    if prompt <= 0 or sustained(batch):
        return batch
    lo, hi = 1, batch  # sustained(lo) assumed (one sequence's prompt per turnover), sustained(hi) false
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if sustained(mid) else (lo, mid)
    return lo


def first_round_ttft_s(m: ModelConfig, chip: Chip, cfg: ServeConfig, eff: Efficiency, w: Workload,
                       requests: int) -> float:
    """Mean engine TTFT (no server path) of a closed loop's first round on one replica: `requests` prompts reach the
    idle engine together at t = 0 (vLLM bench serve, aiperf and genai-perf start all their clients at once) and queue
    FCFS for the step token budget (Sarathi-Serve, Agrawal et al. OSDI'24 §4.2). A prompt step has room for the
    budget less the decodes of the prompts already done (prefill_room; none in an engine that prefills first:
    config.mixes_prompts), taken in chunks or in whole prompts (at least one a step: config.prompt_chunk), on each
    attention-DP rank for its own share of the prompts; a pipeline runs up to pp prompts' chunks as its micro-batches.
    Every step but the round's last is full and costs a full step beside the round's mean decodes; the last holds the
    tokens left. The simulator runs the same round step by step (tests/test_serve_first_round.py holds the two
    together)."""
    prompt = max(prefill_len(cfg, chip, w.input_len), 1)
    ranks = min(cfg.attention_dp_size, requests)  # each rank prefills its round-robin share within its own room
    queue = math.ceil(requests / ranks)
    mixes = mixes_prompts(cfg, chip) and w.output_len > 1
    whole = not chunked_prefill(cfg, chip)  # an engine that does not chunk takes whole prompts

    def taken(done: int) -> int:  # prompt tokens a step takes on one rank once `done` of its prompts are prefilled
        room = prefill_room(cfg, chip, done * ranks if mixes else 0)
        return min(max(room // prompt, 1), queue - done) * prompt if whole else room

    ends: list[int] = []  # the step each of the rank's prompts ends its prefill in
    step_no = prefilled = last_tokens = 0
    while len(ends) < queue:
        done = len(ends)
        took = taken(done)
        # the steps that end no prompt, then the one that ends the next
        skip = 0 if whole else max(math.ceil(((done + 1) * prompt - prefilled) / took) - 1, 0)
        before = prefilled + skip * took
        step_no, prefilled = step_no + skip + 1, before + took
        ends += [step_no] * (min(queue, prefilled // prompt) - done)
        last_tokens = min(prefilled, queue * prompt) - before
    # the decodes beside a step, mean over the round's steps: prompt i decodes in the steps after its own
    riders = ranks * sum(ends[-1] - k for k in ends) / ends[-1] if mixes else 0.0

    def step_s(tokens: int) -> float:  # a step of `tokens` prompt tokens on each rank beside the round's mean decodes
        chunks = max(tokens / prompt, min(float(cfg.pp), float(queue)), 1.0) * ranks
        return step_cost(m, chip, cfg, eff, riders, w.input_len, tokens * ranks, prompt / 2.0, riders + chunks,
                         chunks).time_s

    room = prefill_room(cfg, chip, riders)  # a full step's room beside the round's mean decodes
    full_s = step_s(min(max(room // prompt, 1), queue) * prompt if whole else min(room, queue * prompt))
    last_s = step_s(last_tokens) if ends[-1] > 1 else full_s
    ttft = sum((k - 1) * full_s + (full_s if k < ends[-1] else last_s) for k in ends) / queue
    if prompt < w.input_len:
        # the first token from the decode step after the prefill (prefill_len): the next prompt step where one follows,
        # else a decode step of the round
        after = sum(k < ends[-1] for k in ends)
        ttft += (after * full_s + (queue - after) * decode_step(m, chip, cfg, eff, requests, w.input_len).time_s) / queue
    return ttft


def in_phase_ttft_s(m: ModelConfig, chip: Chip, cfg: ServeConfig, eff: Efficiency, w: Workload, clients: int,
                    arrival_delay_s: float = 0.0) -> float | None:
    """Mean engine TTFT (no server path) of a closed loop of `clients` equal requests on one replica, every one
    admitted, whose rounds stay in phase: an engine that schedules whole prompts (config.chunked_prefill False:
    TensorRT-LLM's default) takes the clients' prompts in groups of as many as a step has room for beside the other
    clients' decodes (prefill_room); the members of a group end their last decode in the same step, send their next
    requests together and are prefilled together again, one group per step, every round (a group's round: its prompt
    step, O - 1 decode steps and the steps it waits). A group's TTFT is its wait for the steps the engine picked
    before the requests arrived (scheduler_wait_s; one more for an engine that schedules a step ahead:
    config.schedules_ahead; none when the group is alone and the engine idles) and its own prompt step. None where
    the rounds cannot stay whole: one output token, or more groups than a round has decode steps. The simulator keeps
    the same groups step by step (tests/test_serve_in_phase.py holds the two together); an engine that chunks prompts
    is priced by the spread steady state instead (evaluate)."""
    if w.output_len <= 1:
        return None
    prompt = max(prefill_len(cfg, chip, w.input_len), 1)
    ranks = min(cfg.attention_dp_size, clients)  # each attention-DP rank takes its round-robin share
    queue = math.ceil(clients / ranks)
    mixes = mixes_prompts(cfg, chip)
    # the group size: the most prompts a step has room for beside every other client's decode (each rank its own)
    size = queue
    while size > 1 and size * prompt > prefill_room(cfg, chip, ranks * (queue - size) if mixes else 0):
        size -= 1
    groups = math.ceil(queue / size)
    if groups > w.output_len - 1:
        return None
    sizes = [size] * (groups - 1) + [queue - (groups - 1) * size]

    @functools.cache
    def prompt_step_s(n: int) -> float:  # n prompts on each rank beside the other clients' decodes
        riders = ranks * (queue - n) if mixes else 0.0
        return step_cost(m, chip, cfg, eff, riders, w.mean_decode_context, n * ranks * prompt, prompt / 2.0,
                         riders + n * ranks, n * ranks).time_s

    @functools.cache
    def decode_s(others: int) -> float:  # the others' decode step at the end of their round
        return decode_step(m, chip, cfg, eff, others, w.input_len + w.output_len).time_s if others else 0.0

    steps = [prompt_step_s(n) for n in sizes]  # two distinct group sizes at most: two step costs
    ahead = schedules_ahead(cfg, chip)
    total = 0.0
    for j, n in enumerate(sizes):
        # the steps the engine picked before the group's requests arrived: one (a round of O + 1 steps a group), two for
        # an engine that schedules a step ahead (O + 2). The last before the group's own prompt step is the previous
        # group's prompt step, the one before that the group's before it; where no group is that far back in the
        # round, a decode step of the others. A group alone: the engine idles, no wait.
        others = ranks * (queue - n)
        decode = decode_s(others)
        last = steps[j - 1] if j >= 1 else decode
        if ahead:
            wait = scheduler_wait_s(steps[j - 2] if j >= 2 else decode, others, closed_loop=True,
                                    arrival_delay_s=arrival_delay_s) + (last if others else 0.0)
        else:
            wait = scheduler_wait_s(last, others, closed_loop=True, arrival_delay_s=arrival_delay_s)
        total += n * (wait + steps[j])
    ttft = total / queue
    if prompt < w.input_len:  # the first token from the decode step after the prefill (prefill_len)
        ttft += decode_step(m, chip, cfg, eff, clients, w.mean_decode_context).time_s
    return ttft


def benchmark_mean_ttft_s(steady_s: float, first_round_s: float, first: int, requests: float) -> float:
    """Mean TTFT over a closed-loop benchmark of `requests` requests per replica whose `first` start together (the
    first round, first_round_ttft_s) and the rest at the spread-out ages of the steady state (`steady_s`). Past its
    first round a real closed loop does not stay in step: request lengths, client and server jitter spread the
    clients' phases (aiconfigurator's deployment guide sends concurrency x 10 requests "to reduce the impact of first
    batch of requests", ai-dynamo/aiconfigurator docs/dynamo_deployment_guide.md), so only that round is counted
    apart: the mean weighs it by first / requests."""
    n = max(float(requests), float(first))
    return (first * first_round_s + (n - first) * steady_s) / n


def _continuous(m, chip, cfg, eff, w, batch, closed_loop=False, clients=None):
    # steady state: each of the B slots takes a new request every `turnover` steps (slot_turnover_steps), each with its
    # prompt (mean_step_s); a request's own inter-token gaps carry the prompts of the other B-1 sequences (its own
    # prompt is its TTFT)
    turnover = slot_turnover_steps(cfg, chip, w, batch)
    share, chunk_step, pure, first = _prompt_steps(m, chip, cfg, eff, w, batch, batch / turnover)
    mixed = _mix(share, chunk_step, pure)
    step_s = mixed.time_s
    requests_per_s = batch / (turnover * step_s)
    # clients beyond the batch limit wait for a slot (Little's law at the engine's request throughput)
    queue = admission_queue_wait_s(clients, batch, requests_per_s) if clients is not None and clients > batch else None
    # in steady state each of the other B-1 sequences is replaced every `turnover` steps: their prompts arrive at
    # (B-1) / (turnover * step) per second and queue ahead of a new one (a single client never waits behind itself)
    engine_step_s = step_s  # one engine step, which the scheduler's waits are counted in
    prompt_work = None
    if mixes_prompts(cfg, chip):
        residual = step_residual_s(share, chunk_step.time_s, pure.time_s)
    else:  # q prompt-only steps per decode step: a share q / (1 + q) of the steps are prompt steps (all of them
        # when no request decodes: one output token); step_s spans the decode step and its q prompt steps
        q, pre = first or prefill_first_steps(m, chip, cfg, eff, w, batch / turnover)
        prompt_share = q / (1.0 + q) if w.output_len > 1 else 1.0
        residual = step_residual_s(prompt_share, pre.time_s, pure.time_s)
        engine_step_s = prompt_share * pre.time_s + (1.0 - prompt_share) * pure.time_s
        # a prompt's share of the prompt steps: q of them carry the batch / turnover prompts of a decode step
        prompt_work = q * pre.time_s / (batch / turnover)
    ttft = ttft_continuous(m, chip, cfg, eff, w, batch, engine_step_s, max(batch - 1, 0) / (turnover * step_s),
                           closed_loop, queue, residual, pure, prompt_work)
    frac = max(step_s - pure.time_s, 0.0) / step_s
    # with one output token no request sees a second token: TPOT is then what one more decode step would take, not
    # the mixed step that prefills B whole prompts (issue #18: 16 s "TPOT" beside a 0.16 s end-to-end latency)
    tpot = mean_step_s(m, chip, cfg, eff, w, batch, (batch - 1) / turnover, pure).time_s \
        if w.output_len > 1 else pure.time_s
    return ttft, tpot, requests_per_s * w.output_len, frac, mixed, queue or 0.0


def _static(m, chip, cfg, eff, w, batch, closed_loop=False, clients=None):  # one batch from t = 0
    # an engine whose first token comes from a decode step (engine_first_token_decode_step, LMDeploy TurboMind)
    # prefills input_len - 1 tokens and runs output_len decode steps; the others sample the first token in the prefill
    prompt = prefill_len(cfg, chip, w.input_len)
    first_decode = prompt < w.input_len
    pre = prefill_step(m, chip, cfg, eff, batch, prompt)
    dec = decode_step(m, chip, cfg, eff, batch, w.mean_decode_context)
    n_decode = w.output_len if first_decode else w.output_len - 1
    e2e = pre.time_s + n_decode * dec.time_s
    ttft = pre.time_s + (dec.time_s if first_decode else 0.0)
    # the cost split charges generation at least one decode step: with --output-len 1 the one output token (its LM
    # head and sampling) is not free (issue #18: $0.00 per million output tokens)
    frac = pre.time_s / (pre.time_s + max(n_decode, 1) * dec.time_s)
    # the clients beyond the batch wait for whole batches to end
    queue = admission_queue_wait_s(clients, batch, batch / e2e) if clients is not None and clients > batch else 0.0
    return ttft + queue, dec.time_s, batch * w.output_len / e2e, frac, dec, queue


def evaluate(m: ModelConfig, chip: Chip, n_chips: int, cfg: ServeConfig, eff: Efficiency, w: Workload,
             batch: int, mode: str = "continuous", closed_loop: bool = False,
             clients: int | None = None, requests: int | None = None) -> ServePoint:
    """Metrics of `batch` sequences per replica on every replica of the deployment. `closed_loop`: the batch is held
    by that many clients, each sending its next request when the previous one ends (benchmark concurrency), which
    changes when a new request can join a step (scheduler_wait_s). `clients`: a closed loop of that many clients
    over the whole deployment (clients // replicas on each, as simulate spreads them); `batch` is then the engine's
    limit per replica and each replica runs min(batch, clients / replicas) sequences, the other clients waiting
    for a slot (admission_queue_wait_s). `requests`: the closed loop is a benchmark of that many requests in all, the
    first of them sent together: the mean TTFT then counts that first round apart (benchmark_mean_ttft_s); None
    (default) is the steady state alone, a loop that runs on."""
    if mode not in MODES:
        raise MeshplanError(f"unknown batching mode '{mode}' (known: {', '.join(MODES)})")
    if batch <= 0:
        raise MeshplanError(f"batch must be positive, got {batch}")
    if clients is not None and clients <= 0:
        raise MeshplanError(f"clients must be positive, got {clients}")
    if requests is not None and (clients is None or requests <= 0):
        raise MeshplanError(f"a benchmark's request count needs a positive count and a closed loop of clients "
                            f"(got requests={requests}, clients={clients})")
    replicas = n_chips // cfg.chips_per_replica
    per_replica_clients = clients_per_replica(n_chips, cfg, clients)
    if per_replica_clients is not None:
        batch, closed_loop = min(batch, per_replica_clients), True
    # continuous batching: the step token budget bounds the sequences that decode at once (budget_batch_limit); the
    # others of the batch (or of the closed loop's clients) wait for a slot to take their prompt (admission_queue_wait_s)
    running, waiting = batch, per_replica_clients
    if mode == "continuous":
        running = budget_batch_limit(cfg, chip, w, batch)
        if running < batch:
            waiting = max(per_replica_clients or batch, batch)
    ttft, tpot, per_replica, frac, step, queue = (_continuous if mode == "continuous" else _static)(
        m, chip, cfg, eff, w, running, closed_loop, waiting)
    in_phase = None if per_replica_clients is None else False
    spread = None  # the steady state's TTFT where the rounds are priced in phase: the other bound (clients' phases spread)
    if mode == "continuous" and per_replica_clients is not None and per_replica_clients <= running \
            and not chunked_prefill(cfg, chip):
        # a closed loop of equal requests on an engine that takes whole prompts keeps its rounds in phase: the
        # clients' prompts arrive in groups, not spread over the steps (in_phase_ttft_s); TPOT and throughput carry
        # the same prompt work either way
        grouped = in_phase_ttft_s(m, chip, cfg, eff, w, per_replica_clients)
        if grouped is not None:
            ttft, in_phase, spread = grouped, True, ttft
    # the client's TTFT also counts the first token's way through the server (config.frontend_first_token_s); the
    # inter-token gaps do not change (every token takes the same way out)
    frontend_s = frontend_first_token_s(cfg, chip)
    first_round_s = None
    if requests is not None and mode == "continuous":
        # the benchmark's first round: the clients the engine admits at once start together (a static batch already
        # starts together: _static)
        first = min(running, per_replica_clients or running, max(requests // max(replicas, 1), 1))
        round_s = first_round_ttft_s(m, chip, cfg, eff, w, first)
        ttft = benchmark_mean_ttft_s(ttft, round_s, first, requests / max(replicas, 1))
        if spread is not None:
            spread = benchmark_mean_ttft_s(spread, round_s, first, requests / max(replicas, 1))
        first_round_s = round_s + frontend_s
    ttft += frontend_s
    out = replicas * per_replica
    return ServePoint(
        config=cfg, mode=mode, batch=batch, replicas=replicas, n_chips=n_chips, ttft_s=ttft, tpot_s=tpot,
        e2e_latency_s=ttft + (w.output_len - 1) * tpot, throughput_tokens_per_s=out,
        input_tokens_per_s=out * w.input_len / w.output_len, input_time_fraction=frac,
        memory=memory_per_chip(m, chip, cfg, eff, batch, kv_reserved_per_sequence(cfg, chip, w)), step=step,
        price_per_chip_hour=chip.price_per_chip_hour, queue_wait_s=queue, running_batch=running,
        first_round_ttft_s=first_round_s, rounds_in_phase=in_phase,
        spread_ttft_s=None if spread is None else spread + frontend_s)
