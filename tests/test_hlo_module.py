"""measure/hlo.py and verify's compiled side on hand-written HLO (pure Python, no JAX): a loop body counts once per
iteration, and `measure_compiled` parses the module's text once for both the collectives and the dots.

Mesh (data=4, stage=2), device id = 2·data + stage: the groups {0,2,4,6}, {1,3,5,7} span `data`.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from meshplan.measure import hlo
from meshplan.measure.hlo import dot_flops, parse_collectives, read_module

# A reduce-scatter and a dot inside a while body with known_trip_count 3 (a `lax.scan` over 3 micro-batches)
LOOP_HLO = """HloModule m
%body (t: (s32[], f32[8,8])) -> (s32[], f32[8,8]) {
  %t = (s32[], f32[8,8]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %x = f32[8,8]{1,0} get-tuple-element(%t), index=1
  %a = f32[2,4]{1,0} parameter(1)
  %b = f32[4,8]{1,0} parameter(2)
  %d = f32[2,8]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %rs = f32[2,8]{1,0} reduce-scatter(%x), channel_id=1, replica_groups=[2,4]<=[4,2]T(1,0), dimensions={0}
  ROOT %out = (s32[], f32[8,8]{1,0}) tuple(%i, %x)
}
%cond (c: (s32[], f32[8,8])) -> pred[] {
  %c = (s32[], f32[8,8]{1,0}) parameter(0)
  ROOT %p = pred[] constant(true)
}
ENTRY %main (p: f32[8,8]) -> (s32[], f32[8,8]) {
  %p = f32[8,8]{1,0} parameter(0)
  %z = s32[] constant(0)
  %init = (s32[], f32[8,8]{1,0}) tuple(%z, %p)
  ROOT %w = (s32[], f32[8,8]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
}
"""
COORDS = {2 * d + s: (d, s) for d in range(4) for s in range(2)}
# by hand: the reduce-scatter counts its operand, f32[2,8] × 4 devices = 4·16·4 = 256 B a run, 3 runs = 768 B;
# the dot [2,8] = [2,4]·[4,8] is 2 × 16 × 4 = 128 FLOPs a run, 384 a step
LOOP_RS_BYTES, LOOP_DOT_FLOPS = 768.0, 384.0


def test_hlo_counts_a_loop_body_once_per_iteration():
    for module in (LOOP_HLO, read_module(LOOP_HLO)):  # the text, or the module parsed once: the same numbers
        (rs,) = parse_collectives(module, COORDS, ("data", "stage"))
        assert rs.kind == "reduce-scatter" and rs.axes == ("data",) and rs.bytes == LOOP_RS_BYTES
        assert dot_flops(module) == LOOP_DOT_FLOPS


def test_measure_compiled_parses_the_hlo_once(monkeypatch):
    """verify's compiled side reads the collectives and the dot FLOPs from one parse of `compiled.as_text()`. The
    compiled program and its mesh are stand-ins with the attributes `measure_compiled` reads (no JAX)."""
    from meshplan.measure.verify import measure_compiled

    parses = []
    real = hlo.parse_module
    monkeypatch.setattr(hlo, "parse_module", lambda text: parses.append(text) or real(text))
    devices = np.empty((4, 2), dtype=object)
    for (d, s), _ in np.ndenumerate(devices):
        devices[d, s] = SimpleNamespace(id=2 * d + s)
    mesh = SimpleNamespace(devices=devices, axis_names=("data", "stage"))
    memory = SimpleNamespace(argument_size_in_bytes=256, output_size_in_bytes=256, alias_size_in_bytes=256,
                             temp_size_in_bytes=64)
    compiled = SimpleNamespace(as_text=lambda: LOOP_HLO, cost_analysis=lambda: {"flops": 400.0},
                               memory_analysis=lambda: memory)
    out = measure_compiled(SimpleNamespace(mesh=mesh), compiled)
    assert len(parses) == 1
    assert out["matmul flops"] == LOOP_DOT_FLOPS and out["reduce-scatter bytes"] == LOOP_RS_BYTES
    assert out["reduce_scatter/data bytes"] == LOOP_RS_BYTES
    assert out["memory"] == 256 + 256 - 256 + 64  # arguments + outputs − aliased + temp
