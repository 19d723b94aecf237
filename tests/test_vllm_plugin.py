"""The vLLM plugin in vLLM's real CPU engine: generation, bitwise layer outputs, RL weight updates,
fingerprints. One engine per test class (engine start is about 20 s on CPU)."""

from __future__ import annotations

import math
import os
import sys

import cloudpickle
import pytest
import torch
from safetensors.torch import load_file

from minite.commands.quantize_model import quantize_checkpoint
from minite.tiny_model import TinyModelSpec, write_tiny_model
from minite_common import (
    NVFP4Recipe,
    cat_rows,
    gemm_path,
    quantize_weight,
    w4a4_linear,
)
from minite_common.checkpoint import nvfp4_to_state
from minite_vllm import WORKER_EXTENSION, pack_weights, unpack_weights

# Tests send small functions to the workers (layer hooks, parameter addresses) by value.
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
cloudpickle.register_pickle_by_value(sys.modules[__name__])

PROMPTS = ["Hello world", "abc", "The quick brown fox jumps over", "0123456789"]


def start_engine(path, quantization: str | None = "minite", **kwargs):
    from vllm import LLM

    return LLM(
        str(path),
        quantization=quantization,
        enforce_eager=True,
        dtype="bfloat16",
        max_model_len=256,
        max_num_seqs=4,
        seed=0,
        worker_extension_cls=WORKER_EXTENSION,
        **kwargs,
    )


def engine_fixture(llm):
    yield llm
    llm.llm_engine.engine_core.shutdown()


def greedy(llm, prompts=PROMPTS, max_tokens=8):
    """Token ids, per-token logprobs and prompt logprobs of a greedy run (exact floats)."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0, logprobs=1, prompt_logprobs=1)
    out = []
    for o in llm.generate(prompts, params, use_tqdm=False):
        c = o.outputs[0]
        lps = [d[t].logprob for t, d in zip(c.token_ids, c.logprobs, strict=True)]
        prompt_lps = [
            d[t].logprob for t, d in zip(o.prompt_token_ids[1:], o.prompt_logprobs[1:], strict=True)
        ]
        out.append((list(c.token_ids), lps, prompt_lps))
    return out


def quantized_state(llm, names=None) -> dict[str, torch.Tensor]:
    return unpack_weights(llm.collective_rpc("get_quantized_weights", args=(names,))[0])


def learner_state(hf: dict[str, torch.Tensor], names) -> dict[str, torch.Tensor]:
    """What the learner's quantize_weight makes of the same HF tensors, in checkpoint format."""
    out = {}
    for name in names:
        out.update(nvfp4_to_state(name, quantize_weight(hf[f"{name}.weight"])))
    return out


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    as_bits = lambda t: t.view(torch.uint8) if t.dtype.itemsize == 1 else t
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(as_bits(a), as_bits(b))


def same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(bitwise_equal(a[k], b[k]) for k in a)


def _quantized_names(hf: dict[str, torch.Tensor]) -> list[str]:
    return sorted(
        k.rsplit(".", 1)[0]
        for k, v in hf.items()
        if v.dim() == 2 and "embed" not in k and "lm_head" not in k
    )


# Functions run inside the workers (``self`` is the vLLM worker).


def _param_addresses(self):
    model = self.model_runner.get_model()
    return {n: (p.data_ptr(), tuple(p.shape), str(p.dtype)) for n, p in model.named_parameters()}


def _capture_linear(self, names):
    model = self.model_runner.get_model()
    model._captured = {}
    model._capture_handles = []
    for name in names:

        def hook(module, args, output, name=name):
            y = output[0] if isinstance(output, tuple) else output
            model._captured.setdefault(name, []).append((args[0].clone(), y.clone()))

        model._capture_handles.append(model.get_submodule(name).register_forward_hook(hook))


def _capture_experts(self, name):
    model = self.model_runner.get_model()
    layer = model.get_submodule(name)
    method, apply = layer.quant_method, layer.quant_method.apply
    model._captured = {name: []}

    def capturing_apply(layer, x, topk_weights, topk_ids, *args, **kwargs):
        out = apply(layer, x, topk_weights, topk_ids, *args, **kwargs)
        model._captured[name].append(
            (x.clone(), topk_weights.clone(), topk_ids.clone(), out.clone())
        )
        return out

    method.apply = capturing_apply


