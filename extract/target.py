"""The target in stage one: per real token of a padded batch, the chosen layers' hidden states (layer id ``i`` is HF
``hidden_states[i + 1]``) and the top-k log-probs, the LM head run in chunks (no (B, T, vocab) tensor)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class TargetOutput:
    """What one batch yields, real tokens only, token-major in batch order."""

    hidden: torch.Tensor  # (N, len(layer_ids), D) in the model's dtype
    topk_logprobs: torch.Tensor  # (N, k) float32, descending
    topk_ids: torch.Tensor  # (N, k) int32


def load_target(name_or_path: str, *, dtype: str = "bfloat16", device: str | torch.device = "cpu",
                attn_implementation: str | None = "sdpa", revision: str | None = None):
    """from_pretrained in `dtype` onto `device`, eval mode, no grad anywhere."""
    from transformers import AutoModelForCausalLM

    attention = {"attn_implementation": attn_implementation} if attn_implementation else {}
    model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=getattr(torch, dtype), revision=revision,
                                                 **attention)
    return model.to(device).eval().requires_grad_(False)


def logsumexp_fp32(logits: torch.Tensor) -> torch.Tensor:  # (rows, vocab) any dtype -> (rows,) fp32
    return torch.logsumexp(logits.float(), dim=-1)


def head_backend_for(device: torch.device | str) -> str | None:
    """The head's log-sum-exp: inductor on CUDA, eager elsewhere (where the fp32 copy costs less than a compile)."""
    return "inductor" if torch.device(device).type == "cuda" else None


class TargetRunner:
    """Runs padded batches through the target; ``head_backend``: torch.compile's backend for the head (None: eager)."""

    def __init__(self, model, layer_ids: list[int], topk: int, lm_head_chunk: int = 1024,
                 head_backend: str | None = None):
        self.backbone, self.lm_head = getattr(model, "model", None), model.get_output_embeddings()
        self.layers = getattr(self.backbone, "layers", None)
        if self.layers is None or self.lm_head is None:
            raise ValueError(f"{type(model).__name__}: expected .model.layers and an LM head (a decoder-only HF model)")
        self.num_layers = len(self.layers)
        if bad := [i for i in layer_ids if not 0 <= i < self.num_layers]:
            raise ValueError(f"layer ids {bad} out of range: the target has {self.num_layers} layers "
                             f"(ids 0..{self.num_layers - 1})")
        vocab = self.lm_head.weight.shape[0]
        if not 1 <= topk <= vocab:
            raise ValueError(f"topk {topk} must be between 1 and the vocabulary size {vocab}")
        self.layer_ids, self.topk, self.lm_head_chunk = list(layer_ids), topk, lm_head_chunk
        self.hidden_size = model.config.hidden_size
        self.device, self.dtype = next(model.parameters()).device, next(model.parameters()).dtype
        self._gather_index = self._out = None  # set during our forwards only
        self._hooks = [self.layers[i].register_forward_hook(self._hook(slot))
                       for slot, i in enumerate(self.layer_ids) if i != self.num_layers - 1]
        self._logsumexp = logsumexp_fp32
        if head_backend is not None:  # compiled and run once here with the row count dynamic, so that a
            # batch's shorter last chunk does not compile again (a 1-row chunk does, once)
            self._logsumexp = torch.compile(logsumexp_fp32, backend=head_backend)
            with torch.inference_mode():
                z = torch.zeros((max(2, lm_head_chunk), vocab), dtype=self.dtype, device=self.device)
                torch._dynamo.mark_dynamic(z, 0)
                self._logsumexp(z)

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def _hook(self, slot: int):
        def grab(module, args, output):
            if self._out is None:  # a forward not started by us
                return
            h = output[0] if isinstance(output, tuple) else output  # (B, T, D)
            self._out[:, slot] = h.reshape(-1, h.shape[-1]).index_select(0, self._gather_index)
        return grab

    @staticmethod
    def pad_batch(samples: list[torch.Tensor], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Right-pad 1-D id tensors: (input_ids (B, T), attention_mask (B, T), gather index (N,)), the
        index listing the real tokens' flat (b * T + t) positions: the token-major order the cache stores."""
        ids = torch.nn.utils.rnn.pad_sequence(samples, batch_first=True, padding_value=pad_id).long()
        mask = (torch.arange(ids.shape[1]) < torch.tensor([len(s) for s in samples])[:, None]).long()
        return ids, mask, mask.flatten().nonzero().squeeze(1)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, gather_index: torch.Tensor
                ) -> TargetOutput:
        """One right-padded batch (tensors may still be on the host) -> real-token outputs."""
        non_blocking = self.device.type == "cuda"
        input_ids = input_ids.to(self.device, non_blocking=non_blocking)
        attention_mask = attention_mask.to(self.device, non_blocking=non_blocking)
        self._gather_index = gather_index.to(self.device, non_blocking=non_blocking)
        n = gather_index.shape[0]
        self._out = torch.empty((n, len(self.layer_ids), self.hidden_size), dtype=self.dtype, device=self.device)
        try:
            last = self.backbone(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
            last = last.reshape(-1, last.shape[-1]).index_select(0, self._gather_index)  # (N, D), after the final norm
            if self.num_layers - 1 in self.layer_ids:
                self._out[:, self.layer_ids.index(self.num_layers - 1)] = last
            hidden = self._out
        finally:
            self._out, self._gather_index = None, None
        values = torch.empty((n, self.topk), dtype=torch.float32, device=self.device)
        ids = torch.empty((n, self.topk), dtype=torch.int32, device=self.device)
        for t0 in range(0, n, self.lm_head_chunk):
            t1 = min(n, t0 + self.lm_head_chunk)
            logits = self.lm_head(last[t0:t1])  # (chunk, vocab) in the model's dtype
            v, i = torch.topk(logits, self.topk, dim=-1)  # those of the log-probs too (monotone)
            values[t0:t1] = v.float() - self._logsumexp(logits)[:, None]
            ids[t0:t1] = i
        return TargetOutput(hidden=hidden, topk_logprobs=values, topk_ids=ids)


def compute_environment(device: torch.device) -> dict[str, Any]:
    """What decides the last bits of a shard's values beyond the fingerprint (device model, CPU SIMD
    level and threads, head backend, library versions); ``ShardWriter`` resumes only under the same."""
    import transformers

    name = (torch.cuda.get_device_name(device) if device.type == "cuda"
            else f"cpu {torch.backends.cpu.get_cpu_capability()} x{torch.get_num_threads()} threads")
    return {"device": name, "head": head_backend_for(device) or "eager", "torch": torch.__version__,
            "transformers": transformers.__version__}
