"""Pooling models through `LLM.embed` / `LLM.score` against sentence-transformers and transformers on the
same tiny random weights: BERT encoders (CLS / MEAN pooling, normalisation, Matryoshka dimensions), a
BERT cross-encoder, and Qwen3 decoders used as last-token embedders. The engine runs in the machine's
default dtype; the references run in float32, and the tolerance is what that dtype's rounding does to
the reference run in it (`dtype_tolerance`)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from dtype_tolerance import assert_close_in_dtype, in_dtype
from tiny_models import make_tiny_model
from tiny_pooling_models import make_tiny_bert, make_tiny_cross_encoder
from transformers import AutoTokenizer

from pagedllm import LLM
from pagedllm.pooling_params import PoolingParams

SENTENCES = [
    "the quick brown fox jumps over the lazy dog",
    "hello world",
    "a cat sat on the mat",
    "what is paged attention? it stores keys and values in blocks.",
    "i",
]
ENGINE_ARGS = dict(max_num_seqs=4, kv_cache_memory_bytes=2**24, enforce_eager=True)


def _embeddings(llm: LLM, prompts: list, params: PoolingParams | None = None) -> torch.Tensor:
    return torch.tensor([o.outputs.embedding for o in llm.embed(prompts, params, use_tqdm=False)])


def _cosine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return F.cosine_similarity(a.float(), b.float(), dim=-1)


def _dtype(llm: LLM) -> torch.dtype:
    return llm.llm_engine.model_config.dtype


@pytest.fixture(scope="module")
def bert_mean(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("bert-mean")
    make_tiny_bert(path, pooling="mean", normalize=True)
    return path


@pytest.fixture(scope="module")
def bert_mean_llm(bert_mean: Path) -> Iterator[LLM]:
    llm = LLM(str(bert_mean), **ENGINE_ARGS)
    yield llm
    llm.llm_engine.shutdown()


def test_bert_mean_matches_sentence_transformers(bert_mean: Path, bert_mean_llm: LLM) -> None:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(bert_mean), device="cpu")

    def reference(dtype: torch.dtype) -> torch.Tensor:
        return in_dtype(model, dtype).encode(SENTENCES, convert_to_tensor=True).float()

    got = _embeddings(bert_mean_llm, SENTENCES)
    assert got.shape == reference(torch.float32).shape
    assert torch.all(_cosine(got, reference(torch.float32)) > 0.9999)
    # The Normalize module is read from modules.json.
    torch.testing.assert_close(got.norm(dim=-1), torch.ones(len(SENTENCES)), atol=1e-5, rtol=0)
    assert_close_in_dtype(got, reference, _dtype(bert_mean_llm))


def test_more_prompts_than_max_num_seqs_and_token_ids(bert_mean_llm: LLM) -> None:
    tokenizer = bert_mean_llm.get_tokenizer()
    prompts = SENTENCES * 3
    by_text = _embeddings(bert_mean_llm, prompts)
    by_ids = _embeddings(bert_mean_llm, [{"prompt_token_ids": tokenizer.encode(s)} for s in prompts])
    torch.testing.assert_close(by_text, by_ids, atol=1e-5, rtol=0)
    # The same sentence in other batches gives the same vector (padding of the batch does not leak).
    torch.testing.assert_close(by_text[:5], by_text[5:10], atol=1e-5, rtol=0)


def test_matryoshka_dimensions_truncate_then_normalize(bert_mean_llm: LLM) -> None:
    full = _embeddings(bert_mean_llm, SENTENCES, PoolingParams(normalize=False))
    cut = _embeddings(bert_mean_llm, SENTENCES, PoolingParams(dimensions=16))
    assert cut.shape == (len(SENTENCES), 16)
    torch.testing.assert_close(cut, F.normalize(full[:, :16], dim=-1), atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="dimensions=65 must be between 1 and the hidden size 64"):
        bert_mean_llm.embed(SENTENCES[:1], PoolingParams(dimensions=65), use_tqdm=False)


def test_score_of_embedding_model_is_cosine_similarity(bert_mean_llm: LLM) -> None:
    scores = bert_mean_llm.score(SENTENCES[0], SENTENCES[1:3], use_tqdm=False)
    vectors = _embeddings(bert_mean_llm, SENTENCES[:3])
    expected = _cosine(vectors[0:1], vectors[1:3])
    torch.testing.assert_close(torch.tensor([s.outputs.score for s in scores]), expected, atol=1e-5, rtol=0)


def test_generate_on_pooling_model_is_refused(bert_mean_llm: LLM) -> None:
    with pytest.raises(ValueError, match="pooling model"):
        bert_mean_llm.generate(["hello"], use_tqdm=False)
    with pytest.raises(ValueError, match="does not support 'classify'"):
        bert_mean_llm.classify(["hello"], use_tqdm=False)


def test_bert_cls_without_sentence_transformers_matches_transformers(tmp_path: Path) -> None:
    """No modules.json: vLLM's encoder default, the CLS token, normalised."""
    hf = make_tiny_bert(tmp_path, pooling=None, seed=3)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    llm = LLM(str(tmp_path), **ENGINE_ARGS)
    got = _embeddings(llm, SENTENCES)
    batch = tokenizer(SENTENCES, padding=True, return_tensors="pt")

    @torch.no_grad()
    def reference(dtype: torch.dtype) -> torch.Tensor:
        return F.normalize(in_dtype(hf, dtype)(**batch).last_hidden_state[:, 0].float(), dim=-1)

    assert torch.all(_cosine(got, reference(torch.float32)) > 0.9999)
    assert_close_in_dtype(got, reference, _dtype(llm))


