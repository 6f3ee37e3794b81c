"""The pooling endpoints end to end: real servers on tiny random BERT models (an embedding model with
sentence-transformers' modules, and a cross-encoder), the official openai client, and references from
sentence-transformers / transformers on the same weights. The servers run in the machine's default dtype;
the references in float32, within what that dtype's rounding does to them (`dtype_tolerance`)."""

from __future__ import annotations

import base64
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import torch
import torch.nn.functional as F
from dtype_tolerance import assert_close_in_dtype, in_dtype
from remote_server import RemoteServer
from transformers import AutoTokenizer

from pagedllm.config.model import ModelConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from tiny_pooling_models import make_tiny_bert, make_tiny_cross_encoder  # noqa: E402

pytestmark = pytest.mark.slow

SENTENCES = ["the quick brown fox jumps over the lazy dog", "hello world", "a cat sat on the mat"]
KEY = "pooling-key"
POOLING_ARGS = ["--max-model-len", "128", "--max-num-seqs", "8", "--served-model-name", "tiny"]


@pytest.fixture(scope="module")
def embed_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("bert-embed")
    make_tiny_bert(path, pooling="mean", normalize=True, seed=1)
    return path


@pytest.fixture(scope="module")
def embed_server(embed_model: Path) -> Iterator[RemoteServer]:
    remote = RemoteServer(extra_args=["--model", str(embed_model), *POOLING_ARGS])
    try:
        yield remote
    finally:
        remote.kill()


