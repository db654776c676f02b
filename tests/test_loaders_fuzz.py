"""Bad input never escapes as anything but MeshplanError (the CLI turns that into one `error:` line, exit 2).

Hypothesis fuzzes the two mapping loaders (`model_from_hf`, `chip_from_mapping`) with random mappings and
with valid presets whose fields are replaced by random values, and the file loaders with random bytes and
tricky YAML/JSON text. The CLI tests below check the user-facing contract for common mistakes.
"""

from __future__ import annotations

import json
import tempfile
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import run_cli
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from meshplan.cost import roofline as rf
from meshplan.errors import MeshplanError
from meshplan.math import transformer as tm
from meshplan.specs.hardware import HARDWARE_DIR, Chip, chip_from_mapping, load_chip
from meshplan.specs.model import MODELS_DIR, ModelConfig, load_model, model_from_hf

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# --- value strategies ----------------------------------------------------------------------------------

TRICKY_STRINGS = ["", "0", "-1", "1e14", "nan", "inf", "-inf", "1e400", "true", "bf16", "ici_torus", "nvswitch",
                  "llama", "gpt2", "mixtral", "gpt_bigcode", "swiglu", "gelu", "layernorm", "learned", "dcn",
                  "full_axis", "x" * 200, "\x00", "é"]
leaves = st.one_of(
    st.none(), st.booleans(),
    st.integers(min_value=-3, max_value=70_000),
    st.integers(),
    st.integers(min_value=10**300, max_value=10**400),  # beyond float range
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.5, 4096.0, 1e308, -0.0, float("nan"), float("inf")]),
    st.sampled_from(TRICKY_STRINGS), st.text(max_size=12),
)
values = st.recursive(leaves, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
                      max_leaves=8)


def _preset_models() -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted(MODELS_DIR.glob("*.json"))]


def _preset_chips() -> list[dict[str, Any]]:
    return [yaml.safe_load(p.read_text()) for p in sorted(HARDWARE_DIR.glob("*.yaml"))]


MODEL_PRESETS = _preset_models()
CHIP_PRESETS = _preset_chips()
HF_KEYS = sorted({k for cfg in MODEL_PRESETS for k in cfg} | {
    "hidden_size", "n_embd", "d_model", "num_attention_heads", "n_head", "num_hidden_layers", "n_layer",
    "vocab_size", "head_dim", "num_key_value_heads", "n_kv_heads", "intermediate_size", "n_inner",
    "ffn_hidden_size", "moe_intermediate_size", "num_local_experts", "num_experts", "n_routed_experts",
    "num_experts_per_tok", "moe_topk", "shared_expert_intermediate_size", "n_shared_experts", "hidden_act",
    "activation_function", "mlp_act", "tie_word_embeddings", "position", "norm", "linear_bias", "attention_bias",
    "max_position_embeddings", "n_positions", "seq_length", "multi_query", "model_type", "_source", "_name"})


def _paths(node: Any, prefix: tuple = ()) -> list[tuple]:
    """Every key path of a nested mapping (inner nodes included)."""
    out = []
    if isinstance(node, dict):
        for k, v in node.items():
            out.append(prefix + (k,))
            out += _paths(v, prefix + (k,))
    return out


def _set(node: dict, path: tuple, value: Any, delete: bool) -> None:
    for k in path[:-1]:
        node = node[k]
    if delete:
        node.pop(path[-1], None)
    else:
        node[path[-1]] = value


def _only_meshplan_errors(fn, *args) -> Any:
    try:
        return fn(*args)
    except MeshplanError:
        return None


def _use_model(m: ModelConfig | None) -> None:
    """What `meshplan model` does with a loaded config must not fail either."""
    event("rejected" if m is None else "loaded")
    if m is not None:
        pc = tm.param_counts(m)
        assert pc.total > 0
        assert tm.flops_per_token(m).training > 0
        tm.kv_cache_bytes_per_token(m, "int8")
        tm.activation_bytes_per_layer(m, 2048, 1, "none", tp=8)
        for policy in tm.RECOMPUTE_POLICIES:
            tm.recompute_flops_per_token(m, 2048, policy)
        rf.layer_ops(m, 4096, 2048)


