"""Grouped NVFP4 experts (``MiniTEGroupedMLP``) in a real Megatron-Core GPTModel on CPU, against
the ``SequentialMLP`` miniTE model with the same weights (tiny Qwen3-MoE: 2 layers, 8 experts,
top-2), plus the grouped kernels in Triton's interpreter.

The two differ in one op: Megatron's local expert MLP computes the SwiGLU as
``bf16(bf16(silu(gate)) * up)``, the grouped module as the sampler does,
``bf16(silu(f32 gate) * f32 up)``. With ``SequentialMLP``'s experts given the same activation
(Megatron's ``use_te_activation_func`` switch, see :func:`_sampler_activation`), forward and
nearest-rounding gradients are bitwise equal.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest
import torch

from minite_common.hadamard import RHT_SIGNS

pytestmark = pytest.mark.usefixtures("megatron_world")

TOKENS = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(1))


def _build(hf_dir, **kwargs):
    from minite_megatron import build_gpt_model_from_hf

    return build_gpt_model_from_hf(hf_dir, **kwargs)


class _SamplerSwiGLU(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from minite_common import expert_swiglu

        return expert_swiglu(x)


def _sampler_activation(model) -> None:
    """Make ``SequentialMLP``'s expert MLPs call :func:`expert_swiglu` (per expert, through
    Megatron's ``use_te_activation_func`` switch; probabilities are then applied as before)."""
    for layer in model.decoder.layers:
        for expert in layer.mlp.experts.local_experts:
            expert.config = copy.copy(expert.config)
            expert.config.use_te_activation_func = True
            expert.activation_func = _SamplerSwiGLU()


def _grads(model) -> dict[str, torch.Tensor]:
    """Parameter gradients by name, SequentialMLP's per-expert ones stacked like the grouped
    module's parameters (``...mlp.experts.linear_fc1.weight`` [experts, N, K])."""
    grads, experts = {}, {}
    for name, p in model.named_parameters():
        if ".local_experts." in name:
            head, tail = name.split(".local_experts.")
            index, linear = tail.split(".", 1)
            experts.setdefault(f"{head}.{linear}", {})[int(index)] = p.grad
        else:
            grads[name] = p.grad
    for name, parts in experts.items():
        grads[name] = torch.stack([parts[e] for e in sorted(parts)])
    return grads


def _loss_backward(model, seed: int) -> torch.Tensor:
    from minite_megatron import token_logprobs

    torch.manual_seed(seed)
    lp = token_logprobs(model, TOKENS)
    (-lp.mean()).backward()
    return lp.detach()


def _same_nvfp4(a, b) -> bool:
    return (
        torch.equal(a.codes, b.codes)
        and torch.equal(a.scales.view(torch.uint8), b.scales.view(torch.uint8))
        and torch.equal(a.channel_decode_scale(), b.channel_decode_scale())
    )


def test_the_spec_builds_grouped_experts_only_where_asked(tiny_moe_dir):
    from megatron.core.transformer.moe.experts import SequentialMLP

    from minite_common import NVFP4Recipe
    from minite_megatron import MiniTEGroupedMLP, invalidate_quantized_weights

    assert isinstance(_build(tiny_moe_dir).decoder.layers[0].mlp.experts, SequentialMLP)
    model = _build(tiny_moe_dir, grouped_experts=True)
    assert all(isinstance(layer.mlp.experts, MiniTEGroupedMLP) for layer in model.decoder.layers)
    assert invalidate_quantized_weights(model) == 2 * (2 + 2)  # q/k/v, o, grouped fc1, fc2
    bf16_experts = NVFP4Recipe(bf16_modules=(*NVFP4Recipe().bf16_modules, "*.mlp.experts.*"))
    kept = _build(tiny_moe_dir, recipe=bf16_experts, grouped_experts=True)
    assert isinstance(kept.decoder.layers[0].mlp.experts, SequentialMLP)
    with pytest.raises(ValueError, match="strict mode"):
        _build(tiny_moe_dir, recipe=NVFP4Recipe(strict_ops=True), grouped_experts=True)