@pytest.fixture(scope="module")
def client(embed_server: RemoteServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{embed_server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def _served_dtype(model: Path) -> torch.dtype:
    """What `dtype=auto` (the server's default) resolves to for `model` on this machine."""
    return ModelConfig(model=str(model)).dtype


@pytest.fixture(scope="module")
def encode(embed_model: Path) -> Callable[[torch.dtype], torch.Tensor]:
    """sentence-transformers' embeddings of SENTENCES, computed in the given dtype."""
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(embed_model), device="cpu")
    return lambda dtype: in_dtype(model, dtype).encode(SENTENCES, convert_to_tensor=True).float()


@pytest.fixture(scope="module")
def reference(encode: Callable[[torch.dtype], torch.Tensor]) -> np.ndarray:
    return encode(torch.float32).numpy()


def _cosines(got: np.ndarray, expected: np.ndarray) -> np.ndarray:
    return (got * expected).sum(-1) / (np.linalg.norm(got, axis=-1) * np.linalg.norm(expected, axis=-1))


def test_embeddings_float_and_base64_match_sentence_transformers(
    client: openai.OpenAI, reference: np.ndarray
) -> None:
    floats = client.embeddings.create(model="tiny", input=SENTENCES, encoding_format="float")
    assert [d.index for d in floats.data] == [0, 1, 2]
    got = np.array([d.embedding for d in floats.data])
    assert np.all(_cosines(got, reference) > 0.9999)
    assert floats.usage.prompt_tokens == floats.usage.total_tokens > len(SENTENCES)
    # The client asks for base64 by default and decodes it itself.
    default = client.embeddings.create(model="tiny", input=SENTENCES)
    np.testing.assert_allclose(np.array([d.embedding for d in default.data]), got, atol=1e-6)


def test_embeddings_token_ids_and_single_string(
    embed_server: RemoteServer, client: openai.OpenAI, embed_model: Path, reference: np.ndarray
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(embed_model)
    ids = [tokenizer.encode(s) for s in SENTENCES]
    by_ids = client.embeddings.create(model="tiny", input=ids, encoding_format="float")
    assert np.all(_cosines(np.array([d.embedding for d in by_ids.data]), reference) > 0.9999)
    one = client.embeddings.create(model="tiny", input=ids[1], encoding_format="float")
    assert len(one.data) == 1 and one.usage.prompt_tokens == len(ids[1])
    text = client.embeddings.create(model="tiny", input=SENTENCES[2], encoding_format="float")
    assert _cosines(np.array(text.data[0].embedding), reference[2]) > 0.9999


def test_embeddings_dimensions(
    embed_server: RemoteServer,
    client: openai.OpenAI,
    embed_model: Path,
    encode: Callable[[torch.dtype], torch.Tensor],
) -> None:
    cut = client.embeddings.create(model="tiny", input=SENTENCES, dimensions=16, encoding_format="float")
    got = torch.tensor([d.embedding for d in cut.data])
    assert_close_in_dtype(
        got, lambda dtype: F.normalize(encode(dtype)[:, :16], dim=-1), _served_dtype(embed_model), rtol=0
    )
    raw = httpx.post(
        f"{embed_server.url}/v1/embeddings",
        json={"input": SENTENCES[0], "dimensions": 8, "encoding_format": "base64"},
        timeout=60,
    ).json()
    decoded = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    assert decoded.shape == (8,) and abs(np.linalg.norm(decoded) - 1) < 1e-5


def test_pooling_and_score_on_embedding_model(embed_server: RemoteServer, reference: np.ndarray) -> None:
    pooled = httpx.post(f"{embed_server.url}/pooling", json={"input": SENTENCES}, timeout=60).json()
    assert [d["object"] for d in pooled["data"]] == ["pooling"] * 3
    assert np.all(_cosines(np.array([d["data"] for d in pooled["data"]]), reference) > 0.9999)
    score = httpx.post(
        f"{embed_server.url}/v1/score", json={"text_1": SENTENCES[0], "text_2": SENTENCES[1:]}, timeout=60
    ).json()
    # The cosines of the server's own embeddings (those are held to the reference above and in
    # test_embeddings_dimensions; a cosine of two rounded vectors is checked exactly this way).
    vectors = torch.tensor([d["data"] for d in pooled["data"]], dtype=torch.float64)
    expected = F.cosine_similarity(vectors[1:], vectors[0:1], dim=-1)
    got = torch.tensor([d["score"] for d in score["data"]], dtype=torch.float64)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    too_many = httpx.post(
        f"{embed_server.url}/score", json={"text_1": "a", "text_2": ["b"] * 2049}, timeout=60
    )
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "text_2"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "hello", "dimensions": 65}, "dimensions"),
        ({"input": [], "encoding_format": "float"}, "input"),
        ({"input": [[5, 999999]]}, "input"),
        ({"input": "hello", "encoding_format": "hex"}, "encoding_format"),
        ({"input": " ".join(["hello"] * 200)}, "input"),
        ({"input": "hello", "truncate_prompt_tokens": 8}, "truncate_prompt_tokens"),
        ({"input": ["hello"] * 2049}, "input"),
    ],
)
def test_embeddings_bad_input_400(embed_server: RemoteServer, body: dict, param: str) -> None:
    response = httpx.post(f"{embed_server.url}/v1/embeddings", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "BadRequestError"


def test_generation_routes_404_on_pooling_model(embed_server: RemoteServer, client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="tiny", prompt="hello", max_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="other", input="hello")


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    path = tmp_path_factory.mktemp("cross-encoder")
    return path, make_tiny_cross_encoder(path, seed=2)


def test_score_and_rerank_with_cross_encoder(cross_encoder: tuple[Path, torch.nn.Module]) -> None:
    path, hf = cross_encoder
    query = "what is paged attention?"
    documents = ["a cat sat on the mat", "it stores keys and values in blocks", "hello world"]
    tokenizer = AutoTokenizer.from_pretrained(path)
    batch = tokenizer([query] * 3, documents, padding=True, return_tensors="pt")
    dtype = _served_dtype(path)

    @torch.no_grad()
    def scores(dtype: torch.dtype) -> torch.Tensor:
        return torch.sigmoid(in_dtype(hf, dtype)(**batch).logits[:, 0].float())

    expected = scores(torch.float32)
    remote = RemoteServer(extra_args=["--model", str(path), *POOLING_ARGS, "--api-key", KEY])
    http = httpx.Client(base_url=remote.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    try:
        # The pooling routes need the key as the /v1 ones do.
        for route in ("/pooling", "/score", "/rerank", "/v1/score", "/v1/rerank"):
            assert httpx.post(f"{remote.url}{route}", json={}).status_code == 401, route
        for route in ("/score", "/v1/score"):
            body = http.post(route, json={"text_1": query, "text_2": documents})
            assert body.status_code == 200, body.text
            got = torch.tensor([d["score"] for d in body.json()["data"]])
            tolerance = assert_close_in_dtype(got, scores, dtype, atol=1e-5, rtol=0)
        for route in ("/rerank", "/v1/rerank"):
            body = http.post(route, json={"query": query, "documents": documents, "top_n": 2}).json()
            # The best two by the server's scores, each its document's score (the order of two scores
            # within rounding of each other is the rounding's).
            results = body["results"]
            order = [r["index"] for r in results]
            assert len(order) == 2 and [r["document"]["text"] for r in results] == [documents[i] for i in order]
            relevance = torch.tensor([r["relevance_score"] for r in results])
            torch.testing.assert_close(relevance, expected[order], atol=tolerance, rtol=0)
            (left_out,) = set(range(len(documents))) - set(order)
            assert relevance[0] >= relevance[1] and expected[left_out] <= expected[order[1]] + 2 * tolerance
        # A cross-encoder has no embeddings; an unknown pairing is a 400 naming the field.
        response = http.post("/v1/embeddings", json={"input": "hello"})
        assert response.status_code == 400 and "Embeddings API" in response.json()["error"]["message"]
        response = http.post("/score", json={"text_1": ["a", "b"], "text_2": ["c", "d", "e"]})
        assert response.status_code == 400 and response.json()["error"]["param"] == "text_2"
    finally:
        http.close()
        remote.kill()
