"""Streamed weight sync (minite_common.weight_sync) on its own over gloo, and into vLLM's real CPU
engine: bitwise equal to the learner's tensors and to a freshly loaded engine, bucket sizes from
below one tensor to above the model, and every failure leaving the old weights serving bitwise."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator

import cloudpickle
import pytest
import torch
from safetensors.torch import load_file, save_file

from minite.alignment import start_sampler, stop_sampler
from minite.tiny_model import TinyModelSpec, write_tiny_model
from minite_common import DEFAULT_RECIPE, quantize_weight, weight_sync
from minite_common.checkpoint import nvfp4_to_state
from minite_vllm import unpack_weights
from minite_vllm.sync import connect_weight_sync, free_port, sync_weights

# The digest of every parameter is read by a small function sent to the worker by value.
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
cloudpickle.register_pickle_by_value(sys.modules[__name__])

FINGERPRINT = DEFAULT_RECIPE.fingerprint()
PROMPTS = ["Hello world", "The quick brown fox", "0123456789"]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype.itemsize == 1 else t


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


# -- the transport alone: ranks in threads of this process -----------------------------------


class Recorder:
    """A receiver that keeps copies of what arrives and refuses ``refuse`` (a name)."""

    def __init__(self, refuse: str | None = None) -> None:
        self.refuse, self.staged, self.live = refuse, None, {}
        self.events: list[str] = []

    def begin(self, header: weight_sync.Header) -> None:
        self.header, self.staged = header, {}

    def stage(self, name: str, tensor: torch.Tensor) -> None:
        if name == self.refuse:
            raise ValueError(f"refused {name}")
        self.staged[name] = tensor.clone()

    def finish(self) -> None:
        self.events.append("finish")

    def commit(self) -> None:
        self.live, self.staged = self.staged, None
        self.events.append("commit")

    def discard(self) -> None:
        self.staged = None
        self.events.append("discard")


def run_ranks(world: int, work: Callable[[int, weight_sync.Channel], object]) -> list[object]:
    """Connect ``world`` gloo ranks (threads) and run ``work(rank, channel)`` on each; returns
    each rank's result or exception."""
    port = free_port()
    results: list[object] = [None] * world

    def rank_main(rank: int) -> None:
        try:
            channel = weight_sync.connect("127.0.0.1", port, rank, world, timeout_s=30)
            results[rank] = work(rank, channel)
        except BaseException as e:
            results[rank] = e

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return results


def sample_tensors() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        ("a.weight", torch.randn(33, 48, generator=g).to(torch.bfloat16)),
        ("a.weight_scale_2", torch.tensor(0.125)),
        ("b.codes", torch.randint(0, 256, (7,), dtype=torch.uint8, generator=g)),
        ("b.scales", torch.rand(16, 3, generator=g).to(torch.float8_e4m3fn)),
        ("empty", torch.empty(0, 5)),
        ("c.weight", torch.randn(300, generator=g)),
        ("d.half", torch.randn(5, 3, generator=g).half()),
    ]


