"""The transformers rollout engine: batched sampling with a KV cache, for CPU runs and tests.

Decoding is a plain loop over `model.forward` with a `DynamicCache` built from the model's config
(hybrid models, Qwen3-Next and Nemotron-H, keep conv and recurrent states in the layers that are
not attention; left padding is zeroed before those layers, so a pad never enters a state), so the engine controls
exactly what it samples from: logits / temperature, then the top-p nucleus, renormalised; the
logprob it reports is of that distribution. The model is guarded by a lock taken per decode
step, so a weight update lands between two steps of the requests in flight; their later tokens
carry the new policy version (like vLLM's pause in "keep" mode).

Routing replay (`rollout.hf.routing_replay`, MoE models): forward hooks on the routers record
each forward's top-k experts per layer; a generation's rows are the prompt's (from the prefill)
and one per later decode step (the token fed in), ``prompt + completion - 1`` rows as vLLM
returns them (`rlcore.batch.routing`). A vision-language model's routers are its language
model's; the prefill routes the image placeholder tokens (the image's embeddings in their
places) like any prompt token, so those rows are there too.
"""

from __future__ import annotations

import inspect
import threading
from typing import Iterable

import numpy as np
import torch
from transformers import DynamicCache

from rlcore.batch.routing import expected_rows, expert_dtype, replay_enabled
from rlcore.engine.base import Generation, Prefilled, RolloutEngine, SamplingParams, StalePrefill
from rlcore.models.build import build_model, build_tokenizer
from rlcore.models.moe_family import find_router, is_moe_block
from rlcore.models.vision import decoder_layers, mrope_positions, pixel_values


def _cache_to(cache, device: str):
    """A prefill's `DynamicCache` (CPU tensors) on `device`. Attention layers only: a hybrid
    model's recurrent states are not moved between devices (refused, not dropped)."""
    if any(
        getattr(layer, "keys", None) is None and not hasattr(layer, "key_cache")
        for layer in getattr(cache, "layers", ())
    ):
        raise ValueError(
            "prefill/decode disaggregation on the transformers engine off the CPU moves "
            "attention caches only; this model has recurrent (linear-attention / Mamba) layers"
        )
    moved = DynamicCache()
    for layer, (k, v) in enumerate(zip(*_cache_tensors(cache))):
        moved.update(k.to(device), v.to(device), layer)
    return moved


def _cache_tensors(cache) -> tuple[list, list]:
    """(keys, values) per layer of a `DynamicCache` (transformers 5 keeps them on `layers`)."""
    layers = getattr(cache, "layers", None)
    if layers is not None:
        return [layer.keys for layer in layers], [layer.values for layer in layers]
    return list(cache.key_cache), list(cache.value_cache)


