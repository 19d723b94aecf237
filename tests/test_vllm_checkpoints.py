"""Pre-quantized checkpoints: ``minite quantize-model``, the ``minite`` quantization config, and
bad checkpoints failing at load with errors that name the layer (in vLLM's real CPU engine)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load_file, save_file

from minite.cli import main as minite_main
from minite.commands.quantize_model import quantize_checkpoint
from minite.tiny_model import TinyModelSpec, write_tiny_model
from minite_common import DEFAULT_RECIPE, NVFP4Recipe, RecipeMismatchError, quantize_weight
from minite_common.checkpoint import nvfp4_to_state, quantization_config

LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype.itemsize == 1 else t


@pytest.fixture(scope="module")
def quantized_dir(tiny_dense_dir, tmp_path_factory):
    dst = tmp_path_factory.mktemp("quantized") / "q"
    assert minite_main(["quantize-model", str(tiny_dense_dir), str(dst)]) == 0
    return dst


def test_quantize_model_writes_the_learners_bytes(tiny_dense_dir, quantized_dir):
    src, dst = (
        load_file(tiny_dense_dir / "model.safetensors"),
        load_file(quantized_dir / "model.safetensors"),
    )
    config = json.loads((quantized_dir / "config.json").read_text())
    assert config["quantization_config"] == quantization_config(DEFAULT_RECIPE)
    expected = {}
    for name, t in src.items():
        module = name.rsplit(".", 1)[0]
        if module.rsplit(".", 1)[-1] in LINEAR_NAMES:
            expected.update(nvfp4_to_state(module, quantize_weight(t)))
        else:
            expected[name] = t
    assert dst.keys() == expected.keys()
    assert all(
        dst[k].dtype == expected[k].dtype and torch.equal(bits(dst[k]), bits(expected[k]))
        for k in dst
    )
    assert (quantized_dir / "tokenizer.json").exists()


def test_quantize_model_refuses_a_quantized_source_and_a_used_destination(
    tiny_dense_dir, quantized_dir, tmp_path, capsys
):
    assert minite_main(["quantize-model", str(quantized_dir), str(tmp_path / "again")]) == 2
    assert "minite: error: " in capsys.readouterr().err
    with pytest.raises(ValueError, match="already quantized"):
        quantize_checkpoint(quantized_dir, tmp_path / "again")
    with pytest.raises(FileExistsError, match=r"q is not an empty folder .*config\.json"):
        quantize_checkpoint(tiny_dense_dir, quantized_dir)
    # Another model's leftover shards are not mixed in: the folder is refused, untouched.
    leftovers = tmp_path / "leftovers"
    leftovers.mkdir()
    (leftovers / "model-00002-of-00002.safetensors").write_bytes(b"another model")
    assert minite_main(["quantize-model", str(tiny_dense_dir), str(leftovers)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("minite: error: ") and err.count("\n") == 1, err
    assert "model-00002-of-00002.safetensors" in err and "choose a new or empty" in err
    assert [p.name for p in leftovers.iterdir()] == ["model-00002-of-00002.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["leftovers"]
    # An empty folder is fine.
    (tmp_path / "empty").mkdir()
    quantize_checkpoint(tiny_dense_dir, tmp_path / "empty")
    assert (tmp_path / "empty" / "config.json").exists()


FULL_DISK = textwrap.dedent(
    """
    import resource, signal, sys
    from minite.cli import main

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG
    limit = int(sys.argv[1])
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    sys.exit(main(["quantize-model", *sys.argv[2:]]))
    """
)


def test_quantize_model_on_a_full_disk_leaves_nothing(tiny_dense_dir, quantized_dir, tmp_path):
    # A source whose tokenizer.json is larger than the file-size limit, which the quantized
    # weights fit under: the copy fails half-way, as on a full disk.
    src = tmp_path / "src"
    src.mkdir()
    for f in tiny_dense_dir.iterdir():
        (src / f.name).write_bytes(f.read_bytes())
    limit = (quantized_dir / "model.safetensors").stat().st_size + 4096
    tokenizer = (src / "tokenizer.json").read_text()
    (src / "tokenizer.json").write_text(tokenizer + " " * (2 * limit))
    script = tmp_path / "full_disk.py"
    script.write_text(FULL_DISK)
    dst = tmp_path / "out" / "q"
    out = subprocess.run([sys.executable, str(script), str(limit), str(src), str(dst)],
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert out.returncode == 2, out.stderr[-3000:]
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("minite: error: [Errno 27] File too large") and "tokenizer" in last
    assert "Traceback" not in out.stderr
    assert list((tmp_path / "out").iterdir()) == []  # neither a checkpoint nor a partial folder


def test_quantize_model_keeps_the_shards_and_rewrites_the_index(tiny_dense_dir, tmp_path):
    src = tmp_path / "sharded"
    src.mkdir()
    tensors = load_file(tiny_dense_dir / "model.safetensors")
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2 :]}  # fmt: skip
    for file, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(src / file), metadata={"format": "pt"})
    weight_map = {k: f for f, keys in shards.items() for k in keys}
    (src / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (src / "config.json").write_text((tiny_dense_dir / "config.json").read_text())
    minite_main(["quantize-model", str(src), str(tmp_path / "q")])
    index = json.loads((tmp_path / "q" / "model.safetensors.index.json").read_text())
    for file in shards:
        for key in load_file(tmp_path / "q" / file):
            assert index["weight_map"].pop(key) == file
    assert index["weight_map"] == {}


def test_config_recipe_from_checkpoint_env_and_default(tmp_path, monkeypatch):
    from minite_vllm.config import RECIPE_ENV, MiniteConfig

    monkeypatch.delenv(RECIPE_ENV, raising=False)
    assert MiniteConfig().recipe == DEFAULT_RECIPE and not MiniteConfig().prequantized
    keep = NVFP4Recipe(bf16_first_layers=1)
    config = MiniteConfig.from_config(quantization_config(keep))
    assert config.prequantized and config.recipe == keep
    (tmp_path / "recipe.json").write_text(json.dumps(keep.to_dict()))
    monkeypatch.setenv(RECIPE_ENV, str(tmp_path / "recipe.json"))
    assert MiniteConfig().recipe == keep
    with pytest.raises(RecipeMismatchError, match=RECIPE_ENV):
        MiniteConfig.from_config(quantization_config(DEFAULT_RECIPE))
    (tmp_path / "recipe.json").write_text(json.dumps([keep.to_dict()]))
    with pytest.raises(ValueError, match=rf"{RECIPE_ENV}: .*recipe\.json holds a JSON list"):
        MiniteConfig()


def test_config_claims_minite_checkpoints_only():
    from minite_vllm.config import MiniteConfig

    cfg = quantization_config(DEFAULT_RECIPE)
    assert MiniteConfig.override_quantization_method(cfg, None) == "minite"
    assert MiniteConfig.override_quantization_method({"quant_method": "fp8"}, None) is None
    with pytest.raises(RecipeMismatchError, match="fingerprint"):
        MiniteConfig.override_quantization_method({**cfg, "fingerprint": "nvfp4-v1-0"}, "minite")


def test_a_fused_layer_is_kept_in_bf16_whole_or_not_at_all():
    from minite_vllm.config import MiniteConfig, hf_module_names

    mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}
    prefix = "model.layers.0.self_attn.qkv_proj"
    names = hf_module_names(prefix, mapping)
    assert names == [f"model.layers.0.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj")]
    config = MiniteConfig(NVFP4Recipe(bf16_modules=("*.k_proj",)))
    with pytest.raises(ValueError, match="vLLM fuses them into one layer"):
        config.keeps_bf16(prefix, names, 2)


def test_register_is_idempotent():
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS

    import minite_vllm

    minite_vllm.register()
    minite_vllm.register()
    assert QUANTIZATION_METHODS.count("minite") == 1


LOAD_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from vllm import LLM

    if __name__ == "__main__":
        for path in sys.argv[1:]:
            try:
                LLM(path, quantization="minite", enforce_eager=True, dtype="bfloat16",
                    max_model_len=256)
                print(json.dumps([path, "loaded"]), flush=True)
            except Exception as e:
                print(json.dumps([path, f"{type(e).__name__}: {e}"]), flush=True)
    """
)