def _use_chip(c: Chip | None) -> None:
    """What `meshplan hardware` / `roofline` do with a loaded chip must not fail either."""
    event("rejected" if c is None else "loaded")
    if c is not None:
        c.as_dict()
        c.critical_intensity()
        assert c.links.fast_domain_size >= 1 and c.links.fast_bandwidth_bytes_per_s >= 0
        rf.roofline(rf.matmul(4096, 8192, 8192), c)


# --- model_from_hf -------------------------------------------------------------------------------------

@FUZZ
@given(st.dictionaries(st.one_of(st.sampled_from(HF_KEYS), st.text(max_size=8)), values, max_size=12))
def test_model_from_hf_random_mapping(cfg: dict) -> None:
    m = _only_meshplan_errors(model_from_hf, cfg, "fuzz", "fuzz config")
    assert m is None or isinstance(m, ModelConfig)
    _use_model(m)


@FUZZ
@given(st.sampled_from(MODEL_PRESETS), st.lists(st.tuples(st.sampled_from(HF_KEYS), values, st.booleans()),
                                                min_size=1, max_size=4))
def test_model_from_hf_mutated_preset(preset: dict, edits: list) -> None:
    cfg = json.loads(json.dumps(preset))
    for key, value, delete in edits:
        _set(cfg, (key,), value, delete)
    m = _only_meshplan_errors(model_from_hf, cfg, "fuzz", "fuzz config")
    assert m is None or isinstance(m, ModelConfig)
    _use_model(m)


# --- chip_from_mapping ---------------------------------------------------------------------------------

@FUZZ
@given(st.dictionaries(st.text(max_size=10), values, max_size=8))
def test_chip_from_mapping_random_mapping(data: dict) -> None:
    c = _only_meshplan_errors(chip_from_mapping, data, "fuzz")
    assert c is None or isinstance(c, Chip)
    _use_chip(c)


@FUZZ
@given(st.sampled_from(CHIP_PRESETS), st.data())
def test_chip_from_mapping_mutated_preset(preset: dict, data) -> None:
    chip = json.loads(json.dumps(preset))
    paths = _paths(chip)
    for _ in range(data.draw(st.integers(1, 4))):
        path = data.draw(st.sampled_from(paths))
        try:
            _set(chip, path, data.draw(values), data.draw(st.booleans()))
        except (KeyError, TypeError, AttributeError):  # an earlier edit removed or replaced a parent
            continue
    c = _only_meshplan_errors(chip_from_mapping, chip, "fuzz")
    assert c is None or isinstance(c, Chip)
    _use_chip(c)


# --- the file loaders ----------------------------------------------------------------------------------

TRICKY_TEXT = [
    "", "{", "[1, 2]", "null", "42", "a: &x [*x]", "!!binary zz", "2001-13-45: 1", "? [1]\n: 2",
    "a: !!python/object:os.system x", "{\"hidden_size\": NaN}", "{\"hidden_size\": Infinity}",
    "{\"hidden_size\": 1" + "0" * 5000 + "}", "[" * 5000, "name: x\npeak_flops_per_s: {bf16: .inf}",
    "name: x\nkind: tpu\npeak_flops_per_s: {bf16: 1e14}\nlinks: {fast_domain: ici_torus}",
    "\ufeff{}", "a: 1\n\tb: 2", "%YAML 9.9\n---\na: 1",
]
file_bodies = st.one_of(st.binary(max_size=400), st.sampled_from(TRICKY_TEXT).map(str.encode),
                        st.text(max_size=200).map(lambda s: s.encode("utf-8", "surrogatepass")))


_SCRATCH = tempfile.TemporaryDirectory(prefix="meshplan-fuzz-")  # removed when the session ends


def _write(body: bytes, suffix: str) -> str:
    p = Path(_SCRATCH.name) / f"{uuid.uuid4().hex}{suffix}"  # a fresh name every time: the loaders cache by path
    p.write_bytes(body)
    return str(p)


@FUZZ
@given(file_bodies, st.sampled_from([".json", ".yaml", ".yml"]))
def test_load_model_random_file(body: bytes, suffix: str) -> None:
    m = _only_meshplan_errors(load_model, _write(body, suffix))
    assert m is None or isinstance(m, ModelConfig)
    _use_model(m)


