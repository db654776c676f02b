"""Session 23: SGLang prefills waiting prompts first, in steps of their own (server_args enable_mixed_chunk = False;
scheduler get_next_batch_to_run: 'Run prefill first if possible', else decode); the other engines carry the
decodes beside the prompts. Expected values derived by hand below."""

from __future__ import annotations

import pytest

from meshplan.cost.efficiency import default_efficiency
from meshplan.infer.config import ServeConfig, Workload, mixes_prompts
from meshplan.infer.metrics import evaluate, prefill_first_steps, slot_turnover_steps
from meshplan.infer.simulate import _Replica, _Req
from meshplan.infer.step import decode_step, step_cost
from meshplan.specs.hardware import load_chip
from meshplan.specs.model import load_model

H100 = load_chip("h100-sxm")
EFF = default_efficiency(H100)
M8 = load_model("llama3.1-8b")


def _two_requests(cfg: ServeConfig) -> tuple[_Req, _Req]:
    """Every step 1 s; r0 at t = 0 and r1 at t = 0.5, 1-token prompts, 3 output tokens each (the first from the
    prompt's step)."""
    r0, r1 = _Req(0.0, 1, 3), _Req(0.5, 1, 3)
    rep = _Replica(M8, H100, cfg, EFF, 8)
    rep._cost = lambda *args, **kwargs: 1.0
    rep.run([r0, r1])
    return r0, r1


def test_engines_that_mix_and_sglang_that_does_not():
    assert not mixes_prompts(ServeConfig(engine="sglang"), H100)
    assert not mixes_prompts(ServeConfig(engine="sglang@0.3"), H100)
    assert all(mixes_prompts(ServeConfig(engine=e), H100) for e in ("vllm", "trtllm", "lmdeploy", "default"))


def test_a_prompt_step_carries_no_decodes_on_a_prefill_first_engine():
    # serial engines. r0's prompt runs in [0, 1] (first token at 1); r1 arrived at 0.5 and its prompt runs in [1, 2]:
    # a mixing engine decodes r0 in that step too (tokens at 1, 2, 3), SGLang does not (tokens at 1, 3, 4)
    mixed0, mixed1 = _two_requests(ServeConfig(engine="vllm", overlap_scheduling=False))
    assert mixed0.times == [1.0, 2.0, 3.0] and mixed1.times == [2.0, 3.0, 4.0]
    first0, first1 = _two_requests(ServeConfig(engine="sglang", overlap_scheduling=False))
    assert first0.times == [1.0, 3.0, 4.0] and first1.times == [2.0, 3.0, 4.0]


def test_prompt_steps_per_decode_step_by_hand():
    cfg = ServeConfig(engine="sglang", max_num_batched_tokens=2048)
    w = Workload(1000, 200)
    # 0.08 prompts per decode step: 80 prompt tokens, one 1000-token prompt per prompt step, q = 80 / 1000
    q, pre = prefill_first_steps(M8, H100, cfg, EFF, w, 0.08)
    assert q == pytest.approx(0.08)
    assert pre.time_s == pytest.approx(step_cost(M8, H100, cfg, EFF, 0, 0, 1000, 500, 1, prefill_seqs=1).time_s)
    # 3 prompts per decode step: 3000 tokens, steps of the whole 2048-token budget, q = 3000 / 2048
    q, pre = prefill_first_steps(M8, H100, cfg, EFF, w, 3.0)
    assert q == pytest.approx(3000 / 2048)
    assert pre.time_s == pytest.approx(step_cost(M8, H100, cfg, EFF, 0, 0, 2048, 500, 2.048,
                                                 prefill_seqs=2.048).time_s)