@pytest.mark.parametrize("bucket_bytes", [16, 48, 1 << 20])
def test_transport_delivers_every_tensor_bitwise(bucket_bytes):
    """Buckets smaller than one tensor (16, 48 bytes), and larger than all of them; two
    receivers; 0-d, empty, odd-sized and every carried dtype."""
    tensors = sample_tensors()
    receivers = {1: Recorder(), 2: Recorder()}

    def work(rank, channel):
        if rank == 0:
            return weight_sync.send_weights(
                channel, iter(tensors), payload="bf16", recipe_fingerprint=FINGERPRINT,
                bucket_bytes=bucket_bytes,
            )  # fmt: skip
        return weight_sync.receive_weights(channel, receivers[rank])

    sent, *got = run_ranks(3, work)
    assert isinstance(sent, weight_sync.SyncStats) and sent.committed, sent
    payload = sum(t.numel() * t.element_size() for _, t in tensors)
    assert sent.payload_bytes == payload and sent.tensors == len(tensors)
    assert all(g.payload_bytes == payload and g.buckets == sent.buckets for g in got), got
    if bucket_bytes == 1 << 20:
        assert sent.buckets == 1
    else:  # every bucket but the last is full
        assert sent.buckets == -(-sent.wire_bytes // bucket_bytes)
    for r in receivers.values():
        assert r.header == weight_sync.Header("bf16", FINGERPRINT, bucket_bytes)
        assert list(r.live) == [n for n, _ in tensors]
        assert all(same(r.live[n], t) for n, t in tensors)
        assert r.events == ["finish", "commit"]


def test_a_refusal_on_one_rank_commits_nowhere_and_the_group_stays_usable():
    tensors = sample_tensors()
    receivers = {1: Recorder(refuse="c.weight"), 2: Recorder()}

    def work(rank, channel):
        def sync():
            if rank == 0:
                return weight_sync.send_weights(channel, iter(tensors), bucket_bytes=32)
            try:
                return weight_sync.receive_weights(channel, receivers[rank])
            except Exception as e:
                return e

        first = sync()
        receivers.get(rank, Recorder()).refuse = None
        return first, sync()

    (sent1, sent2), (got1, again1), (got2, again2) = run_ranks(3, work)
    assert sent1.committed is False and sent1.tensors == len(tensors)
    assert isinstance(got1, ValueError) and "refused c.weight" in str(got1)
    assert isinstance(got2, ValueError) and "another receiving rank refused" in str(got2)
    assert sent2.committed and again1.tensors == again2.tensors == len(tensors)
    assert receivers[1].events == ["discard", "finish", "commit"]  # it stopped staging at once
    assert receivers[2].events == ["finish", "discard", "finish", "commit"]  # after the vote
    for r in receivers.values():
        assert all(same(r.live[n], t) for n, t in tensors)


def test_a_sender_that_fails_while_producing_aborts_everywhere():
    def broken() -> Iterator[tuple[str, torch.Tensor]]:
        yield "a", torch.ones(100)
        raise RuntimeError("the learner's exporter failed")

    receiver = Recorder()

    def work(rank, channel):
        def sync(weights):
            try:
                if rank == 0:
                    return weight_sync.send_weights(channel, weights, bucket_bytes=64)
                return weight_sync.receive_weights(channel, receiver)
            except Exception as e:
                return e

        return sync(broken()), sync(iter(sample_tensors()))

    (sent, sent_again), (got, got_again) = run_ranks(2, work)
    assert isinstance(sent, RuntimeError) and "exporter failed" in str(sent)
    assert isinstance(got, weight_sync.WeightSyncAborted) and "exporter failed" in str(got)
    assert sent_again.committed and got_again.committed
    assert receiver.events == ["discard", "finish", "commit"]


def test_bad_arguments_are_refused_clearly():
    with pytest.raises(ValueError, match="bucket_bytes=24 must be a positive multiple of 16"):
        weight_sync._check_bucket_bytes(24)
    with pytest.raises(ValueError, match="at least one receiver"):
        weight_sync.connect("127.0.0.1", 1, 0, 1)
    with pytest.raises(ValueError, match="backend 'mpi'"):
        weight_sync.connect("127.0.0.1", 1, 0, 2, backend="mpi")


# -- into vLLM's CPU engine -----------------------------------------------------------------


def _digest(self) -> dict[str, str]:
    """sha256 of every parameter and buffer of the worker's model (runs in the worker)."""
    model = self.model_runner.get_model()
    tensors = dict(model.named_parameters()) | dict(model.named_buffers())
    return {
        n: hashlib.sha256(t.detach().contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()
        for n, t in tensors.items()
    }


def greedy(llm) -> list[tuple[list[int], list[float]]]:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=8, temperature=0, logprobs=1)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [
        (list(c.token_ids), [d[t].logprob for t, d in zip(c.token_ids, c.logprobs, strict=True)])
        for c in (o.outputs[0] for o in outs)
    ]


def learner_nvfp4(hf: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """What a learner sends: each linear weight as ``quantize_weight``'s checkpoint tensors, the
    embeddings, LM head and norms in BF16."""
    for name, t in hf.items():
        if t.dim() == 2 and "embed" not in name and "lm_head" not in name and "gate." not in name:
            yield from nvfp4_to_state(name.removesuffix(".weight"), quantize_weight(t)).items()
        else:
            yield name, t


def sampler_nvfp4(llm) -> dict[str, torch.Tensor]:
    return unpack_weights(llm.collective_rpc("get_quantized_weights")[0])


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("sync")
    a = write_tiny_model(root / "a", seed=0)
    b = write_tiny_model(root / "b", seed=1)
    fresh = start_sampler(b, max_num_seqs=4)  # what an engine loaded from B generates
    expected = greedy(fresh)
    stop_sampler(fresh)
    return a, b, expected


@pytest.fixture(scope="module")
def engine(models):
    llm = start_sampler(models[0], max_num_seqs=4)
    yield llm
    stop_sampler(llm)


def test_nvfp4_sync_gives_the_learner_bits_and_a_fresh_engine_output(models, engine):
    """Buckets of 256 bytes (smaller than almost every tensor): the sampler holds exactly
    ``quantize_weight`` of B's tensors and generates what an engine loaded from B does."""
    a, b, expected_b = models
    hf_b = load_file(b / "model.safetensors")
    stats = sync_weights(engine, learner_nvfp4(hf_b), recipe_fingerprint=FINGERPRINT,
                         bucket_bytes=256)  # fmt: skip
    sent = dict(learner_nvfp4(hf_b))
    assert stats.committed and stats.tensors == len(sent) and stats.buckets > len(sent) / 2
    held = sampler_nvfp4(engine)
    assert held and all(same(t, sent[n].reshape(t.shape)) for n, t in held.items())
    assert greedy(engine) == expected_b
    # Back to A in BF16, one bucket larger than the model: vLLM re-quantizes to the same bits.
    hf_a = load_file(a / "model.safetensors")
    stats = sync_weights(engine, hf_a.items(), payload="bf16", bucket_bytes=64 << 20)
    assert (
        stats.committed
        and stats.buckets == 1
        and stats.payload_bytes == sum(t.numel() * t.element_size() for t in hf_a.values())
    )
    sent = dict(learner_nvfp4(hf_a))
    assert all(same(t, sent[n].reshape(t.shape)) for n, t in sampler_nvfp4(engine).items())


def _corrupt(case: str, weights: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """The update with one bad tensor near its end (so several buckets were staged before)."""
    out = list(weights)
    i = max(j for j, (n, _) in enumerate(out) if n.endswith(f"{case_suffix(case)}"))
    name, t = out[i]
    if case == "shape":
        t = t[:-16]
    elif case == "dtype":
        t = t.to(torch.bfloat16)
    elif case == "nan_scale":
        t = t.clone()
        t.view(torch.uint8)[3, 0] = 0x7F  # E4M3 NaN
    elif case == "nan_global_scale":
        t = torch.tensor(float("nan"))
    elif case == "unknown_name":
        name = name.replace("layers", "layerz")
    elif case == "missing_scale":
        out.pop(i)
        return out
    out[i] = (name, t)
    return out


def case_suffix(case: str) -> str:
    return {"nan_scale": ".weight_scale", "nan_global_scale": ".weight_scale_2",
            "missing_scale": ".weight_scale"}.get(case, "proj.weight")  # fmt: skip


@pytest.mark.parametrize(
    "case, message",
    [
        ("shape", "expected torch.uint8"),
        ("dtype", "expected torch.uint8"),
        ("nan_scale", "NaN"),
        ("nan_global_scale", "NaN"),
        ("unknown_name", "layerz"),
        ("missing_scale", "lacks"),
        ("fingerprint", "weight sync"),
        ("bf16_nan", "NaN/Inf"),
    ],
)
def test_a_bad_tensor_in_any_bucket_rejects_the_whole_update(models, engine, case, message):
    a, b, _ = models
    before, outputs = engine.collective_rpc(_digest)[0], greedy(engine)
    hf_b = load_file(b / "model.safetensors")
    fingerprint, payload = FINGERPRINT, "nvfp4"
    if case == "fingerprint":
        weights, fingerprint = list(learner_nvfp4(hf_b)), "nvfp4-v1-other"
    elif case == "bf16_nan":
        weights, payload = list(hf_b.items()), "bf16"
        name = [n for n in hf_b if n.endswith("down_proj.weight")][-1]
        weights = [(n, t.clone().fill_(float("nan")) if n == name else t) for n, t in weights]
    else:
        weights = _corrupt(case, list(learner_nvfp4(hf_b)))
    with pytest.raises(Exception, match=message):
        sync_weights(engine, iter(weights), payload=payload, recipe_fingerprint=fingerprint,
                     bucket_bytes=4096)  # fmt: skip
    assert engine.collective_rpc(_digest)[0] == before
    assert greedy(engine) == outputs


SENDER = """
import os, sys, time
from safetensors.torch import load_file, save_file
from minite_common import weight_sync

port, path, mode, timeout_s, fingerprint = sys.argv[1:]
tensors = load_file(path)
print("ready", flush=True)
channel = weight_sync.connect("127.0.0.1", int(port), 0, 2, timeout_s=float(timeout_s))

def weights():
    for i, item in enumerate(tensors.items()):
        if i == 20:  # a few buckets are out
            if mode == "dies":
                os._exit(3)
            time.sleep(120)
        yield item

weight_sync.send_weights(channel, weights(), recipe_fingerprint=fingerprint, bucket_bytes=1024)
"""


@pytest.mark.parametrize("mode", ["dies", "stalls"])
def test_a_sender_lost_mid_stream_leaves_the_old_weights_and_the_next_sync_works(
    models, engine, mode, tmp_path
):
    """The learner's sending process dies (the group breaks at once) or stalls (the group times
    out) after some buckets: the sampler keeps its weights bitwise, then a new group syncs."""
    a, b, expected_b = models
    before = engine.collective_rpc(_digest)[0]
    hf_b = load_file(b / "model.safetensors")
    update = tmp_path / "update.safetensors"
    save_file(dict(learner_nvfp4(hf_b)), update)
    port, timeout_s = free_port(), 4.0
    sender = subprocess.Popen(
        [sys.executable, "-c", SENDER, str(port), str(update), mode, str(timeout_s), FINGERPRINT],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert sender.stdout.readline().strip() == "ready"
        engine.collective_rpc("init_weight_sync", args=("127.0.0.1", port, 2, 1, "gloo", timeout_s))
        with pytest.raises(Exception, match="the group broke"):
            engine.collective_rpc("receive_weights")
    finally:
        sender.kill()
        sender.wait()
    assert engine.collective_rpc(_digest)[0] == before
    with pytest.raises(Exception, match="no sync group"):  # the broken group was closed
        engine.collective_rpc("receive_weights")
    connect_weight_sync(engine)
    assert sync_weights(engine, learner_nvfp4(hf_b), recipe_fingerprint=FINGERPRINT).committed
    assert greedy(engine) == expected_b


def test_moe_sync_from_a_megatron_learner(tmp_path, megatron_world):
    """A tiny Qwen3-MoE: the Megatron learner's quantized export streams into vLLM and the
    sampler then holds exactly the learner's NVFP4 tensors, every expert's included."""
    from minite.alignment import sync_weights as learner_sync
    from minite.alignment import weights_in_sync
    from minite_megatron import build_gpt_model_from_hf

    a = write_tiny_model(tmp_path / "a", TinyModelSpec(moe=True), seed=0)
    b = write_tiny_model(tmp_path / "b", TinyModelSpec(moe=True), seed=1)
    learner = build_gpt_model_from_hf(b)
    llm = start_sampler(a, max_num_seqs=4)
    try:
        assert not weights_in_sync(llm, learner)
        stats = learner_sync(llm, learner, bucket_bytes=8192)
        assert stats.committed and stats.buckets > 1
        assert weights_in_sync(llm, learner)
    finally:
        stop_sampler(llm)
