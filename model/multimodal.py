"""K3ForConditionalGeneration: MoonViT-V2 features spliced into the K3 language model's stream.

Text, images and video chunks share one token stream. Each media item is written in the prompt
as a run of `media_placeholder_token_id` tokens (k3.model.vision_processor builds it); the
tower + projector turn the item into exactly that many feature rows, which replace the
placeholders' embeddings one to one, in order. Loss is taken on text tokens only.

Two ways in:
- `pixel_values` + `grid_thws`: encode here (training, single-shot inference);
- `media_embeds`: rows already produced by `encode_media` (a serving engine encodes each item
  once, keeps the rows, and passes the slice whose placeholders fall in each prefill chunk).
"""
from __future__ import annotations

import torch
from torch import nn

from k3.kernels.dispatch import eager

from .cache import CacheBatch
from .config import K3Config
from .directory import Source
from .model import CausalLMOutput, K3ForCausalLM
from .vision import MoonViT, PatchMergerV2, grid_list, init_vision_, tokens_per_item


class K3ForConditionalGeneration(nn.Module):
    """The K3 language model with the MoonViT-V2 tower and PatchMergerV2 projector.

    Submodule names are the release's: `language_model`, `vision_tower`, `mm_projector`.
    """

    def __init__(self, cfg: K3Config) -> None:
        super().__init__()
        if cfg.vision_config is None:
            raise ValueError("K3ForConditionalGeneration needs K3Config.vision_config (e.g. preset 'k3-tiny-vl')")
        self.cfg = cfg
        self.language_model = K3ForCausalLM(cfg)
        self.vision_tower = MoonViT(cfg.vision_config)
        self.mm_projector = PatchMergerV2(cfg.vision_config)
        if not any(p.is_meta for p in self.parameters()):
            init_vision_(self.vision_tower, cfg.initializer_range)
            init_vision_(self.mm_projector, cfg.initializer_range)  # the language model initialised itself

    @property
    def model(self):
        """The decoder stack (K3Model), as on K3ForCausalLM: code that walks `model.model.layers`
        (expert placement, balancing, activation checkpointing) takes either class."""
        return self.language_model.model

    @property
    def source(self) -> Source | None:
        """Where a loader read the weights from: the language model's (model/directory.py)."""
        return self.language_model.source

    @source.setter
    def source(self, value: Source | None) -> None:
        self.language_model.source = value

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Fresh initialisation of every parameter (the language model's rule, then the tower's)."""
        self.language_model.reset_parameters()
        init_vision_(self.vision_tower, self.cfg.initializer_range)
        init_vision_(self.mm_projector, self.cfg.initializer_range)

    # -- media ------------------------------------------------------------------------------
    def encode_media(self, pixel_values: torch.Tensor, grid_thws: torch.Tensor | list) -> list[torch.Tensor]:
        """Per item, the rows that replace its placeholders: a list of [tokens_i, hidden].

        pixel_values [N, 3, p, p] and grid_thws [M, 3] as made by the processor; items are
        encoded packed (attention stays inside each), so the result equals encoding each alone.
        """
        grids = grid_list(grid_thws)
        rows = self.mm_projector(self.vision_tower(pixel_values, grids))
        return list(rows.split(tokens_per_item(grids, self.cfg.vision_config.merge_kernel_size)))

    def splice(self, input_ids: torch.Tensor, media_embeds: torch.Tensor | None) -> torch.Tensor:
        """Token embeddings [B, T, hidden] with media rows [P, hidden] written, in order, at the P
        placeholder positions of input_ids. ValueError naming both counts when P differs."""
        embeds = self.language_model.model.embed_tokens(input_ids)
        mask = input_ids == self.cfg.media_placeholder_token_id
        n_slots, n_rows = int(mask.sum()), 0 if media_embeds is None else int(media_embeds.shape[0])
        if n_slots != n_rows:
            raise ValueError(f"input_ids hold {n_slots} media placeholder tokens "
                             f"(id {self.cfg.media_placeholder_token_id}) but {n_rows} media feature rows were given")
        if n_rows == 0:
            return embeds
        if media_embeds.dim() != 2 or media_embeds.shape[1] != self.cfg.hidden_size:
            raise ValueError(f"media_embeds must be [P, {self.cfg.hidden_size}], got {tuple(media_embeds.shape)}")
        return embeds.masked_scatter(mask.unsqueeze(-1), media_embeds.to(embeds.dtype))

    def _touch_tower(self, embeds: torch.Tensor) -> torch.Tensor:
        # A text-only training batch still runs the tower on one blank minimal item and adds
        # zero times its output, so every parameter gets a (zero) gradient and every rank's
        # gradients have the same shapes (DeepSpeed reduces them bucket by bucket).
        vc = self.cfg.vision_config
        kh, kw = vc.merge_kernel_size
        blank = embeds.new_zeros(kh * kw, 3, vc.patch_size, vc.patch_size)
        rows = self.mm_projector(self.vision_tower(blank, [(1, kh, kw)]))
        return embeds + 0.0 * rows.sum().to(embeds.dtype)

    # -- forward ----------------------------------------------------------------------------
    def forward(
        self,
        input_ids: torch.Tensor,
        pixel_values: torch.Tensor | None = None,
        grid_thws: torch.Tensor | list | None = None,
        media_embeds: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        cache: CacheBatch | None = None,
        logits_at: torch.Tensor | None = None,
        collect_router: bool = False,
    ) -> CausalLMOutput:
        """input_ids [B, T] (or [1, T] packed with cu_seqlens) with placeholder runs for media.

        Media come as pixel_values [N, 3, p, p] + grid_thws [M, 3] (items in placeholder order)
        or as media_embeds [P, hidden] (rows from encode_media, concatenated in order). labels
        as in K3ForCausalLM; placeholder positions are never trained to be predicted.
        """
        if (pixel_values is None) != (grid_thws is None):
            raise ValueError("pixel_values and grid_thws go together: give both or neither")
        if pixel_values is not None and media_embeds is not None:
            raise ValueError("give either pixel_values/grid_thws or media_embeds, not both")
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
            raise ValueError(f"input_ids must be a [B, T] tensor, got {getattr(input_ids, 'shape', type(input_ids))}")
        if eager():  # NaN or inf in the media reached the KDA gate check, which blamed the gate
            for name, x in (("pixel_values", pixel_values), ("media_embeds", media_embeds)):
                if isinstance(x, torch.Tensor) and x.is_floating_point() and x.numel() and \
                        not bool(torch.isfinite(x).all()):
                    raise ValueError(f"{name} holds NaN or inf")
        if pixel_values is not None:
            media_embeds = torch.cat(self.encode_media(pixel_values, grid_thws))
        embeds = self.splice(input_ids, media_embeds)
        if media_embeds is None and self.training and torch.is_grad_enabled():
            embeds = self._touch_tower(embeds)
        if labels is not None:
            labels = labels.masked_fill(input_ids == self.cfg.media_placeholder_token_id, -100)
        return self.language_model(input_ids, cu_seqlens=cu_seqlens, labels=labels, cache=cache,
                                   logits_at=logits_at, collect_router=collect_router, inputs_embeds=embeds)

    def set_router_bias(self, biases: torch.Tensor) -> None:
        """The language model's MoE selection biases for the next batch (see K3ForCausalLM)."""
        self.language_model.set_router_bias(biases)
