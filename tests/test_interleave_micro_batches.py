"""An interleaved pipeline needs at least pp micro-batches per step (session 21, QA finding): with one micro-batch on 8
stages, vpp 4 was timed at 215 ms against 551 ms without interleaving, although the micro-batch's 32 chunks run one
after another (8 x 64 ms at least), and `verify` refused the same plan."""

from __future__ import annotations

import json

from conftest import run_cli


def test_pinned_interleaving_with_too_few_micro_batches_is_refused(capsys):
    code, _, err = run_cli(["train", "--model", "llama3-8b", "--hardware", "h100-sxm", "--chips", "8", "--seq-len",
                            "4096", "--global-batch", "1", "--pp", "8", "--microbatch", "1", "--vpp", "4"], capsys)
    assert code == 2 and err.startswith("error:") and "at least pp micro-batches" in err


def test_the_search_never_interleaves_fewer_micro_batches_than_stages(capsys):
    code, out, _ = run_cli(["train", "--model", "llama3.2-1b", "--hardware", "h100-sxm", "--chips", "8", "--seq-len",
                            "128", "--global-batch", "16", "--top", "20", "--json"], capsys)
    assert code == 0
    for p in json.loads(out)["plans"]:
        c = p["config"]
        if c["vpp"] > 1:
            micro_batches = 16 // (c["dp"] * c["fsdp"] * c["microbatch"])
            assert micro_batches >= c["pp"], c