def _variant(quantized_dir, dst, tensors=None, config=None):
    dst.mkdir()
    for f in quantized_dir.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    if tensors:
        t = load_file(dst / "model.safetensors")
        tensors(t)
        save_file(t, str(dst / "model.safetensors"), metadata={"format": "pt"})
    if config:
        c = json.loads((dst / "config.json").read_text())
        config(c)
        (dst / "config.json").write_text(json.dumps(c))
    return dst


def _set(name, value):
    return lambda t: t.update({name: value})


def _negative_scale(name):
    def edit(t):
        bits = t[name].view(torch.uint8).clone()
        bits[5, 1] |= 0x80  # the sign bit of one E4M3 block scale
        t[name] = bits.view(torch.float8_e4m3fn)

    return edit


def _bf16_variant(src, dst, tensors):
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    t = load_file(dst / "model.safetensors")
    tensors(t)
    save_file(t, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_bad_checkpoints_fail_at_load_naming_the_layer(tiny_dense_dir, quantized_dir, tmp_path):
    down = "model.layers.1.mlp.down_proj"
    scale, q = f"{down}.weight_scale", "model.layers.0.self_attn.q_proj"
    o = "model.layers.0.self_attn.o_proj"
    qt = load_file(quantized_dir / "model.safetensors")
    fix = "re-create it with `minite quantize-model"
    cases = {
        write_tiny_model(tmp_path / "dim", TinyModelSpec(intermediate_size=200)): (
            r"model\.layers\.0\.mlp\.gate_proj.* 200, not a multiple of 16"
        ),
        _variant(quantized_dir, tmp_path / "missing",
                 tensors=lambda t: t.pop("model.layers.0.self_attn.k_proj.weight_scale_2")): (
            r"lacks model\.layers\.0\.self_attn\.k_proj\.weight_scale_2"
        ),
        _variant(quantized_dir, tmp_path / "dtype",
                 tensors=lambda t: t.update({scale: t[scale].float()})): (
            rf"{scale}: expected torch.float8_e4m3fn \[128, 16\] .*found torch.float32"
        ),
        _variant(quantized_dir, tmp_path / "recipe",
                 config=lambda c: c["quantization_config"].update(fingerprint="nvfp4-v1-0")): (
            "stored fingerprint 'nvfp4-v1-0' does not match its recipe"
        ),
        # Global scales: not finite, not positive, or absurd (1e30 implies an amax of 2.7e33).
        **{
            _variant(quantized_dir, tmp_path / f"scale2_{i}",
                     tensors=_set(f"{q}.weight_scale_2", torch.tensor(v))): (
                rf"{q}\.weight_scale_2: global decode scale {shown} is not in \(0, .*{fix}"
            )
            for i, (v, shown) in enumerate(((1e30, r"1e\+30"), (float("inf"), "inf"),
                                            (float("nan"), "nan"), (-0.5, "-0.5"), (0.0, "0")))
        },
        _variant(quantized_dir, tmp_path / "scale2_shape",
                 tensors=_set(f"{q}.weight_scale_2", torch.ones(2))): (
            rf"{q}\.weight_scale_2: expected torch.float32 \[\] .*found torch.float32 \[2\]"
        ),
        _variant(quantized_dir, tmp_path / "negative", tensors=_negative_scale(scale)): (
            rf"{scale}: holds 1 negative and 0 NaN E4M3 block scales; .*{fix}"
        ),
        # Codes or scales with extra or missing rows or columns.
        _variant(quantized_dir, tmp_path / "rows_q",
                 tensors=_set(f"{q}.weight", torch.cat([qt[f"{q}.weight"]] * 2))): (
            rf"{q}\.weight: expected torch.uint8 \[128, 64\] .*found torch.uint8 \[256, 64\]"
        ),
        _variant(quantized_dir, tmp_path / "cols_o",
                 tensors=_set(f"{o}.weight", qt[f"{o}.weight"][:, :48].contiguous())): (
            rf"{o}\.weight: expected torch.uint8 \[128, 64\] .*found torch.uint8 \[128, 48\]"
        ),
        _variant(quantized_dir, tmp_path / "rows_scale",
                 tensors=_set(scale, qt[scale][:112])): (
            rf"{scale}: expected torch.float8_e4m3fn \[128, 16\] .*\[112, 16\]"
        ),
        # Missing tensors that are not quantized, in a miniTE and in a BF16 checkpoint.
        _variant(quantized_dir, tmp_path / "no_norm",
                 tensors=lambda t: t.pop("model.norm.weight")): (
            r"not initialized from checkpoint: \{'model\.norm\.weight'\}: the checkpoint lacks"
        ),
        _bf16_variant(tiny_dense_dir, tmp_path / "bf16_no_layernorm",
                      lambda t: t.pop("model.layers.0.input_layernorm.weight")): (
            r"\{'model\.layers\.0\.input_layernorm\.weight'\}: the checkpoint lacks"
        ),
        _bf16_variant(tiny_dense_dir, tmp_path / "bf16_no_q",
                      lambda t: t.pop(f"{q}.weight")): (
            rf"qkv_proj: the checkpoint lacks {q}\.weight; every weight of the model"
        ),
        _bf16_variant(tiny_dense_dir, tmp_path / "bf16_rows_q",
                      lambda t: t.update({f"{q}.weight": torch.cat([t[f"{q}.weight"]] * 2)})): (
            rf"{q}\.weight: expected a BF16/FP16/FP32 tensor \[128, 128\] .*\[256, 128\]"
        ),
    }  # fmt: skip
    script = tmp_path / "load.py"
    script.write_text(LOAD_SCRIPT)
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}  # errors surface in-process
    out = subprocess.run([sys.executable, str(script), *map(str, cases)], capture_output=True,
                         text=True, timeout=600, env=env)  # fmt: skip
    results = dict(json.loads(line) for line in out.stdout.splitlines() if line.startswith("["))
    assert len(results) == len(cases), out.stderr[-3000:]
    wrong = {p.name: results[str(p)] for p, pattern in cases.items()
             if not re.search(pattern, results[str(p)])}  # fmt: skip
    assert not wrong, wrong


