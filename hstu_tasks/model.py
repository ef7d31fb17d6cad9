"""A small but faithful HSTU ranking model.

* torchrec ``EmbeddingCollection`` for item and action ids (sharded by
  ``DistributedModelParallel``);
* item and action embeddings interleaved per user -- ``i1 a1 i2 a2 ... iL aL`` --
  followed by the candidate items to rank;
* N HSTU layers (pure torch): LayerNorm -> Linear(D, 4*H*dh) -> SiLU -> split u, v,
  q, k -> attention ``silu(q k^T * alpha) / n`` under causal + candidate masking ->
  LayerNorm(attention) * u -> Linear -> residual;
* the outputs at candidate positions through an MLP head, trained with multi-task
  BCE-with-logits on bit-encoded labels, ``reduction="none"``.

``forward(batch) -> (losses, logits)``.  Everything after the embedding lookup lives
in ``HSTUDense``, a module without sharded children, so torchrec's tracer treats it
as a leaf and the top-level forward stays FX-traceable for ``_rewrite_model``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torchrec import EmbeddingCollection, EmbeddingConfig
from torchrec.sparse.jagged_tensor import JaggedTensor

from .data import DataConfig, HSTUBatch

__all__ = ("HSTUDense", "HSTULayer", "HSTURankingModel", "ModelConfig", "interleave")


@dataclass(frozen=True)
class ModelConfig:
    embedding_dim: int = 32
    num_heads: int = 2
    head_dim: int = 16
    num_layers: int = 2
    max_positions: int = 256
    mlp_hidden: int = 64
    dropout: float = 0.0  # kept at 0: bit-exact comparisons between pipelines

    @classmethod
    def small(cls) -> ModelConfig:
        return cls()


def interleave(
    items: JaggedTensor, actions: JaggedTensor, num_candidates: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Padded token sequences ``[B, T, D]``, their lengths ``[B]`` and the history
    length ``[B]``: per sample, history items and actions alternate, then candidates."""
    history = actions.lengths()
    item_lengths = items.lengths()
    lengths = 2 * history + num_candidates
    batch, width = history.numel(), int(lengths.max()) if history.numel() else 0
    position = torch.arange(width, device=history.device)[None, :]
    valid = position < lengths[:, None]
    in_history = position < 2 * history[:, None]
    takes_action = in_history & (position % 2 == 1)
    takes_item = valid & ~takes_action
    item_start = torch.cumsum(item_lengths, 0) - item_lengths
    action_start = torch.cumsum(history, 0) - history
    item_offset = torch.where(in_history, position // 2, position - history[:, None])
    item_index = item_start[:, None] + item_offset
    action_index = action_start[:, None] + position // 2
    values = items.values()
    tokens = values.new_zeros(batch, width, values.shape[-1])
    tokens[takes_item] = values[item_index[takes_item]]
    tokens[takes_action] = actions.values()[action_index[takes_action]]
    return tokens, lengths, history


def attention_mask(lengths: torch.Tensor, history: torch.Tensor, width: int) -> torch.Tensor:
    """``[B, T, T]``: history tokens see earlier history (causal); a candidate sees
    the whole history and itself, never another candidate; padding sees nothing."""
    position = torch.arange(width, device=lengths.device)
    query, key = position[None, :, None], position[None, None, :]
    boundary = 2 * history[:, None, None]
    valid = (query < lengths[:, None, None]) & (key < lengths[:, None, None])
    causal_history = (query < boundary) & (key <= query)
    candidate = (query >= boundary) & ((key < boundary) | (key == query))
    return valid & (causal_history | candidate)


class HSTULayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        width = config.num_heads * config.head_dim
        self.heads, self.head_dim = config.num_heads, config.head_dim
        self.input_norm = nn.LayerNorm(config.embedding_dim)
        self.uvqk = nn.Linear(config.embedding_dim, 4 * width)
        self.attention_norm = nn.LayerNorm(width)
        self.output = nn.Linear(width, config.embedding_dim)
        self.dropout = nn.Dropout(config.dropout)
        self.alpha = 1.0 / config.head_dim**0.5

    def forward(self, x: torch.Tensor, mask: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        batch, width, _ = x.shape
        u, v, q, k = F.silu(self.uvqk(self.input_norm(x))).chunk(4, dim=-1)

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(batch, width, self.heads, self.head_dim).transpose(1, 2)

        scores = heads(q) @ heads(k).transpose(-1, -2) * self.alpha
        weights = F.silu(scores) / lengths.clamp(min=1).to(x.dtype)[:, None, None, None]
        weights = weights * mask[:, None].to(x.dtype)
        attended = (weights @ heads(v)).transpose(1, 2).reshape(batch, width, -1)
        return x + self.dropout(self.output(self.attention_norm(attended) * u))


class HSTUDense(nn.Module):
    """Everything after the embedding lookup: interleave, HSTU layers, candidate
    extraction, MLP head, multi-task loss."""

    def __init__(self, config: ModelConfig, num_tasks: int) -> None:
        super().__init__()
        self.num_tasks = num_tasks
        self.positions = nn.Embedding(config.max_positions, config.embedding_dim)
        self.layers = nn.ModuleList(HSTULayer(config) for _ in range(config.num_layers))
        self.final_norm = nn.LayerNorm(config.embedding_dim)
        self.head = nn.Sequential(
            nn.Linear(config.embedding_dim, config.mlp_hidden),
            nn.SiLU(),
            nn.Linear(config.mlp_hidden, num_tasks),
        )

    def forward(
        self,
        embeddings: dict[str, JaggedTensor],
        num_candidates: torch.Tensor,
        labels: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        tokens, lengths, history = interleave(embeddings["item"], embeddings["action"], num_candidates)
        width = tokens.shape[1]
        if width > self.positions.num_embeddings:
            raise ValueError(
                f"sequence of {width} tokens exceeds max_positions={self.positions.num_embeddings}"
            )
        x = tokens + self.positions.weight[:width][None]
        mask = attention_mask(lengths, history, width)
        for layer in self.layers:
            x = layer(x, mask, lengths)
        position = torch.arange(width, device=x.device)[None, :]
        is_candidate = (position >= 2 * history[:, None]) & (position < lengths[:, None])
        logits = self.head(self.final_norm(x[is_candidate]))
        tasks = torch.arange(self.num_tasks, device=labels.device)
        targets = ((labels[:, None] >> tasks) & 1).to(logits.dtype)
        losses = F.binary_cross_entropy_with_logits(logits, targets, reduction="none")
        return losses, logits.detach()


class HSTURankingModel(nn.Module):
    def __init__(
        self,
        model: ModelConfig,
        data: DataConfig,
        *,
        embedding_device: torch.device | str = "meta",
    ) -> None:
        super().__init__()
        self.embeddings = EmbeddingCollection(
            tables=[
                EmbeddingConfig(name="item_table", embedding_dim=model.embedding_dim,
                                num_embeddings=data.num_items, feature_names=["item"]),
                EmbeddingConfig(name="action_table", embedding_dim=model.embedding_dim,
                                num_embeddings=data.num_actions, feature_names=["action"]),
            ],  # fmt: skip
            device=torch.device(embedding_device),
        )
        self.dense = HSTUDense(model, data.num_tasks)

    def forward(self, batch: HSTUBatch) -> tuple[torch.Tensor, torch.Tensor]:
        embeddings = self.embeddings(batch.features)
        return self.dense(embeddings, batch.num_candidates, batch.labels)  # type: ignore[no-any-return]