def test_bert_pooler_config_overrides(tmp_path: Path) -> None:
    hf = make_tiny_bert(tmp_path, pooling="cls", normalize=True, seed=4)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    llm = LLM(str(tmp_path), pooler_config={"pooling_type": "MEAN", "normalize": False}, **ENGINE_ARGS)
    got = _embeddings(llm, SENTENCES)
    batch = tokenizer(SENTENCES, padding=True, return_tensors="pt")
    mask = batch["attention_mask"][..., None].float()

    @torch.no_grad()
    def mean(dtype: torch.dtype) -> torch.Tensor:
        hidden = in_dtype(hf, dtype)(**batch).last_hidden_state.float()
        return (hidden * mask).sum(1) / mask.sum(1)

    assert_close_in_dtype(got, mean, _dtype(llm))


def test_cross_encoder_scores_match_transformers(tmp_path: Path) -> None:
    hf = make_tiny_cross_encoder(tmp_path, num_labels=1, seed=5)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    query = "what is paged attention?"
    documents = ["it stores keys and values in blocks", "a cat sat on the mat", "hello world"]
    llm = LLM(str(tmp_path), **ENGINE_ARGS)
    got = torch.tensor([s.outputs.score for s in llm.score(query, documents, use_tqdm=False)])
    batch = tokenizer([query] * len(documents), documents, padding=True, return_tensors="pt")
    # The second segment's token types matter: without them the logits differ.
    assert batch["token_type_ids"].any()

    @torch.no_grad()
    def scores(dtype: torch.dtype) -> torch.Tensor:
        return torch.sigmoid(in_dtype(hf, dtype)(**batch).logits[:, 0].float())

    tolerance = assert_close_in_dtype(got, scores, _dtype(llm), atol=1e-5)
    with torch.no_grad():
        untyped = hf(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, 0]
    assert (got - torch.sigmoid(untyped)).abs().max() > 2 * tolerance
    with pytest.raises(ValueError, match="does not support 'embed'"):
        llm.embed(["hello"], use_tqdm=False)


def test_cross_encoder_classify_softmax(tmp_path: Path) -> None:
    hf = make_tiny_cross_encoder(tmp_path, num_labels=3, seed=6)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    llm = LLM(str(tmp_path), **ENGINE_ARGS)
    got = torch.tensor([o.outputs.probs for o in llm.classify(SENTENCES, use_tqdm=False)])
    batch = tokenizer(SENTENCES, padding=True, return_tensors="pt")

    @torch.no_grad()
    def probs(dtype: torch.dtype) -> torch.Tensor:
        return torch.softmax(in_dtype(hf, dtype)(**batch).logits.float(), dim=-1)

    assert_close_in_dtype(got, probs, _dtype(llm), atol=1e-5)


def _last_token_reference(hf: torch.nn.Module, prompts: list[list[int]]) -> torch.Tensor:
    with torch.no_grad():
        return torch.stack(
            [
                hf(input_ids=torch.tensor([p]), output_hidden_states=True).hidden_states[-1][0, -1]
                for p in prompts
            ]
        )


PROMPTS = [[5, 17, 42, 99, 3], [7], list(range(20, 60)), [250, 1, 2]]


def test_qwen3_causal_lm_as_last_token_embedder(tmp_path: Path) -> None:
    hf = make_tiny_model("qwen3-qknorm", tmp_path)
    llm = LLM(str(tmp_path), runner="pooling", max_model_len=128, skip_tokenizer_init=True, **ENGINE_ARGS)
    got = _embeddings(llm, [{"prompt_token_ids": p} for p in PROMPTS])

    def reference(dtype: torch.dtype) -> torch.Tensor:
        return F.normalize(_last_token_reference(in_dtype(hf, dtype), PROMPTS).float(), dim=-1)

    assert torch.all(_cosine(got, reference(torch.float32)) > 0.9999)
    assert_close_in_dtype(got, reference, _dtype(llm))


def test_qwen3_model_checkpoint_convert_embed(tmp_path: Path) -> None:
    """A `Qwen3Model` checkpoint (Qwen3-Embedding's shape: no LM head, no `model.` prefix)."""
    hf = make_tiny_model("qwen3-qknorm", tmp_path / "lm")
    hf.model.config.architectures = ["Qwen3Model"]
    hf.model.save_pretrained(tmp_path / "body")
    llm = LLM(
        str(tmp_path / "body"), convert="embed", max_model_len=128, skip_tokenizer_init=True, **ENGINE_ARGS
    )
    assert llm.llm_engine.model_config.pooler_config["pooling_type"] == "LAST"
    got = _embeddings(llm, [{"prompt_token_ids": p} for p in PROMPTS])
    reference = F.normalize(_last_token_reference(hf, PROMPTS), dim=-1)
    assert torch.all(_cosine(got, reference) > 0.9999)
