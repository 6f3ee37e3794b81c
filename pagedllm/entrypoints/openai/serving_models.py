"""The served model names: /v1/models and the check that a request names a model we serve (the base
model, or a LoRA adapter by its name)."""

from __future__ import annotations

from http import HTTPStatus
from typing import TYPE_CHECKING

from pagedllm.entrypoints.openai.errors import OpenAIError
from pagedllm.entrypoints.openai.protocol import ModelCard, ModelList

if TYPE_CHECKING:
    from pagedllm.entrypoints.openai.serving_lora import LoRARegistry
    from pagedllm.lora.request import LoRARequest


class OpenAIServingModels:
    def __init__(
        self,
        served_model_names: list[str],
        model_path: str,
        max_model_len: int,
        lora: LoRARegistry | None = None,
    ) -> None:
        if not served_model_names:
            raise ValueError("at least one served model name is needed")
        self.served_model_names = served_model_names
        self.model_path = model_path
        self.max_model_len = max_model_len
        self.lora = lora

    @property
    def model_name(self) -> str:
        """The name responses carry (the first served name, as in vLLM)."""
        return self.served_model_names[0]

    def check_model(self, model: str | None) -> str:
        """The model name to put in the response; 404 for a model this server does not serve."""
        if model is None or model == "" or model in self.served_model_names:
            return model or self.model_name
        if self.lora is not None and model in self.lora.adapters:
            return model
        served = [*self.served_model_names, *(self.lora.adapters if self.lora is not None else ())]
        raise OpenAIError(
            f"The model `{model}` does not exist. Served models: {', '.join(served)}",
            status=HTTPStatus.NOT_FOUND,
            param="model",
        )

    def lora_request(self, model: str) -> LoRARequest | None:
        """The adapter a (checked) model name selects; None for the base model."""
        return self.lora.adapters.get(model) if self.lora is not None else None

    def list_models(self) -> ModelList:
        cards = [
            ModelCard(id=name, root=self.model_path, max_model_len=self.max_model_len)
            for name in self.served_model_names
        ]
        adapters = self.lora.adapters.values() if self.lora is not None else ()
        cards += [
            ModelCard(
                id=a.lora_name,
                root=a.lora_path,
                parent=a.base_model_name or self.model_name,
                max_model_len=self.max_model_len,
            )
            for a in adapters
        ]
        return ModelList(data=cards)