SYNC_SCRIPT = textwrap.dedent(
    """
    import sys
    from safetensors.torch import load_file
    from vllm import LLM
    from minite_vllm import WORKER_EXTENSION, pack_weights, unpack_weights

    if __name__ == "__main__":
        bf16 = pack_weights(load_file(sys.argv[1] + "/model.safetensors"))
        for path in sys.argv[2:]:
            llm = LLM(path, quantization="minite", enforce_eager=True, dtype="bfloat16",
                      max_model_len=256, worker_extension_cls=WORKER_EXTENSION)
            quantized = llm.collective_rpc("get_quantized_weights")[0]
            recipe = llm.collective_rpc("get_recipe_fingerprint")[0]
            llm.collective_rpc("update_weights_bf16", args=(bf16,))
            llm.collective_rpc("update_weights_quantized", args=(quantized, recipe))
            print("synced", path, len(unpack_weights(quantized)), flush=True)
            llm.llm_engine.engine_core.shutdown()
    """
)


def test_loading_and_weight_syncs_log_no_dtype_mismatch(tiny_dense_dir, quantized_dir, tmp_path):
    # vLLM warned "Attempted to load weight ... with dtype torch.bfloat16 into parameter with
    # dtype torch.uint8" for every unfused quantized layer (o_proj, down_proj) at each BF16 sync.
    script = tmp_path / "sync.py"
    script.write_text(SYNC_SCRIPT)
    dirs = [str(tiny_dense_dir), str(tiny_dense_dir), str(quantized_dir)]
    out = subprocess.run([sys.executable, str(script), *dirs], capture_output=True, text=True,
                         timeout=600)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("synced") == 2 and " 42" in out.stdout, out.stdout
    log = out.stdout + out.stderr
    assert "Loading weights took" in log  # vLLM's log is captured
    assert "Attempted to load weight" not in log