def sample_with_logprobs(
    logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row of ``logits`` [B, V] and return (tokens [B], logprobs [B]).

    The distribution is ``softmax(logits / temperature)`` restricted to the smallest set of
    tokens whose mass reaches ``top_p`` and renormalised; logprobs are of that distribution.
    Temperature 0 is greedy with logprob 0.
    """
    if temperature <= 0:
        return logits.argmax(dim=-1), torch.zeros(logits.shape[0], dtype=torch.float32)
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_logp, order = logp.sort(dim=-1, descending=True)
        cum = sorted_logp.exp().cumsum(dim=-1)
        # keep a token if the mass before it is below top_p (the first token is always kept)
        drop_sorted = (cum - sorted_logp.exp()) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logp = torch.log_softmax(logp.masked_fill(drop, float("-inf")), dim=-1)
    tokens = torch.multinomial(logp.exp(), 1, generator=generator).squeeze(-1)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)


class HFEngine(RolloutEngine):
    """A transformers causal LM served in-process."""

    def __init__(
        self,
        model: torch.nn.Module,
        pad_token_id: int,
        eos_token_id: int,
        seed: int = 0,
        device: str = "cpu",
        vision=None,
        routing_replay: bool = False,
    ):
        self.model = model.to(device).eval()
        self.device = device
        self.vision = vision  # VisionSpec of a vision-language model (None: text-only)
        self.pad_token_id = pad_token_id
        self.eos_token_id = eos_token_id
        self.policy_version = 0
        self._lock = threading.RLock()
        self._abort = threading.Event()
        self._generator = torch.Generator(device=device).manual_seed(seed)
        # transformers renamed `past_key_values` to `cache` (5.2x); accept both generations
        params = inspect.signature(self.model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self._params = dict(self.model.named_parameters())
        self._params.update(dict(self.model.named_buffers()))
        self._routing = threading.local()  # .steps: this thread's generate's per-forward experts
        self._routers = self._hook_routers() if routing_replay else None

    def _hook_routers(self) -> dict[int, int]:
        """Hook every decoder layer's router (the MoE block's ``gate`` or ``router``, any family of
        `rlcore.models.moe_family`: each returns (logits, weights, experts)); returns layer index ->
        top_k. Each forward of a capturing thread appends {layer: experts}."""
        routers = {}
        for i, layer in enumerate(decoder_layers(self.model)):
            mlp = getattr(layer, "mlp", None)
            found = find_router(mlp) if mlp is not None and is_moe_block(mlp) else None
            if found is None or not hasattr(found[1], "num_experts"):
                continue
            gate = found[1]
            routers[i] = gate.top_k
            self._num_experts = gate.num_experts

            def hook(module, args, output, _layer=i):
                steps = getattr(self._routing, "steps", None)
                if steps is not None:
                    steps[-1][_layer] = output[-1]  # (logits, weights, experts [B * t, k])

            gate.register_forward_hook(hook)
        if not routers:
            raise ValueError("rollout.hf.routing_replay: the model has no MoE routers (layers' mlp.gate / mlp.router)")
        return routers

    def _routed_rows(self, steps: list[dict], prompts: list[list[int]], max_len: int, lengths: list[int]) -> list:
        """Per row, [prompt + completion - 1, layers, top_k] experts (module docstring)."""
        batch = len(prompts)
        if not steps or not steps[0]:  # aborted before the prefill
            return [None] * batch
        layers = len(decoder_layers(self.model))
        k = next(iter(self._routers.values()))
        per_step = []
        for step in steps:
            t = next(iter(step.values())).shape[0] // batch
            full = np.zeros((batch, t, layers, k), dtype=expert_dtype(self._num_experts))
            for layer, experts in step.items():
                full[:, :, layer] = experts.view(batch, t, k).cpu().numpy()
            per_step.append(full)
        out = []
        for i, p in enumerate(prompts):
            rows = [per_step[0][i, max_len - len(p) :]] + [
                per_step[s][i] for s in range(1, min(lengths[i], len(steps)))
            ]
            out.append(np.concatenate(rows)[: expected_rows(len(p), lengths[i])])
        return out

    @classmethod
    def from_config(cls, options, model, *, seed: int = 0, tokenizer=None, device: str = "cpu") -> "HFEngine":
        """`model` (random weights until the first sync, or `model.path`) on `device`; its section
        (`rollout.hf`) holds no option it reads."""
        tokenizer = tokenizer if tokenizer is not None else build_tokenizer(model)
        return cls(
            build_model(model, tokenizer),
            tokenizer.pad_token_id,
            tokenizer.eos_token_id,
            seed=seed,
            device=device,
            vision=getattr(tokenizer, "rlcore_vision", None),
            routing_replay=replay_enabled(options),
        )

    def _prompt_inputs(self, prompts: list[list[int]], images) -> tuple:
        """(ids, attention mask, positions, extra model inputs) of the left-padded prompts."""
        batch, max_len = len(prompts), max(len(p) for p in prompts)
        # left padding keeps every row's next token at the last position
        ids = torch.full((batch, max_len), self.pad_token_id, dtype=torch.long, device=self.device)
        attn = torch.zeros((batch, max_len), dtype=torch.long, device=self.device)
        for i, p in enumerate(prompts):
            ids[i, max_len - len(p) :] = torch.tensor(p, dtype=torch.long)
            attn[i, max_len - len(p) :] = 1
        positions = (attn.cumsum(-1) - 1).clamp(min=0)
        extra = {}
        if images is not None and any(images):
            positions, extra = self._vision_inputs(prompts, images, max_len)
        return ids, attn, positions, extra

    @torch.inference_mode()
    def prefill(self, prompts: list[list[int]], params: SamplingParams, images=None) -> Prefilled:
        """The prompts' forward, as `generate`'s first step runs it: the handle holds the KV cache,
        the attention mask, the positions and the last position's logits (CPU tensors: they
        travel through Ray's object store), and the version of the weights that computed them."""
        if self._routers is not None:
            raise ValueError(
                "routing replay records the prompt's experts in its own generate: it does not disaggregate"
            )
        ids, attn, positions, extra = self._prompt_inputs(prompts, images)
        cache = DynamicCache(config=self.model.config)  # each layer's own kind of state, as in generate
        with self._lock:
            logits = self.model(
                input_ids=ids,
                attention_mask=attn,
                position_ids=positions,
                use_cache=True,
                **{self._cache_kwarg: cache},
                **extra,
            ).logits[:, -1, :]
            version = self.policy_version
        if self.device != "cpu":  # the object store holds host memory
            cache, attn, positions, logits = _cache_to(cache, "cpu"), attn.cpu(), positions.cpu(), logits.cpu()
        state = {"cache": cache, "attn": attn, "positions": positions, "logits": logits}
        return Prefilled([list(p) for p in prompts], version, state)

    @torch.inference_mode()
    def generate(
        self, prompts: list[list[int]], params: SamplingParams, images=None, prefilled: Prefilled | None = None
    ) -> list[Generation]:
        """`images`: per prompt, its uint8 images (vision-language models; prompts hold the
        expanded image tokens, see `rlcore.models.vision`). `prefilled`: the handle of
        :meth:`prefill` for these prompts (from another engine of the same model): its cache and
        logits replace the first forward, whose tokens carry the prefill's version. The first
        forward on that cache checks, under the lock a weight update takes, that this engine
        holds the handle's version (`StalePrefill` otherwise): the first two tokens of every
        sample carry one version; later ones, like any request's, the version that made them."""
        batch = len(prompts)
        stop_ids = torch.tensor(sorted({self.eos_token_id, *params.stop_token_ids}), device=self.device)
        max_len = max(len(p) for p in prompts)
        if prefilled is not None:
            if self._routers is not None:
                raise ValueError(
                    "routing replay records the prompt's experts in its own forward: it does not continue a prefill"
                )
            if [list(p) for p in prompts] != prefilled.prompts:
                raise ValueError("prefilled: the handle is of other prompts")
            st = prefilled.state
            ids, attn, positions, extra = None, st["attn"].to(self.device), st["positions"].to(self.device), {}
            cache = st["cache"]
            if self.device != "cpu":
                cache = _cache_to(cache, self.device)
        else:
            ids, attn, positions, extra = self._prompt_inputs(prompts, images)
            # built from the config: each layer gets its own kind of state (attention KV; the conv and
            # recurrent states of linear-attention / Mamba layers), not only attention's
            cache = DynamicCache(config=self.model.config)
        generator = self._generator
        if params.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(params.seed)

        out_tokens: list[list[int]] = [[] for _ in range(batch)]
        out_logprobs: list[list[float]] = [[] for _ in range(batch)]
        out_versions: list[list[int]] = [[] for _ in range(batch)]
        finish = ["length"] * batch
        done = torch.zeros(batch, dtype=torch.bool, device=self.device)
        step_ids, step_pos = ids, positions
        steps: list[dict] = []  # per forward, {layer: experts} (routing replay only)
        self._routing.steps = steps if self._routers is not None else None
        try:
            for step in range(params.max_new_tokens):
                if self._abort.is_set():
                    for i in range(batch):
                        if not done[i]:
                            finish[i] = "abort"
                    break
                steps.append({})
                if step == 0 and prefilled is not None:  # the prefill engine ran this forward
                    logits, version = prefilled.state["logits"].to(self.device).clone(), prefilled.version
                else:
                    with self._lock:
                        if step == 1 and prefilled is not None and self.policy_version != prefilled.version:
                            # the handed cache would meet other weights: nothing decoded from it is kept
                            raise StalePrefill(
                                f"prefill at version {prefilled.version}, this engine holds {self.policy_version}"
                            )
                        logits = self.model(
                            input_ids=step_ids,
                            attention_mask=attn,
                            position_ids=step_pos,
                            use_cache=True,
                            **{self._cache_kwarg: cache},
                            **extra,
                        ).logits[:, -1, :]
                        version = self.policy_version
                if self.vision is not None:
                    # a sampled image token would claim an image that does not exist: never sample it
                    # (the trainer scores the full vocabulary; the gap is the tiny mass removed here)
                    logits[:, [self.vision.image_token_id, self.vision.image_token_id + 1]] = float("-inf")
                tokens, logprobs = sample_with_logprobs(logits, params.temperature, params.top_p, generator)
                for i in torch.nonzero(~done).flatten().tolist():
                    tok = int(tokens[i])
                    out_tokens[i].append(tok)
                    out_logprobs[i].append(float(logprobs[i]))
                    out_versions[i].append(version)
                    if tok in stop_ids:
                        finish[i] = "stop"
                done |= torch.isin(tokens, stop_ids)
                if bool(done.all()):
                    break
                step_ids = torch.where(done, self.pad_token_id, tokens)[:, None]
                extra = {}  # images are consumed by the prefill step
                step_pos = step_pos[..., -1:] + 1
                attn = torch.cat([attn, (~done).long()[:, None]], dim=1)
        finally:
            self._routing.steps = None
        routed = (
            self._routed_rows(steps, prompts, max_len, [len(t) for t in out_tokens])
            if self._routers is not None
            else [None] * batch
        )
        return [Generation(out_tokens[i], out_logprobs[i], out_versions[i], finish[i], routed[i]) for i in range(batch)]

    def _vision_inputs(self, prompts, images, max_len: int):
        """3-D mrope positions [3, B, L] of the left-padded prompts (pads at 0) and the pixel
        inputs of all images in row order (the model scatters them over the image tokens in
        that order); decode steps continue every row at its max position + 1."""
        if self.vision is None:
            raise ValueError("prompts have images but the engine's model is text-only")
        flat = [img for imgs in images for img in imgs]
        pixels, grids = pixel_values(flat, self.vision)
        pos = torch.zeros(3, len(prompts), max_len, dtype=torch.long)
        g = 0
        for i, (p, imgs) in enumerate(zip(prompts, images)):
            pos[:, i, max_len - len(p) :] = mrope_positions(p, grids[g : g + len(imgs)].tolist(), self.vision)
            g += len(imgs)
        return pos.to(self.device), {"pixel_values": pixels.to(self.device), "image_grid_thw": grids.to(self.device)}

    def _completion_logp(self, prompt_ids: list[int], completion_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-softmax [len(completion), V] at the positions predicting each completion token, and
        those tokens' ids."""
        ids = torch.tensor([list(prompt_ids) + list(completion_ids)], device=self.device)
        with self._lock:
            logits = self.model(input_ids=ids, use_cache=False).logits[0].float()
        return torch.log_softmax(logits[len(prompt_ids) - 1 : -1], dim=-1), ids[0, len(prompt_ids) :]

    @torch.inference_mode()
    def score(self, prompt_ids: list[int], completion_ids: list[int]) -> list[float]:
        logp, taken = self._completion_logp(prompt_ids, completion_ids)
        return logp.gather(-1, taken[:, None]).squeeze(-1).tolist()

    @torch.inference_mode()
    def score_top_k_batch(
        self, pairs: list[tuple[list[int], list[int]]], k: int
    ) -> list[tuple[list[float], np.ndarray, np.ndarray]]:
        out = []
        for prompt_ids, completion_ids in pairs:
            logp, taken = self._completion_logp(prompt_ids, completion_ids)
            top = logp.topk(min(k, logp.shape[-1]), dim=-1)
            out.append(
                (
                    logp.gather(-1, taken[:, None]).squeeze(-1).tolist(),
                    top.indices.to(torch.int32).cpu().numpy(),
                    top.values.cpu().numpy(),
                )
            )
        return out

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        with self._lock, torch.no_grad():
            for name, tensor in named_tensors:
                if name not in self._params:
                    raise KeyError(f"weight sync: engine has no parameter {name!r}")
                self._params[name].copy_(tensor)

    def set_version(self, version: int) -> None:
        with self._lock:
            self.policy_version = version

    def apply_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        # one lock hold for the whole update: no decode step sees half-new weights
        with self._lock:
            self.load_weights(named_tensors)
            self.set_version(version)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self._params.items()}

    def rng_state(self) -> torch.Tensor:
        """State of the engine's own sampling RNG (requests without a seed draw from it)."""
        return self._generator.get_state()

    def set_rng_state(self, state: torch.Tensor) -> bool:
        self._generator.set_state(state)
        return True

    def abort(self) -> None:
        self._abort.set()