def test_closed_form_tpot_is_the_decode_step_plus_its_share_of_prompt_steps():
    # batch 16, 1000/200: a request's gaps carry the prompts of the other 15, 15 / turnover per decode step
    cfg = ServeConfig(engine="sglang", max_num_batched_tokens=2048)
    w = Workload(1000, 200)
    turnover = slot_turnover_steps(cfg, H100, w, 16)
    q, pre = prefill_first_steps(M8, H100, cfg, EFF, w, 15 / turnover)
    dec = decode_step(M8, H100, cfg, EFF, 16, w.mean_decode_context)
    p = evaluate(M8, H100, 1, cfg, EFF, w, 16)
    assert p.tpot_s == pytest.approx(dec.time_s + q * pre.time_s)
    # the same batch on a mixing engine: its prompt steps also decode, so its TPOT is lower
    assert evaluate(M8, H100, 1, ServeConfig(engine="vllm", max_num_batched_tokens=2048), EFF, w, 16).tpot_s \
        < p.tpot_s


def test_cli_choice_export_and_read_back(capsys, tmp_path):
    import json

    from conftest import run_cli

    base = ["serve", "-m", "llama3.1-8b", "--hardware", "h100-sxm", "--chips", "1", "--input-len", "1000",
            "--output-len", "200", "--batch", "64", "--json"]
    code, out, err = run_cli(base + ["--engine", "sglang"], capsys)
    first = json.loads(out)
    code, out, err = run_cli(base + ["--engine", "sglang", "--mix-prompts"], capsys)
    mixed = json.loads(out)
    assert first["mixed_prompts"] is False and mixed["mixed_prompts"] is True
    assert mixed["tpot_s"] < first["tpot_s"]  # the prompt steps decode too
    code, out, err = run_cli(base + ["--engine", "vllm", "--prefill-first"], capsys)
    assert code == 2 and err.startswith("error:") and "always runs the decodes beside the prompts" in err
    # SGLang's own flag is written where the plan was timed with it, and read back
    code, out, err = run_cli(base[:-1] + ["--engine", "sglang", "--mix-prompts", "--export", "sglang", "--out",
                                          str(tmp_path)], capsys)
    assert code == 0, err
    script = next(tmp_path.iterdir())
    assert "--enable-mixed-chunk" in script.read_text()
    code, out, err = run_cli(["serve", "--from", str(script), "--hardware", "h100-sxm", "--input-len", "1000",
                              "--output-len", "200", "--json"], capsys)
    assert code == 0, err
    back = json.loads(out)["yours"]
    assert back["mixed_prompts"] is True and back["tpot_s"] == pytest.approx(mixed["tpot_s"])


def test_qa_fixes_attention_dp_tpu_static_and_lmdeploy_message(capsys):
    from conftest import run_cli

    from meshplan.infer.config import check_layout

    # attention DP: a prompt-only step holds one prompt's room per rank, 8192 / 8 = 1024 tokens each, 8192 in all:
    # 5 prompts of 1000 tokens per decode step ride one step of 5000 tokens (q = 1), not five 1024-token steps
    q30 = load_model("qwen3-30b-a3b")
    adp = ServeConfig(engine="sglang", tp=8, ep=8, attention_dp=True, max_num_batched_tokens=8192)
    q, _ = prefill_first_steps(q30, H100, adp, EFF, Workload(1000, 200), 5.0)
    assert q == pytest.approx(1.0)
    # SGLang prefills first on TPUs too (the same ServerArgs default)
    assert not mixes_prompts(ServeConfig(engine="sglang"), load_chip("tpu-v6e"))
    # the flag has nothing to choose under static batching
    code, _, err = run_cli(["serve", "-m", "llama3.1-8b", "--hardware", "h100-sxm", "--chips", "1", "--input-len",
                            "1000", "--output-len", "200", "--batch", "8", "--batching", "static", "--engine", "sglang",
                            "--mix-prompts"], capsys)
    assert code == 2 and "static batching" in err
    with pytest.raises(Exception, match="drop --prefill-first"):
        check_layout(M8, H100, 1, ServeConfig(engine="trtllm", mixed_prompts=False))