@FUZZ
@given(file_bodies, st.sampled_from([".yaml", ".yml", ".json"]))
def test_load_chip_random_file(body: bytes, suffix: str) -> None:
    c = _only_meshplan_errors(load_chip, _write(body, suffix))
    assert c is None or isinstance(c, Chip)
    _use_chip(c)


@pytest.mark.parametrize("text", TRICKY_TEXT)
def test_tricky_text_in_both_loaders(text: str) -> None:
    for suffix in (".json", ".yaml"):
        _only_meshplan_errors(load_model, _write(text.encode(), suffix))
        _only_meshplan_errors(load_chip, _write(text.encode(), suffix))


# --- the CLI contract for bad input --------------------------------------------------------------------

def _one_error_line(code: int, err: str) -> str:
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("error:")
    assert "Traceback" not in err
    return lines[0]


def test_unknown_model_suggests_close_names(capsys) -> None:
    code, out, err = run_cli(["model", "llama3-7b"], capsys)
    line = _one_error_line(code, err)
    assert "llama3-8b" in line
    assert out == ""


def test_unknown_hardware_suggests_close_names(capsys) -> None:
    code, _, err = run_cli(["hardware", "h100"], capsys)
    assert "h100-sxm" in _one_error_line(code, err)


def test_malformed_json_model_config(tmp_path, capsys) -> None:
    p = tmp_path / "config.json"
    p.write_text('{"hidden_size": 4096, "num_attention_heads": ')
    code, _, err = run_cli(["model", str(p)], capsys)
    assert "malformed" in _one_error_line(code, err)


def test_malformed_yaml_hardware(tmp_path, capsys) -> None:
    p = tmp_path / "chip.yaml"
    p.write_text("name: [unclosed\nkind: tpu\n  - oops: {\n")
    code, _, err = run_cli(["hardware", str(p)], capsys)
    assert "malformed" in _one_error_line(code, err)


def test_missing_config_file(tmp_path, capsys) -> None:
    code, _, err = run_cli(["model", str(tmp_path / "nope.json")], capsys)
    assert "does not exist" in _one_error_line(code, err)


BASE_HF = {"model_type": "llama", "hidden_size": 4096, "num_attention_heads": 32, "num_hidden_layers": 4,
           "vocab_size": 32000, "intermediate_size": 11008}


@pytest.mark.parametrize(("change", "needle"), [
    ({"num_attention_heads": 30}, "divide"),  # 30 heads do not divide 4096 and no head_dim is given
    ({"hidden_size": 0}, "positive"),
    ({"num_hidden_layers": -2}, "positive"),
    ({"vocab_size": -1}, "positive"),
    ({"intermediate_size": 0}, "positive"),
    ({"num_key_value_heads": 7}, "divisible"),
    ({"hidden_size": 4096.5}, "integer"),
    ({"hidden_size": "big"}, "integer"),
    ({"num_hidden_layers": 10**40}, "implausibly large"),
])
def test_bad_model_config(tmp_path, capsys, change: dict, needle: str) -> None:
    p = tmp_path / "config.json"
    p.write_text(json.dumps({**BASE_HF, **change}))
    code, _, err = run_cli(["model", str(p)], capsys)
    assert needle in _one_error_line(code, err)


@pytest.mark.parametrize(("path", "value"), [
    (("hbm_bytes",), 0),
    (("hbm_bytes",), -16e9),
    (("hbm_bandwidth_bytes_per_s",), {"value": 0, "source": "x"}),
    (("peak_flops_per_s", "bf16"), {"value": -1.0, "source": "x"}),
    (("links", "ici_links_per_chip"), 0),
    (("links", "max_slice_shape"), [16, 0]),
    (("price_per_chip_hour",), "free"),
    (("hbm_bytes",), None),
    (("links", "max_slice_shape"), {"value": None, "source": "x"}),
])
def test_bad_hardware_yaml(tmp_path, capsys, path: tuple, value: Any) -> None:
    data = yaml.safe_load((HARDWARE_DIR / "tpu-v5e.yaml").read_text())
    _set(data, path, value, delete=False)
    p = tmp_path / "chip.yaml"
    p.write_text(yaml.safe_dump(data))
    code, _, err = run_cli(["hardware", str(p)], capsys)
    assert path[-1] in _one_error_line(code, err)