def _take_captured(self):
    model = self.model_runner.get_model()
    for handle in getattr(model, "_capture_handles", []):
        handle.remove()
    model._capture_handles = []
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is not None and "apply" in vars(method):
            del method.apply
    captured, model._captured = model._captured, {}
    return pack_weights(
        {
            f"{name}|{i}|{j}": t
            for name, calls in captured.items()
            for i, call in enumerate(calls)
            for j, t in enumerate(call)
        }  # fmt: skip
    )


def take_captured(llm) -> dict[str, list[tuple[torch.Tensor, ...]]]:
    """The tensors the capture hooks recorded: {layer: [(inputs..., output) per call]}."""
    flat = unpack_weights(llm.collective_rpc(_take_captured)[0])
    calls: dict[str, dict[int, dict[int, torch.Tensor]]] = {}
    for key, t in flat.items():
        name, i, j = key.split("|")
        calls.setdefault(name, {}).setdefault(int(i), {})[int(j)] = t
    return {
        name: [tuple(c[j] for j in sorted(c)) for _, c in sorted(by_call.items())]
        for name, by_call in calls.items()
    }


def _quant_config_name(self):
    return type(self.vllm_config.quant_config).__name__


# --------------------------------------------------------------------------------------------
# Dense Qwen3, BF16 checkpoint quantized online


@pytest.fixture(scope="class")
def dense(tiny_dense_dir):
    yield from engine_fixture(start_engine(tiny_dense_dir))


@pytest.fixture(scope="class")
def dense_baseline(dense):
    return greedy(dense)


@pytest.fixture(scope="module")
def dense_b_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny_dense_b"), seed=1)


