"""A strict-mode sampler that drives miniTE's strict vLLM adapters the way vLLM does, without vLLM.

vLLM's CUDA build cannot be installed on the lent GPU machine, so the GPU end-to-end check of
strict mode (``tests/gpu/test_gpu_strict_e2e.py``) samples with :class:`StrictSampler` instead.

What it stands in for (written here, following vLLM 0.32's code):

- **the scheduler**: requests arrive at given steps and join the running batch; each step first
  gives every running request its next tokens (one for a decode, a chunk for a prompt still being
  prefilled), then admits waiting requests while the token budget and the sequence limit allow, so
  prompts are prefilled in chunks next to other requests' decode steps; a request leaves when it has
  its tokens, and its KV blocks go back to the pool for later requests. KV blocks come from a pool
  in a seeded random order (block tables are not contiguous). No preemption (a full pool raises),
  prefix caching, speculative decoding or CUDA graphs.
- **the model runner**: one flat batch per step: input ids, positions, ``query_start_loc``,
  ``seq_lens``, block table and slot mapping as vLLM's ``CommonAttentionMetadata`` holds them;
  logits only for each request's last scheduled token, when that token ends what it has.
- **the model code** (``Qwen3ForCausalLM`` / ``Qwen3MoeForCausalLM``): embedding lookup, decoder
  layers (input norm with its fused residual add, fused QKV projection, per-head q/k norm, rotary
  embedding, attention, output projection, post-attention norm, MLP or MoE block), final norm,
  LM head.
- **the sampler**: log-probs of the raw logits (what ``minite_vllm.engine_patches`` makes
  ``Sampler.compute_logprobs`` in a strict engine: :func:`minite_common.ops.log_softmax`), tokens
  drawn from ``softmax(logits / temperature)`` with a seeded ``torch.Generator``.

What runs for real: every op call of miniTE's strict adapters, in vLLM's order, on the tensors
vLLM would hand them: :func:`minite_common.w4a4_linear` on weights quantized as the ``minite``
quantization config does (each HF tensor on its own, merged with ``cat_rows``; the recipe's BF16
modules through :func:`minite_common.ops.linear`, as ``StrictBF16LinearMethod``), ``ops.rms_norm``
/ ``ops.add_rms_norm`` (``StrictRMSNorm``), ``ops.swiglu`` (``StrictSiluAndMul``),
``ops.linear`` for the LM head (``StrictLMHeadMethod``), and the adapters' own vLLM-free bodies
from :mod:`minite_vllm.strict_forward`: ``rotate`` (``StrictRotaryEmbedding``),
``write_kv_cache`` / ``cached_attention`` (``StrictAttentionImpl``: K/V written into and read back
from a paged cache through ``ops.paged_attention``) and ``routed_experts``
(``StrictMoEMethod``). On CUDA tensors those are miniTE's Triton kernels. Tensor parallelism 1.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Sequence
from pathlib import Path

import torch

from minite_common import NVFP4Recipe, NVFP4Tensor, cat_rows, grouped_w4a4_linear, ops, w4a4_linear
from minite_common.parallel import quantize_weight_shards
from minite_vllm.strict_forward import cached_attention, rotate, routed_experts, write_kv_cache


@dataclasses.dataclass
class SampledSequence:
    """One request's prompt, its sampled tokens and the sampler's float32 log-prob of each."""

    prompt: list[int]
    completion: list[int]
    logprobs: torch.Tensor


@dataclasses.dataclass
class ScheduleTrace:
    """What the scheduler did, step by step (for tests that check the coverage of a run)."""

    running: list[int] = dataclasses.field(default_factory=list)  # requests in each step
    tokens: list[int] = dataclasses.field(default_factory=list)  # tokens in each step
    prefill_chunks: list[int] = dataclasses.field(default_factory=list)  # chunks per request
    mixed_steps: int = 0  # steps with prefill chunks and decode steps together
    reused_blocks: int = 0  # block allocations of a block another request held before


@dataclasses.dataclass
class _Request:
    index: int
    prompt: list[int]
    max_tokens: int
    arrival: int
    forced: list[int] | None
    tokens: list[int] = dataclasses.field(default_factory=list)
    computed: int = 0
    blocks: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[torch.Tensor] = dataclasses.field(default_factory=list)
    chunks: int = 0

    @property
    def generated(self) -> int:
        return len(self.tokens) - len(self.prompt)


class _Linear:
    """A vLLM linear layer made of the HF weights ``names`` (merged q/k/v or gate/up, stacked
    along rows): NVFP4 through :func:`w4a4_linear`, or BF16 through :func:`ops.linear` when the
    recipe keeps all of them in high precision."""

    def __init__(
        self,
        state: dict[str, torch.Tensor],
        names: list[str],
        recipe: NVFP4Recipe,
        num_layers: int,
        device: torch.device,
    ) -> None:
        kept = [n for n in names if recipe.keeps_bf16(n, num_layers)]
        if kept and len(kept) != len(names):
            raise ValueError(f"{names}: the recipe keeps only {kept} in BF16 (vLLM fuses them)")
        self.recipe = recipe
        weights = [(f"{n}.weight", state[f"{n}.weight"].to(device)) for n in names]
        self.bf16 = torch.cat([w for _, w in weights]) if kept else None
        self.nvfp4 = None if kept else cat_rows(quantize_weight_shards(weights, recipe))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.nvfp4 is None:
            return ops.linear(x, self.bf16)
        return w4a4_linear(x, self.nvfp4, recipe=self.recipe)


def _rope_theta(config) -> float:
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise NotImplementedError(f"StrictSampler: rope_type {rope.get('rope_type')!r}")
    return float(rope.get("rope_theta", getattr(config, "rope_theta", 1e6)))


class StrictSampler:
    """Samples from the Qwen3 / Qwen3-MoE checkpoint in ``model_dir`` under the strict ``recipe``
    on ``device`` (see the module docstring for what is vLLM's and what is miniTE's).

    ``max_num_seqs`` and ``max_num_batched_tokens`` are vLLM's scheduler limits,
    ``max_prefill_chunk`` caps one prompt chunk (vLLM's ``long_prefill_token_threshold``);
    ``num_blocks`` KV blocks of ``block_size`` tokens per layer, handed out in a random order drawn
    from ``seed`` (the cache starts filled with random values: nothing may read a slot it did not
    write)."""

    def __init__(
        self,
        model_dir: str | Path,
        recipe: NVFP4Recipe,
        *,
        device: torch.device | str = "cpu",
        block_size: int = 16,
        num_blocks: int = 1024,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 512,
        max_prefill_chunk: int = 64,
        seed: int = 0,
    ) -> None:
        from safetensors.torch import load_file
        from transformers import AutoConfig

        if not recipe.strict_ops:
            raise ValueError("StrictSampler runs strict mode: pass a recipe with strict_ops=True")
        if max_num_batched_tokens < max_num_seqs:
            raise ValueError("max_num_batched_tokens must be >= max_num_seqs (one decode each)")
        self.device = torch.device(device)
        self.recipe = recipe
        self.block_size, self.num_blocks = block_size, num_blocks
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.max_prefill_chunk = max_prefill_chunk
        config = AutoConfig.from_pretrained(str(model_dir))
        self.moe = config.model_type == "qwen3_moe"
        if config.model_type not in ("qwen3", "qwen3_moe"):
            raise NotImplementedError(f"StrictSampler: model type {config.model_type!r}")
        if self.moe and (list(config.mlp_only_layers) or config.decoder_sparse_step != 1):
            raise NotImplementedError("StrictSampler: MoE models with dense layers")
        self.num_layers = config.num_hidden_layers
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.eps = config.rms_norm_eps
        self.rope_theta = _rope_theta(config)
        self.scale = self.head_dim**-0.5
        if self.moe:
            self.top_k, self.renormalize = config.num_experts_per_tok, config.norm_topk_prob
            self.num_experts = config.num_experts
        state: dict[str, torch.Tensor] = {}
        for path in sorted(Path(model_dir).glob("*.safetensors")):
            state.update(load_file(str(path)))
        self._load(state)
        g = torch.Generator().manual_seed(seed)
        self.kv_caches = [
            torch.randn(num_blocks, self.kv_heads, block_size, 2 * self.head_dim, generator=g).to(
                device=self.device, dtype=torch.bfloat16
            )
            for _ in range(self.num_layers)
        ]
        self.free_blocks = deque(torch.randperm(num_blocks, generator=g).tolist())
        self.ever_used: set[int] = set()

    def _load(self, state: dict[str, torch.Tensor]) -> None:
        def param(name: str) -> torch.Tensor:
            return state[name].to(self.device)

        def linear(*names: str) -> _Linear:
            return _Linear(state, list(names), self.recipe, self.num_layers, self.device)

        self.embed = param("model.embed_tokens.weight")
        self.norm = param("model.norm.weight")
        self.lm_head = param("lm_head.weight")  # StrictLMHeadMethod: ops.linear
        self.layers = []
        for i in range(self.num_layers):
            p = f"model.layers.{i}"
            attn, mlp = f"{p}.self_attn", f"{p}.mlp"
            layer = {
                "input_norm": param(f"{p}.input_layernorm.weight"),
                "post_norm": param(f"{p}.post_attention_layernorm.weight"),
                "q_norm": param(f"{attn}.q_norm.weight"),
                "k_norm": param(f"{attn}.k_norm.weight"),
                "qkv": linear(f"{attn}.q_proj", f"{attn}.k_proj", f"{attn}.v_proj"),
                "o": linear(f"{attn}.o_proj"),
            }
            if self.moe:
                experts = range(self.num_experts)
                names = [
                    f"{mlp}.experts.{e}.{w}" for e in experts for w in ("gate_proj", "up_proj")
                ]
                if any(self.recipe.keeps_bf16(n, self.num_layers) for n in names):
                    raise NotImplementedError(f"{mlp}: strict mode runs NVFP4 experts only")
                layer["gate"] = linear(f"{mlp}.gate")  # StrictBF16LinearMethod: ops.linear
                layer["w13"] = self._stacked(state, names)
                layer["w2"] = self._stacked(
                    state, [f"{mlp}.experts.{e}.down_proj" for e in experts]
                )
            else:
                layer["gate_up"] = linear(f"{mlp}.gate_proj", f"{mlp}.up_proj")
                layer["down"] = linear(f"{mlp}.down_proj")
            self.layers.append(layer)

    def _stacked(self, state: dict[str, torch.Tensor], names: list[str]) -> NVFP4Tensor:
        """Experts' weights as ``StrictMoEMethod.gemm_weight`` holds them: each HF tensor quantized
        on its own, stacked along rows."""
        weights = [(f"{n}.weight", state[f"{n}.weight"].to(self.device)) for n in names]
        return cat_rows(quantize_weight_shards(weights, self.recipe))

    # -- one forward step (vLLM's model code with the strict adapters) -----------------------

    def _attention(self, layer: dict, i: int, x: torch.Tensor, batch: dict) -> torch.Tensor:
        """``Qwen3Attention.forward`` with vLLM's ``Attention`` layer and the strict backend."""
        q_size, kv_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
        q, k, v = layer["qkv"](x).split([q_size, kv_size, kv_size], dim=-1)
        q_heads = q.view(*q.shape[:-1], self.heads, self.head_dim)
        q = ops.rms_norm(q_heads, layer["q_norm"], self.eps).view(q.shape)
        k_heads = k.view(*k.shape[:-1], self.kv_heads, self.head_dim)
        k = ops.rms_norm(k_heads, layer["k_norm"], self.eps).view(k.shape)
        q, k = rotate(batch["positions"], q, k, self.head_dim, self.head_dim, self.rope_theta)
        tokens = q.shape[0]
        output = torch.empty(tokens, q_size, dtype=q.dtype, device=q.device)
        query = q.view(-1, self.heads, self.head_dim)
        out_heads = output.view(-1, self.heads, self.head_dim)
        key = k.view(-1, self.kv_heads, self.head_dim)
        value = v.view(-1, self.kv_heads, self.head_dim)
        write_kv_cache(key, value, self.kv_caches[i], self.head_dim, batch["slot_mapping"])
        cached_attention(
            query, self.kv_caches[i], self.head_dim, batch["block_table"],
            batch["query_starts"], batch["seq_lens"], self.scale, out_heads,
        )  # fmt: skip
        return layer["o"](output)

    def _mlp(self, layer: dict, x: torch.Tensor) -> torch.Tensor:
        """``Qwen3MLP`` (gate/up, SiluAndMul, down) or ``Qwen3MoeSparseMoeBlock``."""
        if not self.moe:
            return layer["down"](ops.swiglu(layer["gate_up"](x)))
        router_logits = layer["gate"](x)

        def down(act: torch.Tensor, group_sizes: list[int]) -> torch.Tensor:
            return grouped_w4a4_linear(act, layer["w2"], group_sizes, recipe=self.recipe)

        return routed_experts(
            x, router_logits, self.top_k, self.renormalize, layer["w13"], down,
            self.num_experts, self.recipe,
        )  # fmt: skip

    def _logits(self, batch: dict) -> torch.Tensor:
        """BF16 logits of the batch's sampling rows (``Qwen3ForCausalLM`` + ``LogitsProcessor``)."""
        hidden = self.embed[batch["input_ids"]]
        residual = None
        for i, layer in enumerate(self.layers):
            if residual is None:
                residual = hidden
                hidden = ops.rms_norm(hidden, layer["input_norm"], self.eps)
            else:
                hidden, residual = ops.add_rms_norm(hidden, residual, layer["input_norm"], self.eps)
            hidden = self._attention(layer, i, hidden, batch)
            hidden, residual = ops.add_rms_norm(hidden, residual, layer["post_norm"], self.eps)
            hidden = self._mlp(layer, hidden)
        hidden, _ = ops.add_rms_norm(hidden, residual, self.norm, self.eps)
        return ops.linear(hidden[batch["logits_indices"]], self.lm_head)

    # -- scheduling ----------------------------------------------------------------------------

    def _allocate(self, request: _Request, length: int) -> None:
        while len(request.blocks) * self.block_size < length:
            if not self.free_blocks:
                raise RuntimeError(
                    f"StrictSampler: the {self.num_blocks} KV blocks are all in use (this driver "
                    "does not preempt); pass a larger num_blocks or fewer sequences at once"
                )
            block = self.free_blocks.popleft()
            self.trace.reused_blocks += block in self.ever_used
            self.ever_used.add(block)
            request.blocks.append(block)

    def _schedule(self, running: list[_Request], waiting: deque, step: int) -> list[tuple]:
        """vLLM's unified schedule: running requests first (decodes and unfinished prefills),
        then new ones, within the token budget; each gets ``(request, tokens)``."""
        budget, scheduled = self.max_num_batched_tokens, []

        def take(request: _Request) -> None:
            nonlocal budget
            n = min(len(request.tokens) - request.computed, budget)
            if request.computed < len(request.prompt):
                n = min(n, self.max_prefill_chunk)
                request.chunks += 1
            self._allocate(request, request.computed + n)
            scheduled.append((request, n))
            budget -= n

        for request in running:
            if budget == 0:
                break
            take(request)
        while (
            waiting and waiting[0].arrival <= step and budget and len(running) < self.max_num_seqs
        ):
            request = waiting.popleft()
            running.append(request)
            take(request)
        return scheduled

    def _batch(self, scheduled: list[tuple]) -> dict:
        """The model runner's flat batch for ``scheduled`` ``(request, tokens)`` pairs."""
        ids, positions, starts, seq_lens, sample_rows = [], [], [0], [], []
        width = max(len(r.blocks) for r, _ in scheduled)
        table = torch.zeros(len(scheduled), width, dtype=torch.int32)
        for row, (request, n) in enumerate(scheduled):
            ids += request.tokens[request.computed : request.computed + n]
            positions += range(request.computed, request.computed + n)
            starts.append(starts[-1] + n)
            seq_lens.append(request.computed + n)
            table[row, : len(request.blocks)] = torch.tensor(request.blocks, dtype=torch.int32)
            if request.computed + n == len(request.tokens):
                sample_rows.append(starts[-1] - 1)
        pos = torch.tensor(positions, dtype=torch.int64)
        rows = torch.repeat_interleave(
            torch.arange(len(scheduled)), torch.tensor([n for _, n in scheduled])
        )
        block = table[rows, pos // self.block_size].long()
        slots = block * self.block_size + pos % self.block_size
        dev = self.device
        return {
            "input_ids": torch.tensor(ids, dtype=torch.int64, device=dev),
            "positions": pos.to(dev),
            "slot_mapping": slots.to(dev),
            "block_table": table.to(dev),
            "query_starts": starts,
            "seq_lens": seq_lens,
            "logits_indices": torch.tensor(sample_rows, dtype=torch.int64, device=dev),
        }

    @torch.no_grad()
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_tokens: int | Sequence[int] | None = None,
        *,
        arrivals: Sequence[int] | None = None,
        temperature: float = 1.0,
        seed: int = 0,
        forced: Sequence[Sequence[int]] | None = None,
    ) -> tuple[list[SampledSequence], ScheduleTrace]:
        """Sample ``max_tokens`` tokens (per request or for all) after each prompt; request ``i``
        arrives at scheduler step ``arrivals[i]`` (default 0). With ``forced``, request ``i``
        takes the tokens ``forced[i]`` instead of sampling (its log-probs are still the
        sampler's). Returns the sequences in prompt order and the schedule's trace."""
        count = len(prompts)
        if forced is not None:
            limits = [len(f) for f in forced]
        elif max_tokens is None:
            raise ValueError("StrictSampler.generate: give max_tokens or forced completions")
        else:
            limits = [max_tokens] * count if isinstance(max_tokens, int) else list(max_tokens)
        arrivals = list(arrivals) if arrivals is not None else [0] * count
        if any(len(p) == 0 for p in prompts) or any(n < 1 for n in limits):
            raise ValueError("StrictSampler.generate: every prompt and max_tokens must be >= 1")
        requests = [
            _Request(
                i, list(p), limits[i], arrivals[i], None if forced is None else list(forced[i])
            )
            for i, p in enumerate(prompts)
        ]
        for r in requests:
            r.tokens = list(r.prompt)
        waiting = deque(sorted(requests, key=lambda r: (r.arrival, r.index)))
        running: list[_Request] = []
        generator = torch.Generator(device=self.device).manual_seed(seed)
        self.trace = ScheduleTrace()
        step = 0
        while waiting or running:
            if not running and waiting[0].arrival > step:
                step = waiting[0].arrival
            scheduled = self._schedule(running, waiting, step)
            batch = self._batch(scheduled)
            logits = self._logits(batch)
            sampling = [r for r, n in scheduled if r.computed + n == len(r.tokens)]
            self._trace(scheduled)
            for request, n in scheduled:
                request.computed += n
            if sampling:
                self._sample(sampling, logits, temperature, generator, running)
            step += 1
        self.trace.prefill_chunks = [r.chunks for r in requests]
        return [
            SampledSequence(r.prompt, r.tokens[len(r.prompt) :], torch.stack(r.logprobs))
            for r in requests
        ], self.trace

    def _sample(
        self,
        requests: list[_Request],
        logits: torch.Tensor,
        temperature: float,
        generator: torch.Generator,
        running: list[_Request],
    ) -> None:
        """vLLM's sampler on the logits rows of ``requests``: the strict log-probs of the raw
        logits, a token drawn from ``softmax(logits / temperature)`` (or the forced one); a
        request with all its tokens leaves and frees its blocks."""
        logprobs = ops.log_softmax(logits)  # Sampler.compute_logprobs in a strict engine
        probs = torch.softmax(logits.float() / temperature, dim=-1)
        tokens = torch.multinomial(probs, 1, generator=generator).flatten().tolist()
        for row, request in enumerate(requests):
            if request.forced is not None:
                tokens[row] = request.forced[request.generated]
        chosen = torch.tensor(tokens, dtype=torch.int64, device=logits.device)
        picked = logprobs.gather(-1, chosen[:, None]).flatten().cpu()
        for row, (request, token) in enumerate(zip(requests, tokens, strict=True)):
            request.tokens.append(token)
            request.logprobs.append(picked[row])
            if request.generated == request.max_tokens:
                running.remove(request)
                self.free_blocks.extend(request.blocks)
                request.blocks = []

    def _trace(self, scheduled: list[tuple]) -> None:
        self.trace.running.append(len(scheduled))
        self.trace.tokens.append(sum(n for _, n in scheduled))
        prefill = [r.computed < len(r.prompt) for r, _ in scheduled]
        self.trace.mixed_steps += any(prefill) and not all(prefill)