def test_simulated_cache_is_memorys_not_the_client_count(capsys):
    import json

    from conftest import run_cli

    # 8 closed-loop clients with drawn output lengths: the cache holds what memory gives (hundreds of sequences), so no
    # request waits for KV and the simulated TTFT is the closed form's (it was 3-8x, the cache sized for 8 sequences)
    code, out, err = run_cli(["serve", "-m", "llama3.1-8b", "--hardware", "h100-sxm", "--chips", "1", "--tp", "1",
                              "--input-len", "1000", "--output-len", "200", "--simulate", "--concurrency", "8",
                              "--output-dist", "uniform", "--requests", "400", "--json"], capsys)
    assert code == 0, err
    d = json.loads(out)
    assert d["simulation"]["ttft_s"]["p50"] == pytest.approx(d["ttft_s"], rel=0.15)


def test_a_prompts_queue_work_is_its_share_of_the_batched_prompt_steps():
    # one output token, batch 64, 1000-token prompts: 32 prompts per decode cycle (turnover 2 on an engine one step
    # ahead) ride q = 32000 / 8192 steps of the 8192-token budget, so a prompt's work in the queue is q x T_step / 32,
    # about an eighth of a step, not a whole 1000-token step of its own
    cfg = ServeConfig(engine="sglang", max_num_batched_tokens=8192)
    w = Workload(1000, 1)
    turnover = slot_turnover_steps(cfg, H100, w, 64)
    assert turnover == 2
    q, pre = prefill_first_steps(M8, H100, cfg, EFF, w, 64 / turnover)
    assert q == pytest.approx(32000 / 8192)
    alone = step_cost(M8, H100, cfg, EFF, 0, 0, 1000, 500, 1, prefill_seqs=1).time_s
    assert q * pre.time_s / 32 < 0.9 * alone  # batching the prompts is what makes the queue shorter
    p = evaluate(M8, H100, 1, cfg, EFF, w, 64)
    little = 64 / p.throughput_tokens_per_s  # one token per request: e2e = in flight / throughput
    assert 0.6 * little < p.ttft_s < 1.1 * little


def test_from_times_the_servers_own_path_and_takes_a_release_of_its_engine(capsys, tmp_path):
    """Session 24 (left in session 23): `serve --from` timed a server command line as an engine in process, with no
    server path, and could not say which release runs it. A `vllm serve` / `sglang.launch_server` command is an HTTP
    server, so its client's TTFT takes that server's path (FRONTEND_ENGINES); --engine names a release of the command's
    engine and nothing else."""
    import json

    from conftest import run_cli

    from meshplan.cli.serve import plan_serving

    script = tmp_path / "serve.sh"
    script.write_text("python -m sglang.launch_server --model-path meta-llama/Llama-3.1-8B --tp-size 1\n")
    args = ["serve", "--from", str(script), "--hardware", "h100-sxm", "--input-len", "1000", "--output-len", "200",
            "--json"]
    code, out, err = run_cli([*args, "--engine", "sglang@0.3"], capsys)
    assert code == 0, err
    yours = json.loads(out)["yours"]
    assert yours["config"]["engine"] == "sglang@0.3" and yours["config"]["frontend"] == "sglang-http"
    same = plan_serving("llama3.1-8b", "h100-sxm", 1, 1000, 200, batch=yours["batch"], tp=1, pp=1, ep=1,
                        engine="sglang@0.3", frontend="sglang-http", kv_quant="bf16", mode="continuous")
    assert yours["ttft_s"] == pytest.approx(same["ttft_s"]) and yours["tpot_s"] == pytest.approx(same["tpot_s"])
    bare = plan_serving("llama3.1-8b", "h100-sxm", 1, 1000, 200, batch=yours["batch"], tp=1, pp=1, ep=1,
                        engine="sglang@0.3", kv_quant="bf16", mode="continuous")
    assert yours["ttft_s"] > bare["ttft_s"]  # the server's path is on the client's first token
    code, _, err = run_cli([*args, "--engine", "vllm"], capsys)
    assert code == 2 and "not a release of sglang" in err and "sglang@0.3" in err
