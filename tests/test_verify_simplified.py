"""`verify` says which parts of a model its JAX reference leaves out (session 21, QA finding: a Mistral config with a
64-token sliding window compiled as full attention, and the report said "match" with no word of it)."""

from __future__ import annotations

from meshplan.measure.verify import reference_model, reference_simplifications
from meshplan.specs.model import load_model


def test_a_llama_is_built_as_it_is():
    assert reference_simplifications(load_model("llama3-8b")) == []


def test_what_the_reference_leaves_out_is_named():
    oss = reference_simplifications(load_model("gpt-oss-120b"))  # alternate 128-token windows, sinks, biases
    assert any("sliding-window" in s for s in oss) and "attention sinks" in oss
    ds = reference_simplifications(load_model("deepseek-v3"))  # 1 shared expert, 3 leading dense layers
    assert any("shared experts" in s for s in ds) and any("leading dense" in s for s in ds)
    # the reference itself has nothing left to leave out
    assert reference_simplifications(reference_model(load_model("gpt-oss-120b"))) == []