class TestDenseOnline:
    def test_registered_in_every_process(self, dense):
        from vllm.model_executor.layers.quantization import get_quantization_config

        from minite_vllm.config import MiniteConfig

        assert get_quantization_config("minite") is MiniteConfig
        assert dense.collective_rpc(_quant_config_name) == ["MiniteConfig"]

    def test_generates_finite_logprobs_and_greedy_is_stable(self, dense, dense_baseline):
        for tokens, lps, prompt_lps in dense_baseline:
            assert len(tokens) == 8
            assert all(math.isfinite(v) for v in lps + prompt_lps)
        assert greedy(dense) == dense_baseline
        # Each prompt alone (other batch sizes) gives the same bits: W4A4 is batch-invariant.
        assert [greedy(dense, [p])[0] for p in PROMPTS[:2]] == dense_baseline[:2]

    def test_layer_outputs_equal_w4a4_linear(self, dense, tiny_dense_dir):
        hf = load_file(tiny_dense_dir / "model.safetensors")
        layers = {
            "model.layers.0.self_attn.qkv_proj": ["q_proj", "k_proj", "v_proj"],
            "model.layers.1.mlp.gate_up_proj": ["gate_proj", "up_proj"],
            "model.layers.1.mlp.down_proj": ["down_proj"],
        }
        dense.collective_rpc(_capture_linear, args=(list(layers),))
        greedy(dense, PROMPTS[:2], max_tokens=2)
        captured = take_captured(dense)
        for name, parts in layers.items():
            parent = name.rsplit(".", 1)[0]
            w = cat_rows([quantize_weight(hf[f"{parent}.{p}.weight"]) for p in parts])
            assert captured[name], name
            for x, y in captured[name]:
                assert torch.equal(y, w4a4_linear(x, w)), name

    def test_quantized_bytes_equal_the_learners(self, dense, tiny_dense_dir):
        hf = load_file(tiny_dense_dir / "model.safetensors")
        got = quantized_state(dense)
        names = sorted({k.rsplit(".", 1)[0] for k in got if k.endswith(".weight")})
        assert len(names) == 2 * 7  # q, k, v, o, gate, up, down per layer
        assert same_state(got, learner_state(hf, names))
        # Online quantization keeps no BF16 copy of the quantized layers.
        params = dense.collective_rpc(_param_addresses)[0]
        kinds = {dtype for name, (_, _, dtype) in params.items() if "_proj." in name}
        assert kinds == {"torch.uint8", "torch.float8_e4m3fn", "torch.float32"}

    def test_execution_fingerprints(self, dense):
        fps = dense.collective_rpc("get_execution_fingerprints")[0]
        recipe = dense.collective_rpc("get_recipe_fingerprint")[0]
        assert fps["model.layers.0.self_attn.k_proj"] == {
            "mode": "nvfp4",
            "recipe": recipe,
            "kernel": gemm_path("cpu"),
            "config": "weight=16x16 blocks/tensor amax, activation=1x16 blocks/row amax",
        }
        assert fps["lm_head"] == fps["model.embed_tokens"] == {"mode": "bf16", "recipe": recipe}
        assert sum(r["mode"] == "nvfp4" for r in fps.values()) == 14

    def test_bf16_update_equals_a_fresh_engine_then_quantized_update_restores(
        self, dense, dense_baseline, tiny_dense_dir, dense_b_dir
    ):
        addresses = dense.collective_rpc(_param_addresses)[0]
        dense.collective_rpc(
            "update_weights_bf16",
            args=(pack_weights(load_file(dense_b_dir / "model.safetensors")),),
        )
        updated = greedy(dense)
        assert updated != dense_baseline
        assert dense.collective_rpc(_param_addresses)[0] == addresses
        fresh = start_engine(dense_b_dir)
        try:
            assert updated == greedy(fresh)
            assert same_state(quantized_state(dense), quantized_state(fresh))
        finally:
            fresh.llm_engine.engine_core.shutdown()
        # Back to the original weights from the learner's pre-quantized tensors.
        hf = load_file(tiny_dense_dir / "model.safetensors")
        quantized = {k: v for k, v in hf.items() if k.rsplit(".", 1)[0] not in _quantized_names(hf)}
        quantized.update(learner_state(hf, _quantized_names(hf)))
        recipe = dense.collective_rpc("get_recipe_fingerprint")[0]
        dense.collective_rpc("update_weights_quantized", args=(pack_weights(quantized), recipe))
        assert greedy(dense) == dense_baseline
        assert dense.collective_rpc(_param_addresses)[0] == addresses

    def test_a_partial_update_changes_only_its_weights(
        self, dense, dense_baseline, tiny_dense_dir, dense_b_dir
    ):
        b = load_file(dense_b_dir / "model.safetensors")
        before = quantized_state(dense)
        k_proj = "model.layers.0.self_attn.k_proj"
        dense.collective_rpc(
            "update_weights_bf16", args=(pack_weights({f"{k_proj}.weight": b[f"{k_proj}.weight"]}),)
        )
        after = quantized_state(dense)
        changed = {k for k in after if not bitwise_equal(after[k], before[k])}
        assert changed == {f"{k_proj}.{s}" for s in ("weight", "weight_scale", "weight_scale_2")}
        assert same_state({k: after[k] for k in changed}, learner_state(b, [k_proj]))
        a = load_file(tiny_dense_dir / "model.safetensors")
        dense.collective_rpc(
            "update_weights_bf16", args=(pack_weights({f"{k_proj}.weight": a[f"{k_proj}.weight"]}),)
        )
        assert greedy(dense) == dense_baseline

    def test_failed_updates_raise_and_keep_the_old_weights(
        self, dense, dense_baseline, dense_b_dir
    ):
        b = load_file(dense_b_dir / "model.safetensors")
        addresses = dense.collective_rpc(_param_addresses)[0]
        before = quantized_state(dense)
        down = "model.layers.1.mlp.down_proj.weight"
        q, o = "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.o_proj.weight"
        nan = b[down].clone()
        nan[3, 5] = float("nan")
        rows16 = lambda t: torch.cat([t, t[:16]])  # noqa: E731
        expected = "expected a BF16/FP16/FP32 tensor"
        bad_bf16 = {
            "holds NaN": {**b, down: nan},
            "not a weight of this model|no module or parameter": {
                **b,
                "model.layers.7.mlp.down_proj.weight": b[down],
            },
            rf"{down} \(torch.bfloat16 \[128, 64\]\): {down}: {expected} \[128, 256\]": {
                **b,
                down: b[down][:, :64],
            },
            # Oversized tensors: not the first rows (or columns) of something bigger.
            rf"{q}: {expected} \[128, 128\] \(the whole HF weight\), found .* \[144, 128\]": {
                **b,
                q: rows16(b[q]),
            },
            rf"{o}: {expected} \[128, 128\] .*found torch.bfloat16 \[128, 144\]": {
                **b,
                o: torch.cat([b[o], b[o][:, :16]], dim=1),
            },
            r"model\.norm\.weight \(torch.bfloat16 \[144\]\): .+": {
                **b,
                "model.norm.weight": torch.ones(144, dtype=torch.bfloat16),
            },
            # vLLM's embedding loader asserts without a message: the reason is given all the same.
            r"lm_head.weight \(torch.bfloat16 \[288, 128\]\): vLLM's loader refused it "
            r"\(AssertionError\) for this rank's parameter lm_head.weight \[\d+, 128\]": {
                **b,
                "lm_head.weight": rows16(b["lm_head.weight"]),
            },
            "update_weights_quantized": {
                **b,
                "model.layers.1.mlp.down_proj.weight_scale": torch.zeros(
                    128, 16, dtype=torch.float8_e4m3fn
                ),
            },
        }
        for message, weights in bad_bf16.items():
            with pytest.raises(Exception, match=message):
                dense.collective_rpc("update_weights_bf16", args=(pack_weights(weights),))
        quantized = learner_state(b, ["model.layers.1.mlp.down_proj"])
        with pytest.raises(Exception, match="fingerprint"):
            dense.collective_rpc(
                "update_weights_quantized", args=(pack_weights(quantized), "nvfp4-v1-other")
            )
        recipe = dense.collective_rpc("get_recipe_fingerprint")[0]
        wrong_dtype = {
            **quantized,
            "model.layers.1.mlp.down_proj.weight_scale": quantized[
                "model.layers.1.mlp.down_proj.weight_scale"
            ].float(),
        }
        with pytest.raises(
            Exception, match=r"down_proj.weight_scale: expected torch.float8_e4m3fn .*found torch"
        ):
            dense.collective_rpc(
                "update_weights_quantized", args=(pack_weights(wrong_dtype), recipe)
            )
        qq = learner_state(b, ["model.layers.0.self_attn.q_proj"])
        q_scale = "model.layers.0.self_attn.q_proj.weight_scale"
        negative = qq[q_scale].view(torch.uint8).clone()
        negative[7, 3] |= 0x80
        bad_quantized = {
            # New codes with the old scales would run silently.
            r"lacks model\.layers\.0\.self_attn\.q_proj\.weight_scale, .*weight_scale_2": {
                q: qq[q]
            },
            rf"{q_scale}: holds 1 negative and 0 NaN E4M3 block scales": {
                **qq,
                q_scale: negative.view(torch.float8_e4m3fn),
            },
            rf"{q}: expected torch.uint8 \[128, 64\] .*found torch.uint8 \[144, 64\]": {
                **qq,
                q: rows16(qq[q]),
            },
            rf"{q_scale}: expected torch.float8_e4m3fn \[128, 8\] .*\[144, 8\]": {
                **qq,
                q_scale: rows16(qq[q_scale]),
            },
            r"q_proj\.weight_scale_2: global decode scale 1e\+30 is not in": {
                **qq,
                f"{q_scale}_2": torch.tensor(1e30),
            },
        }
        for message, weights in bad_quantized.items():
            with pytest.raises(Exception, match=message):
                dense.collective_rpc(
                    "update_weights_quantized", args=(pack_weights(weights), recipe)
                )
        assert greedy(dense) == dense_baseline
        assert dense.collective_rpc(_param_addresses)[0] == addresses
        assert same_state(quantized_state(dense), before)  # bitwise the old weights

    def test_vllm_reload_weights_keeps_tensor_addresses(self, dense, dense_baseline, dense_b_dir):
        addresses = dense.collective_rpc(_param_addresses)[0]
        dense.collective_rpc(
            "update_weights_bf16",
            args=(pack_weights(load_file(dense_b_dir / "model.safetensors")),),
        )
        dense.collective_rpc("reload_weights")  # vLLM's own layerwise reload, from the checkpoint
        assert greedy(dense) == dense_baseline
        assert dense.collective_rpc(_param_addresses)[0] == addresses