def test_forward_is_sequential_mlps_up_to_the_activation_rounding(tiny_moe_dir):
    """In the first MoE layer each expert's gate/up (fc1) inputs and outputs are bitwise
    SequentialMLP's (later layers see the first layer's different output); with the
    sampler's SwiGLU in SequentialMLP's experts too, every captured tensor (down_proj included),
    every MoE output and the log-probs are bitwise equal. With Megatron's own activation
    (bf16(bf16(silu(gate)) * up)) the first MoE layer's output differs through that rounding
    alone (it flips some NVFP4 codes of the down_proj input): metric relative L2 distance of
    that output, bound 0.05 (measured 0.019 here, 0.02-0.035 on other sequences)."""
    from minite_megatron.capture import capture_layers

    grouped = _build(tiny_moe_dir, grouped_experts=True)
    sequential = _build(tiny_moe_dir)
    ids = TOKENS[0]
    ours, theirs = capture_layers(grouped, ids), capture_layers(sequential, ids)
    assert ours.keys() == theirs.keys()
    first = "model.layers.0.mlp.experts."
    fc1 = [n for n in ours if n.startswith(first) and ("gate_proj" in n or "up_proj" in n)]
    assert len(fc1) == 8 * 2 * 2  # experts x (gate, up) x (input, output)
    for name in fc1:
        assert torch.equal(ours[name], theirs[name]), name
    out, ref = ours["model.layers.0.mlp:output"], theirs["model.layers.0.mlp:output"]
    assert not torch.equal(out, ref)
    assert ((out.float() - ref.float()).norm() / ref.float().norm()).item() < 0.05
    _sampler_activation(sequential)
    theirs = capture_layers(sequential, ids)
    for name, tensor in ours.items():
        assert torch.equal(tensor, theirs[name]), name


def test_gradients_are_sequential_mlps(tiny_moe_dir):
    """Nearest rounding: every parameter gradient is bitwise SequentialMLP's (same activation).
    Stochastic rounding (default recipe; the two draw different random numbers): metric the
    relative L2 distance of each expert weight's gradient from the (common) nearest-rounding
    gradient; bound: grouped within 15% of SequentialMLP's distance, and cosine similarity of
    the two models' expert gradients >= 0.9 (measured over seeds: 0.16-0.28 vs 0.16-0.28,
    within 3%; cosine 0.96)."""
    from minite_common import NVFP4Recipe

    nearest = NVFP4Recipe(grad_stochastic_rounding=False)
    grads = {}
    for recipe in (nearest, NVFP4Recipe()):
        grouped = _build(tiny_moe_dir, recipe=recipe, grouped_experts=True)
        sequential = _build(tiny_moe_dir, recipe=recipe)
        _sampler_activation(sequential)
        lp = _loss_backward(grouped, 0)
        assert torch.equal(lp, _loss_backward(sequential, 1))
        grads[recipe] = (_grads(grouped), _grads(sequential))
    ours, theirs = grads[nearest]
    assert ours.keys() == theirs.keys()
    for name, g in ours.items():
        assert torch.equal(g, theirs[name]), name
    sr_ours, sr_theirs = grads[NVFP4Recipe()]
    experts = [n for n in ours if ".experts." in n]
    assert len(experts) == 4

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return ((a.float() - b.float()).norm() / b.float().norm()).item()

    for name in experts:
        mine, reference = rel(sr_ours[name], ours[name]), rel(sr_theirs[name], ours[name])
        assert 0.01 < mine < 1.15 * reference, (name, mine, reference)
    a = torch.cat([sr_ours[n].float().flatten() for n in experts])
    b = torch.cat([sr_theirs[n].float().flatten() for n in experts])
    assert torch.nn.functional.cosine_similarity(a, b, dim=0).item() >= 0.9


