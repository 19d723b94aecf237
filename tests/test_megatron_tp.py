"""Tensor parallelism: TP=2 with two gloo processes against the TP=1 / sampler results."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from minite_common import quantize_weight, row_amax, w4a4_linear
from minite_common.checkpoint import nvfp4_to_state
from minite_megatron import build_gpt_model_from_hf, export_hf_weights, init_megatron
from minite_megatron import token_logprobs as learner_logprobs
from minite_megatron.hf import HFCheckpoint, weight_bindings
from minite_megatron.linear import NVFP4LinearMixin
from tests.tp_workers import run_ranks

TP = 2


def _tokens() -> torch.Tensor:
    return torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))


def _gather(t: torch.Tensor, group) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(TP)]
    dist.all_gather(out, t.contiguous(), group=group)
    return out


def _check_quantized_export(model, ckpt: HFCheckpoint) -> None:
    """The quantized export (what a weight sync sends), gathered from each rank's NVFP4 shards,
    is bitwise ``quantize_weight`` of every whole HF tensor."""
    quantized = dict(export_hf_weights(model, quantized=True))
    prefixes = [n.removesuffix(".weight_scale_2") for n in quantized if n.endswith("_scale_2")]
    assert prefixes
    for prefix in prefixes:
        expected = nvfp4_to_state(prefix, quantize_weight(ckpt.read(f"{prefix}.weight")))
        for name, tensor in expected.items():
            bits = lambda t: t.view(torch.uint8) if t.dtype.itemsize == 1 else t
            got = quantized[name]
            assert got.dtype == tensor.dtype and torch.equal(bits(got), bits(tensor)), name


def _check_linears(model, hf_dir: Path, rank: int) -> float:
    """Column-parallel outputs equal the sampler's per-HF-tensor W4A4 outputs bitwise. Row-
    parallel weight shards are the full tensor's quantization, column slice by column slice,
    and the output is bitwise the BF16 sum of each rank's W4A4 linear on its K slice quantized
    with the whole row's amax; returns the row-parallel outputs' largest difference from TP=1,
    relative to the largest output."""
    ckpt = HFCheckpoint(hf_dir)
    x = torch.randn(3, 2, 256, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    worst_row = 0.0
    for b in weight_bindings(model):
        module = b.module
        if not isinstance(module, NVFP4LinearMixin):
            continue
        with torch.no_grad():
            if b.kind == "column":
                k = module.input_size
                shards = _gather(module(x[..., :k])[0], module.tp_group)
                for part, name in b.hf_names.items():
                    expected = w4a4_linear(x[..., :k], quantize_weight(ckpt.read(name)))
                    for r in range(TP):
                        for s in b.segments(r, TP):
                            if s.part == part:
                                got = shards[r][..., s.local_start : s.local_start + s.rows]
                                want = expected[..., s.hf_start : s.hf_start + s.rows]
                                assert torch.equal(got, want), (name, r)
                continue
            full_q = quantize_weight(ckpt.read(b.hf_names["weight"]))
            k = module.input_size_per_partition
            mine = module.quantized_weight()
            assert torch.equal(mine.codes, full_q.codes[:, rank * k // 2 : (rank + 1) * k // 2])
            scales = full_q.scales.view(torch.uint8)[:, rank * k // 16 : (rank + 1) * k // 16]
            assert torch.equal(mine.scales.view(torch.uint8), scales)
            assert torch.equal(mine.channel_decode_scale(), full_q.channel_decode_scale())
            x_mine = x[..., rank * k : (rank + 1) * k]
            y = module(x_mine)[0]
            if module.explicit_expert_comm:  # experts leave the sum to the token dispatcher
                dist.all_reduce(y, group=module.tp_group)
            whole_row = row_amax(x[..., : module.input_size])
            partials = _gather(w4a4_linear(x_mine, mine, row_amax=whole_row), module.tp_group)
            assert torch.equal(y, partials[0] + partials[1]), b.hf_names
            y_tp1 = w4a4_linear(x[..., : module.input_size], full_q).float()
            worst_row = max(worst_row, ((y.float() - y_tp1).abs().max() / y_tp1.abs().max()).item())
    return worst_row


def _tp_worker(rank: int, world: int, dense_dir: str, moe_dir: str, reference: str) -> None:
    init_megatron(world)
    expected = torch.load(reference)
    for name, hf_dir in (("dense", Path(dense_dir)), ("moe", Path(moe_dir))):
        model = build_gpt_model_from_hf(hf_dir)
        worst_row = _check_linears(model, hf_dir, rank)
        print(f"{name}: row-parallel worst relative difference from TP=1 {worst_row:.3g}")
        assert worst_row < 0.02, (name, worst_row)  # BF16 rounding of the two partial sums
        if name == "moe":  # Megatron trains MoE under TP only with sequence parallelism,
            model.eval()  # which its CPU (torch) norms do not support: check inference
        lp = learner_logprobs(model, _tokens())
        diff = (lp.detach() - expected[name]).abs()
        print(f"{name}: log-prob |diff| from TP=1 mean {diff.mean():.3g} max {diff.max():.3g}")
        assert diff.mean().item() < 0.04 and diff.max().item() < 0.15, (name, diff)  # 0.015, 0.046
        exported = dict(export_hf_weights(model))
        ckpt = HFCheckpoint(hf_dir)
        assert exported.keys() == ckpt.names()
        assert all(torch.equal(t, ckpt.read(n)) for n, t in exported.items())
        _check_quantized_export(model, ckpt)
        if name == "dense":
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            (-lp.mean()).backward()
            optimizer.step()
            after = learner_logprobs(model, _tokens()).detach()
            assert (-after.mean()).item() < (-lp.mean()).item()
    parallel_state.destroy_model_parallel()


def test_tensor_parallel_2_matches_tp1(tiny_dense_dir, tiny_moe_dir, tmp_path):
    """Two gloo processes at TP=2, dense and MoE (expert TP=2): every column-parallel NVFP4
    linear (qkv, fc1, expert fc1) gives bitwise the TP=1 / sampler output; row-parallel weight
    shards are bitwise the full tensor's quantization, each output is bitwise the BF16 sum of
    the ranks' W4A4 linears on their K slices (quantized with the whole row's amax, so the
    codes are TP=1's) and within 2% of the largest TP=1 output; log-probs are close to TP=1's
    (mean |diff| < 0.04 nats); the gathered export is the checkpoint bitwise; for the dense
    model a backward and an SGD step run and lower the loss."""
    init_megatron(1)
    reference = {
        name: learner_logprobs(build_gpt_model_from_hf(d), _tokens()).detach()
        for name, d in (("dense", tiny_dense_dir), ("moe", tiny_moe_dir))
    }
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    torch.save(reference, tmp_path / "reference.pt")
    run_ranks(
        _tp_worker, TP, tmp_path, str(tiny_dense_dir), str(tiny_moe_dir),
        str(tmp_path / "reference.pt"),
    )  # fmt: skip