# --------------------------------------------------------------------------------------------
# Qwen3-MoE: routed experts through grouped_w4a4_linear, router and LM head in BF16


@pytest.fixture(scope="class")
def moe(tiny_moe_dir):
    yield from engine_fixture(start_engine(tiny_moe_dir))


@pytest.fixture(scope="class")
def moe_baseline(moe):
    return greedy(moe)


def moe_reference(hf, prefix, x, topk_weights, topk_ids):
    """Each token alone: its top-k experts through w4a4_linear, combined in FP32 in slot order."""
    experts = {}
    out = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(x.shape[0]):
        for slot, e in enumerate(topk_ids[t].tolist()):
            if e not in experts:
                names = [f"{prefix}.{e}.{p}_proj.weight" for p in ("gate", "up", "down")]
                gate, up, down = (quantize_weight(hf[n]) for n in names)
                experts[e] = (cat_rows([gate, up]), down)
            gate_up, down = experts[e]
            h = w4a4_linear(x[t : t + 1], gate_up).float()
            gate_h, up_h = h.split(h.shape[1] // 2, dim=1)
            act = (torch.nn.functional.silu(gate_h) * up_h).to(x.dtype)
            out[t] += topk_weights[t, slot].float() * w4a4_linear(act, down)[0].float()
    return out.to(x.dtype)


class TestMoE:
    def test_generates_finite_logprobs_and_greedy_is_stable(self, moe, moe_baseline):
        assert all(math.isfinite(v) for _, lps, plps in moe_baseline for v in lps + plps)
        assert greedy(moe) == moe_baseline
        assert greedy(moe, PROMPTS[2:3]) == moe_baseline[2:3]

    def test_expert_outputs_equal_each_token_alone(self, moe, tiny_moe_dir):
        hf = load_file(tiny_moe_dir / "model.safetensors")
        name = "model.layers.1.mlp.experts"
        moe.collective_rpc(_capture_experts, args=(f"{name}.routed_experts",))
        greedy(moe, PROMPTS[:3], max_tokens=2)
        captured = take_captured(moe)[f"{name}.routed_experts"]
        assert captured
        for x, topk_weights, topk_ids, out in captured:
            assert torch.equal(out, moe_reference(hf, name, x, topk_weights, topk_ids))

    def test_router_and_lm_head_stay_bf16(self, moe):
        fps = moe.collective_rpc("get_execution_fingerprints")[0]
        assert fps["model.layers.0.mlp.gate"]["mode"] == "bf16"
        assert fps["lm_head"]["mode"] == "bf16"
        assert fps["model.layers.1.mlp.experts.7.down_proj"]["mode"] == "nvfp4"
        assert sum(r["mode"] == "nvfp4" for r in fps.values()) == 2 * (4 + 8 * 3)

    def test_prequantized_checkpoint_gives_the_same_bytes_and_outputs(
        self, moe, moe_baseline, tiny_moe_dir, tmp_path
    ):
        quantize_checkpoint(tiny_moe_dir, tmp_path / "q")
        prequantized = start_engine(tmp_path / "q", quantization=None)  # claimed from config.json
        try:
            assert prequantized.collective_rpc(_quant_config_name) == ["MiniteConfig"]
            assert same_state(quantized_state(prequantized), quantized_state(moe))
            assert greedy(prequantized) == moe_baseline
        finally:
            prequantized.llm_engine.engine_core.shutdown()

    def test_bf16_expert_update_equals_the_learner_and_reload_restores(
        self, moe, moe_baseline, tmp_path
    ):
        b_dir = write_tiny_model(tmp_path / "b", TinyModelSpec(moe=True), seed=1)
        b = load_file(b_dir / "model.safetensors")
        addresses = moe.collective_rpc(_param_addresses)[0]
        moe.collective_rpc("update_weights_bf16", args=(pack_weights(b),))
        got = quantized_state(moe)
        assert same_state(got, learner_state(b, sorted({k.rsplit(".", 1)[0] for k in got})))
        assert greedy(moe) != moe_baseline
        moe.collective_rpc("reload_weights")
        assert greedy(moe) == moe_baseline
        assert moe.collective_rpc(_param_addresses)[0] == addresses


# --------------------------------------------------------------------------------------------
# A pre-quantized checkpoint whose recipe keeps the first decoder layer in BF16

KEEP_FIRST = NVFP4Recipe(bf16_first_layers=1)


@pytest.fixture(scope="class")
def kept_dir(tiny_dense_dir, tmp_path_factory):
    dst = tmp_path_factory.mktemp("kept") / "q"
    quantize_checkpoint(tiny_dense_dir, dst, KEEP_FIRST)
    return dst


@pytest.fixture(scope="class")
def kept(kept_dir):
    yield from engine_fixture(start_engine(kept_dir, quantization=None))


class TestRecipeKeptLayers:
    def test_kept_layers_run_bf16_and_are_reported(self, kept):
        assert kept.collective_rpc("get_recipe_fingerprint")[0] == KEEP_FIRST.fingerprint()
        fps = kept.collective_rpc("get_execution_fingerprints")[0]
        assert fps["model.layers.0.self_attn.q_proj"] == {
            "mode": "bf16",
            "recipe": KEEP_FIRST.fingerprint(),
        }
        assert fps["model.layers.1.self_attn.q_proj"]["mode"] == "nvfp4"
        assert {k.split(".")[2] for k in quantized_state(kept)} == {"1"}
        with pytest.raises(Exception, match="not NVFP4 weights"):
            kept.collective_rpc("get_quantized_weights", args=(["model.layers.0.mlp.up_proj"],))

    def test_updating_a_kept_bf16_layer_takes_effect(self, kept, tiny_dense_dir, dense_b_dir):
        baseline = greedy(kept)
        layer0 = lambda hf: {k: v for k, v in hf.items() if k.startswith("model.layers.0.")}
        b = layer0(load_file(dense_b_dir / "model.safetensors"))
        kept.collective_rpc("update_weights_bf16", args=(pack_weights(b),))
        assert greedy(kept) != baseline
        a = layer0(load_file(tiny_dense_dir / "model.safetensors"))
        kept.collective_rpc("update_weights_bf16", args=(pack_weights(a),))
        assert greedy(kept) == baseline


# --------------------------------------------------------------------------------------------
# Tensor parallelism (2 ranks on gloo): each rank holds its shard of the learner's tensors


def rank_shard(full: torch.Tensor, got: torch.Tensor, rank: int) -> torch.Tensor:
    """Rank ``rank``'s slice of ``full`` in the shape it holds (rows for column-parallel layers,
    where 2 ranks may also share one replicated KV head, columns for row-parallel ones)."""
    if got.shape == full.shape or got.dim() == 0:
        return full
    if got.shape[0] != full.shape[0]:
        rows = got.shape[0]
        return full.narrow(0, rank * rows if full.shape[0] == 2 * rows else 0, rows)
    return full.narrow(1, rank * got.shape[1], got.shape[1])


def assert_rank_shards_equal_learner(llm, hf: dict[str, torch.Tensor]) -> None:
    ranks = [unpack_weights(b) for b in llm.collective_rpc("get_quantized_weights")]
    assert ranks[0].keys() == ranks[1].keys()
    full = learner_state(hf, sorted({k.rsplit(".", 1)[0] for k in ranks[0]}))
    for rank, state in enumerate(ranks):
        for key, got in state.items():
            assert bitwise_equal(got, rank_shard(full[key], got, rank)), (rank, key)


@pytest.mark.parametrize("moe_model", [False, True], ids=["dense", "moe"])
def test_tensor_parallel_shards_equal_the_learners_before_and_after_an_update(moe_model, tmp_path):
    spec = TinyModelSpec(moe=moe_model)
    a_dir, b_dir = (write_tiny_model(tmp_path / n, spec, seed=s) for n, s in (("a", 0), ("b", 1)))
    llm = start_engine(a_dir, tensor_parallel_size=2)
    try:
        out = greedy(llm, PROMPTS[:2], max_tokens=4)
        assert all(math.isfinite(v) for _, lps, plps in out for v in lps + plps)
        assert_rank_shards_equal_learner(llm, load_file(a_dir / "model.safetensors"))
        b = load_file(b_dir / "model.safetensors")
        llm.collective_rpc("update_weights_bf16", args=(pack_weights(b),))
        assert_rank_shards_equal_learner(llm, b)
    finally:
        llm.llm_engine.engine_core.shutdown()