def test_hf_load_export_round_trip(tiny_moe_dir, tmp_path):
    """BF16 export is the checkpoint; quantized export is SequentialMLP's and per HF tensor
    ``quantize_weight``'s; an export of changed weights loads back into both module kinds."""
    import shutil

    from safetensors.torch import save_file

    from minite_common import DEFAULT_RECIPE, quantize_weight
    from minite_common.checkpoint import nvfp4_from_state
    from minite_megatron import export_hf_weights
    from minite_megatron.hf import HFCheckpoint

    grouped = _build(tiny_moe_dir, grouped_experts=True)
    ckpt = HFCheckpoint(tiny_moe_dir)
    exported = dict(export_hf_weights(grouped))
    assert exported.keys() == ckpt.names()
    for name, tensor in exported.items():
        assert torch.equal(tensor, ckpt.read(name)), name
    quantized = dict(export_hf_weights(grouped, quantized=True))
    reference = dict(export_hf_weights(_build(tiny_moe_dir), quantized=True))
    assert list(quantized) == list(reference)
    for name, tensor in quantized.items():
        raw = tensor.reshape(-1).view(torch.uint8)
        assert torch.equal(raw, reference[name].reshape(-1).view(torch.uint8)), name
    name = "model.layers.1.mlp.experts.5.up_proj"
    w = ckpt.read(f"{name}.weight")
    w_q = nvfp4_from_state(name, quantized, tuple(w.shape), DEFAULT_RECIPE)
    assert _same_nvfp4(w_q, quantize_weight(w))

    with torch.no_grad():
        for layer in grouped.decoder.layers:
            layer.mlp.experts.linear_fc2.weight.mul_(2)
            layer.mlp.experts.linear_fc1.weight[3].neg_()
    out = tmp_path / "export"
    shutil.copytree(tiny_moe_dir, out)
    save_file({n: t.contiguous() for n, t in export_hf_weights(grouped)}, out / "model.safetensors")
    reloaded = _build(out, grouped_experts=True)
    for (n, p), (_, q) in zip(grouped.named_parameters(), reloaded.named_parameters(), strict=True):
        assert torch.equal(p, q), n
    sequential = _build(out)
    for layer, other in zip(grouped.decoder.layers, sequential.decoder.layers, strict=True):
        for e, expert in enumerate(other.mlp.experts.local_experts):
            assert torch.equal(expert.linear_fc1.weight, layer.mlp.experts.linear_fc1.weight[e])
            assert torch.equal(expert.linear_fc2.weight, layer.mlp.experts.linear_fc2.weight[e])


