"""The models of speculative decoding's drafters: a draft model, an EAGLE head. `pagedllm.spec_decode`
sits beside the models package, so the worker hands these loaders to its proposers.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

from pagedllm.config import EngineConfig, ModelConfig
from pagedllm.layers.rotary import RotaryEmbedding
from pagedllm.models.interfaces import SupportsEagle3
from pagedllm.models.llama_eagle import EagleHead, EagleLlamaDraft
from pagedllm.models.llama_eagle3 import Eagle3LlamaDraft, aux_layer_ids
from pagedllm.models.loader import ModelLoadError, default_dtype, load_model
from pagedllm.models.loader.safetensors_loader import iterate_safetensors, read_header, safetensors_files
from pagedllm.models.loader.weights import load_weights

logger = logging.getLogger("pagedllm.worker")


def load_draft_model(engine_config: EngineConfig, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """The smaller model of `speculative_config.method="draft_model"` (the target's tokenizer)."""
    spec, target = engine_config.speculative_config, engine_config.model_config
    draft_config = ModelConfig(model=spec.model, dtype=dtype, seed=target.seed, skip_tokenizer_init=True)
    spec.draft_model_config = draft_config
    spec.target_model_config = target
    vocab_size = target.get_vocab_size()
    if draft_config.get_vocab_size() != vocab_size:
        logger.warning(
            "draft model vocabulary %d != target's %d: drafts use the first %d ids (same tokenizer?)",
            draft_config.get_vocab_size(),
            vocab_size,
            min(vocab_size, draft_config.get_vocab_size()),
        )
    model = load_model(
        draft_config.hf_config,
        draft_config.model_path,
        gguf_file=draft_config.gguf_file,
        load_format=engine_config.load_config.load_format,
        dtype=dtype,
        device=device,
        seed=target.seed,
        max_positions=target.max_model_len,
    )
    logger.info("loaded draft model %s (%s)", spec.model, draft_config.architecture)
    return model


def load_eagle_head(
    engine_config: EngineConfig, target: nn.Module, device: torch.device, dtype: torch.dtype
) -> tuple[nn.Module, Callable[[torch.Tensor], torch.Tensor], list[int]]:
    """An EAGLE ("eagle") or EAGLE-3 ("eagle3") head from its checkpoint, sharing the target's LM head
    (and its embedding when the checkpoint has none); returns the head, its draft logits (target
    vocabulary) and the target layers whose input streams it reads (EAGLE-3; the target is told to
    return them)."""
    cfg = engine_config
    spec = cfg.speculative_config
    head_config = ModelConfig(model=spec.model, dtype=dtype, skip_tokenizer_init=True)
    spec.draft_model_config = head_config
    spec.target_model_config = cfg.model_config
    hf = head_config.hf_config
    if hf.hidden_size != cfg.model_config.get_hidden_size():
        raise ModelLoadError(
            f"EAGLE head {spec.model} has hidden size {hf.hidden_size}, the target "
            f"{cfg.model_config.get_hidden_size()}: it was trained for another model"
        )
    files = safetensors_files(head_config.model_path)
    names = {name for path in files for name in read_header(path)[0]}
    own_embedding = "embed_tokens.weight" in names
    head: EagleHead
    with torch.device(device), default_dtype(dtype):
        if spec.method == "eagle3":
            head = Eagle3LlamaDraft(hf, own_embedding)
        else:
            head = EagleLlamaDraft(hf, fc_bias="fc.bias" in names, own_embedding=own_embedding)
    head.to(device=device)
    for module in head.modules():
        if isinstance(module, RotaryEmbedding):
            module.cover_positions(cfg.model_config.max_model_len)
    with torch.no_grad():
        load_weights(head, iterate_safetensors(files))
    head.share_embedding(target.get_submodule("model.embed_tokens"))
    compute_logits: Callable[[torch.Tensor], torch.Tensor] = target.compute_logits  # type: ignore[assignment]
    aux_layers: list[int] = []
    if isinstance(head, Eagle3LlamaDraft):
        compute_logits = head.compute_logits
        aux_layers = aux_layer_ids(hf, cfg.model_config.get_total_num_layers())
        _request_aux_hidden(target, aux_layers, spec.model)
    logger.info("loaded %s head %s (%d layers)", spec.method, spec.model, hf.num_hidden_layers)
    return head.eval(), compute_logits, aux_layers


def _request_aux_hidden(target: nn.Module, layer_ids: list[int], head_name: str) -> None:
    if not isinstance(target, SupportsEagle3):
        raise ModelLoadError(f"{type(target).__name__} cannot return the hidden states an EAGLE-3 head reads")
    try:
        target.set_aux_hidden_state_layers(layer_ids)
    except ValueError as e:
        raise ModelLoadError(f"EAGLE-3 head {head_name}: {e}") from e
