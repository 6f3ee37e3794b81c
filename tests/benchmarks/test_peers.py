"""The peer benchmark's pure parts (benchmarks/peers) and its models (scripts/make_bench_model.py): the
workloads every engine gets, the weight bytes behind the roofline, the ratios it prints, the engines it
picks. Running the engines is the benchmark's job, not the suite's: its figures and the commands that
made them live in benchmarks/RESULTS.md."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from tiny_llm import SPECIAL_TOKENS, build_tokenizer, make_tiny_llm
from transformers import AutoModelForCausalLM

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO / "scripts"))
import make_bench_model  # noqa: E402
from peers import report, runner, workload  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llm(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def bench_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """make_bench_model's 1B recipe at a tiny size: bf16 safetensors and its BF16 GGUF."""
    out = tmp_path_factory.mktemp("bench_llama")
    config = make_bench_model.llama_1b_config(
        hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
    )
    make_bench_model.write_llama_hf(out, config)
    (out / "gguf").mkdir()
    make_bench_model.write_llama_gguf(out, out / "gguf" / "tiny-BF16.gguf")
    return out


def test_jobs_are_seeded_distinct_and_avoid_special_tokens(tiny: Path) -> None:
    model = workload.read_model(tiny)
    special = {build_tokenizer().convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}  # all three, not just bos/eos/pad
    assert model.kind == "hf" and set(model.special_ids) == special and not model.large
    a = workload.offline_job(model, 20, (8, 40), 5, seed=3)
    assert a == workload.offline_job(model, 20, (8, 40), 5, seed=3)
    assert a["prompts"] != workload.offline_job(model, 20, (8, 40), 5, seed=4)["prompts"]
    ids = [t for p in a["prompts"] + a["warmup_prompts"] for t in p]
    assert all(8 <= len(p) <= 40 for p in a["prompts"]) and len(a["prompts"]) == 20
    assert not special & set(ids) and max(ids) < model.vocab_size
    assert a["warmup_prompts"][0] not in a["prompts"] and a["max_model_len"] == 45
    assert max(len(p) for p in a["warmup_prompts"]) + a["warmup_output_len"] <= a["max_model_len"]
    decode = workload.decode_job(model, 24, 6, iters=2, seed=0)
    prompts = [decode["warmup_prompt"], *(p for pair in decode["prompt_pairs"] for p in pair)]
    assert len(prompts) == 5 and {len(p) for p in prompts} == {24}
    assert len({tuple(p) for p in prompts}) == 5  # nothing a prefix cache could reuse
    prefill = workload.prefill_job(model, [16, 32], 2, 0)["prompts_by_length"]
    assert {k: [len(p) for p in v["timed"]] + [len(v["warmup"])] for k, v in prefill.items()} == {
        "16": [16, 16, 16],
        "32": [32, 32, 32],
    }


def test_model_facts_count_the_weights_a_decode_step_reads(tiny: Path, bench_llama: Path) -> None:
    untied = workload.read_model(tiny)
    hf = AutoModelForCausalLM.from_pretrained(tiny)
    params = sum(p.numel() for p in hf.parameters())
    assert untied.num_params == params
    # Untied: the embedding is gathered a row a step, not read whole; the LM head is.
    assert untied.step_elements == params - hf.model.embed_tokens.weight.numel()
    assert untied.step_bytes("bfloat16", stored=False) == 2 * untied.step_elements
    tied_gguf = workload.read_model(bench_llama / "gguf" / "tiny-BF16.gguf")
    assert tied_gguf.kind == "gguf" and tied_gguf.vocab_size == 49152
    tied_hf = workload.read_model(bench_llama)
    assert tied_gguf.num_params == tied_hf.num_params == tied_hf.step_elements  # tied: the head is the table
    norms = 2 * 2 * 128 + 128  # float32 in the GGUF, as llama.cpp's converter keeps them
    assert tied_gguf.step_stored_bytes == 2 * tied_hf.num_params + 2 * norms
    assert tied_gguf.special_ids == workload.read_model(make_bench_model.embedded_gguf()).special_ids


def test_bench_gguf_is_the_same_model_as_its_safetensors(bench_llama: Path) -> None:
    """The converter's q/k row order and names: transformers reads the GGUF back to the same logits."""
    ids = torch.randint(3, 49152, (1, 12), generator=torch.Generator().manual_seed(0))
    ours = AutoModelForCausalLM.from_pretrained(bench_llama, dtype=torch.float32)
    back = AutoModelForCausalLM.from_pretrained(bench_llama / "gguf", gguf_file="tiny-BF16.gguf", dtype=torch.float32)
    with torch.no_grad():
        expected, got = ours(ids).logits, back(ids).logits
    assert torch.equal(expected, got)
    assert 0.05 < expected.std() < 5  # spread logits, neither flat nor one-hot


def test_report_ratio_is_pagedllm_ahead_above_one() -> None:
    def run(engine: str, repeat: int, **result) -> dict:
        return {"engine": engine, "repeat": repeat, "result": {"ok": True, **result}}

    runs = [
        run("pagedllm", 0, total_tokens_per_s=100.0, ttft_s=0.010),
        run("vllm", 0, total_tokens_per_s=50.0, ttft_s=0.030),
        run("vllm", 1, total_tokens_per_s=80.0, ttft_s=0.020),
        run("pagedllm", 1, total_tokens_per_s=120.0, ttft_s=0.010),
        {"engine": "hf", "repeat": 0, "result": {"ok": False, "error": "boom"}},
        run("hf", 1, total_tokens_per_s=10.0, ttft_s=1.0),
    ]
    metrics = [report.OFFLINE[0], report.DECODE[-1]]
    summary = report.summarize(runs, metrics, ["pagedllm", "vllm", "hf"])
    rate, ttft = summary["total tok/s"], summary["TTFT ms (prompt)"]
    assert rate["pagedllm_vs"]["vllm"]["per_repeat"] == [2.0, 1.5]
    assert rate["pagedllm_vs"]["vllm"]["of_medians"] == pytest.approx(110 / 65)
    assert rate["pagedllm_vs"]["hf"]["per_repeat"] == [None, 12.0]
    assert ttft["pagedllm_vs"]["vllm"]["per_repeat"] == pytest.approx([3.0, 2.0])  # their time over ours
    assert ttft["values"]["hf"] == [None, pytest.approx(1000.0)]


def test_engines_without_their_venv_are_skipped_with_the_reason(tmp_path: Path) -> None:
    chosen, skipped = runner.choose_engines(None, "hf", tmp_path)
    assert [s.name for s in chosen] == ["pagedllm", "hf"]
    assert skipped == [f"vllm: no venv at {tmp_path / 'vllm-venv'} (run benchmarks/peers/install.sh)"]
    chosen, skipped = runner.choose_engines("llama.cpp,hf,pagedllm", "gguf", tmp_path)
    assert [s.name for s in chosen] == ["pagedllm"]
    assert any(r.startswith("llama.cpp: no venv") for r in skipped)
    assert "hf: takes hf models, not gguf" in skipped
    with pytest.raises(SystemExit, match="unknown"):
        runner.choose_engines("pagedllm,tgi", "hf", tmp_path)
