"""The served model names: /v1/models and the check that a request names a model we serve."""

from __future__ import annotations

from http import HTTPStatus

from pagedllm.entrypoints.openai.errors import OpenAIError
from pagedllm.entrypoints.openai.protocol import ModelCard, ModelList


class OpenAIServingModels:
    def __init__(self, served_model_names: list[str], model_path: str, max_model_len: int) -> None:
        if not served_model_names:
            raise ValueError("at least one served model name is needed")
        self.served_model_names = served_model_names
        self.model_path = model_path
        self.max_model_len = max_model_len

    @property
    def model_name(self) -> str:
        """The name responses carry (the first served name, as in vLLM)."""
        return self.served_model_names[0]

    def check_model(self, model: str | None) -> str:
        """The model name to put in the response; 404 for a model this server does not serve."""
        if model is None or model == "" or model in self.served_model_names:
            return model or self.model_name
        raise OpenAIError(
            f"The model `{model}` does not exist. Served models: {', '.join(self.served_model_names)}",
            status=HTTPStatus.NOT_FOUND,
            param="model",
        )

    def list_models(self) -> ModelList:
        return ModelList(
            data=[
                ModelCard(id=name, root=self.model_path, max_model_len=self.max_model_len)
                for name in self.served_model_names
            ]
        )