def test_checkpoint_layout_is_sequential_mlps(tiny_moe_dir):
    """The distributed-checkpoint weights of the grouped experts are SequentialMLP's global
    tensors under SequentialMLP's keys (chunks assembled at their global offsets)."""
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    metadata = {"dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True)}

    def global_tensors(model) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for item in model.sharded_state_dict(metadata=metadata).values():
            pieces = item.build() if isinstance(item, ShardedTensorFactory) else item
            for piece in pieces if isinstance(pieces, list) else [pieces]:
                if not isinstance(piece, ShardedTensor) or ".experts." not in piece.key:
                    continue
                full = out.setdefault(piece.key, torch.zeros(piece.global_shape, dtype=piece.dtype))
                shape = (1,) * piece.prepend_axis_num + tuple(piece.local_shape)
                at = zip(piece.global_offset, shape, strict=True)
                full[tuple(slice(o, o + size) for o, size in at)] = piece.data.reshape(shape)
        return out

    ours = global_tensors(_build(tiny_moe_dir, grouped_experts=True))
    theirs = global_tensors(_build(tiny_moe_dir))
    assert ours.keys() == theirs.keys() and len(ours) == 4
    for key, tensor in ours.items():
        assert torch.equal(tensor, theirs[key]), key


def test_stacked_weight_quantization_is_quantize_weight_per_hf_tensor(tiny_moe_dir):
    """The grouped linears' cached NVFP4 weights are, row for row, ``quantize_weight`` of each
    expert's HF tensors (each its own amax); ``quantize_stacked_weight`` too on tensors whose
    magnitudes differ by 10^6 (one all zero), and it names a tensor holding NaN."""
    from minite_common import cat_rows, quantize_stacked_weight, quantize_weight
    from minite_megatron.hf import HFCheckpoint

    grouped = _build(tiny_moe_dir, grouped_experts=True)
    ckpt = HFCheckpoint(tiny_moe_dir)
    for i, layer in enumerate(grouped.decoder.layers):
        prefix = f"model.layers.{i}.mlp.experts"
        for linear, parts in (
            (layer.mlp.experts.linear_fc1, ("gate_proj", "up_proj")),
            (layer.mlp.experts.linear_fc2, ("down_proj",)),
        ):
            names = [f"{prefix}.{e}.{part}.weight" for e in range(8) for part in parts]
            expected = cat_rows([quantize_weight(ckpt.read(name)) for name in names])
            assert _same_nvfp4(linear.quantized_weight(), expected)
    g = torch.Generator().manual_seed(0)
    scale = torch.tensor([1e-3, 1.0, 0.0, 1e3, 7.5]).repeat_interleave(32)[:, None]
    w = (torch.randn(5 * 32, 48, generator=g) * scale).to(torch.bfloat16)
    parts = [quantize_weight(w[s * 32 : (s + 1) * 32]) for s in range(5)]
    assert _same_nvfp4(quantize_stacked_weight(w, 32), cat_rows(parts))
    w[70, 3] = float("nan")
    with pytest.raises(ValueError, match="expert 2"):
        quantize_stacked_weight(w, 32, names=[f"expert {s}" for s in range(5)])


def test_optimizer_steps_reduce_loss_and_refresh_the_stacked_weights(tiny_moe_dir):
    from minite_megatron import token_logprobs

    model = _build(tiny_moe_dir, grouped_experts=True)
    fc1 = model.decoder.layers[1].mlp.experts.linear_fc1
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(4):
        loss = -token_logprobs(model, TOKENS).mean()
        optimizer.zero_grad()
        loss.backward()
        before = fc1.quantized_weight()
        optimizer.step()
        after = fc1.quantized_weight()
        assert after is not before and _same_nvfp4(after, fc1.quantize(fc1.weight))
        losses.append(loss.item())
    final = -token_logprobs(model, TOKENS).mean().item()
    assert final < 0.9 * losses[0], losses


def test_execution_fingerprints_report_every_expert_as_nvfp4(tiny_moe_dir):
    from minite_common import DEFAULT_RECIPE
    from minite_common.checkpoint import quantization_config
    from minite_megatron import hf_quantization_config
    from minite_megatron.capture import execution_fingerprints

    grouped = _build(tiny_moe_dir, grouped_experts=True)
    fps = execution_fingerprints(grouped)
    assert execution_fingerprints(_build(tiny_moe_dir)) == fps
    assert fps["model.layers.1.mlp.experts.7.down_proj"]["mode"] == "nvfp4"
    assert hf_quantization_config(grouped) == quantization_config(DEFAULT_RECIPE)


# ---- the grouped kernels in Triton's interpreter (each check in a subprocess) ----

CHECKS = ["stacked_weight", "grad_operands", "hopper_backward"]


@pytest.mark.parametrize("check", CHECKS)
def test_grouped_kernels_in_interpreter(check: str) -> None:
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run(
        [sys.executable, __file__, check], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]


SIZES = (5, 0, 70, 3, 16)  # ragged: empty, one tile, two tiles, under 16 rows


def check_stacked_weight() -> None:
    """One launch for all tensors, each its own amax: quantize_weight's bytes per tensor."""
    from minite_kernels.nvfp4_grouped import quantize_stacked_weight

    from minite_common import cat_rows, quantize_weight

    g = torch.Generator().manual_seed(0)
    scale = torch.tensor([1.0, 10.0, 0.0, 1e-3]).repeat_interleave(32)[:, None]
    w = (torch.randn(4 * 32, 48, generator=g) * scale).to(torch.bfloat16)
    amax = w.reshape(4, -1).abs().amax(1).float().repeat_interleave(32)
    codes, scales, decode = quantize_stacked_weight(w, amax)
    ref = cat_rows([quantize_weight(w[s * 32 : (s + 1) * 32]) for s in range(4)])
    assert torch.equal(codes, ref.codes)
    assert torch.equal(scales.view(torch.uint8), ref.scales.view(torch.uint8))
    assert torch.equal(decode, ref.decode_scale)


def check_grad_operands() -> None:
    """Per group, bitwise quantize_grad_operands of that group's rows alone (nearest rounding,
    with and without the RHT); empty groups get decode scales of 1."""
    from minite_kernels.nvfp4_grad import quantize_grad_operands
    from minite_kernels.nvfp4_grouped import group_layout, quantize_grouped_grad_operands

    g = torch.Generator().manual_seed(1)
    c = 48
    x = torch.randn(sum(SIZES), c, generator=g) * torch.rand(sum(SIZES), 1, generator=g) * 4
    x = x.to(torch.bfloat16)
    scale = torch.rand(len(SIZES) * c, generator=g) + 0.5
    _, starts, pstarts = group_layout(SIZES, x.device)
    for rht in (None, RHT_SIGNS):
        row, col, dec = quantize_grouped_grad_operands(
            x, SIZES, row=True, row_scale=scale, col=True, rht_signs=rht
        )
        assert col.shape == (sum(-(-s // 16) * 16 for s in SIZES), c)
        for e, size in enumerate(SIZES):
            if not size:
                assert torch.equal(dec[e], torch.ones(2))
                continue
            r, cc, d = quantize_grad_operands(
                x[starts[e] : starts[e] + size],
                row=True,
                row_scale=scale[e * c : (e + 1) * c],
                col=True,
                rht_signs=rht,
            )
            assert torch.equal(r, row[starts[e] : starts[e] + size])
            assert torch.equal(cc, col[pstarts[e] : pstarts[e] + cc.shape[0]])
            assert torch.equal(d, dec[e])


def check_hopper_backward() -> None:
    """The Hopper grouped backward (grouped operand kernels, per-expert GEMMs, vectorized
    epilogues) against the per-expert torch backward, nearest rounding: dX bitwise, dW within
    float32 summation order (GEMMs here in float32 on the exact BF16 operand values)."""
    import minite_common.grouped as grouped
    from minite_common import NVFP4Recipe, quantize_stacked_weight

    grouped._autograd.mm_f32 = lambda a, b, out=None: out.copy_(a.float() @ b.float())
    g = torch.Generator().manual_seed(2)
    sizes, n, k = [5, 0, 40], 32, 48
    w = (torch.randn(len(sizes) * n, k, generator=g) / 8).to(torch.bfloat16)
    x = torch.randn(sum(sizes), k, generator=g).to(torch.bfloat16)
    dy = torch.randn(sum(sizes), n, generator=g) * torch.rand(sum(sizes), 1, generator=g)
    dy = dy.to(torch.bfloat16)
    for rht in (False, True):
        recipe = NVFP4Recipe(grad_stochastic_rounding=False, wgrad_rht=rht)
        w_q = quantize_stacked_weight(w, n // 2, recipe=recipe)
        args = (dy, x, w_q, sizes, recipe, True, True, torch.bfloat16, torch.float32)
        hx, hw = grouped._hopper_backward(*args)
        lx, lw = grouped._looped_backward(*args)
        assert torch.equal(hx, lx)
        assert ((hw - lw).norm() / lw.norm()).item() < 1e-6


if __name__ == "__main__":
    globals()[f"check_{sys.argv[1]}"]()
