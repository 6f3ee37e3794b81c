"""`pagedllm bench embed`: offline embeddings per second, with sentence-transformers beside it.

The workload is N random sentences of common words (seeded); both engines embed the same texts in the
same run, and the report gives their embeddings/s and the lowest cosine similarity between the two
sides' vectors (a check that the figures compare the same computation). `--random-minilm DIR` first
writes a random-weights model shaped like all-MiniLM-L6-v2 (with a synthetic WordPiece vocabulary and
sentence-transformers' mean pooling + normalisation) and benchmarks it."""

from __future__ import annotations

import argparse
import gc
import json
import random
import time
from pathlib import Path

from pagedllm.config.args import EngineArgs

_WORDS = (
    "the of and to in is was for on that with as by at from his her it an are were which be this has "
    "had not but what all when can there who been one their more if will out so up said about into "
    "than them some could time these two may first then do any like my now over such our man me even "
    "most made after also did many before must through back years where much your way well down should "
    "because each just those people how too little state good very make world still own see men work "
    "long get here between both life being under never day same another know while last might us great "
    "old year off come since against go came right used take three model attention cache token search"
).split()


def random_sentences(num: int, seed: int, min_words: int = 6, max_words: int = 30) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choices(_WORDS, k=rng.randint(min_words, max_words))) for _ in range(num)]


def write_random_minilm(path: Path, seed: int = 0) -> Path:
    """A random all-MiniLM-L6-v2-shaped BertModel (384 hidden, 6 layers, 12 heads, 30522 tokens) with
    sentence-transformers' modules (mean pooling, Normalize)."""
    import torch
    from transformers import BertConfig, BertModel, BertTokenizerFast

    path.mkdir(parents=True, exist_ok=True)
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    vocab = list(dict.fromkeys(specials + _WORDS + letters + [f"##{c}" for c in letters]))
    filler = [f"[unused{i}]" for i in range(30522 - len(vocab))]
    (path / "vocab.txt").write_text("\n".join(vocab + filler) + "\n")
    BertTokenizerFast(vocab=str(path / "vocab.txt"), do_lower_case=True).save_pretrained(path)
    config = BertConfig(
        vocab_size=30522, hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536
    )
    torch.manual_seed(seed)
    BertModel(config).save_pretrained(path)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir(exist_ok=True)
    (path / "2_Normalize").mkdir(exist_ok=True)
    pooling = {"word_embedding_dimension": 384, "pooling_mode_mean_tokens": True}
    (path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    (path / "sentence_bert_config.json").write_text(
        json.dumps({"max_seq_length": 256, "do_lower_case": False})
    )
    return path


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("embed", help="Offline embeddings/s (pooling models).")
    group = parser.add_argument_group("Workload")
    group.add_argument("--num-prompts", type=int, default=1000)
    group.add_argument("--seed-workload", type=int, default=0, help="Seed of the random sentences.")
    group.add_argument(
        "--random-minilm",
        metavar="DIR",
        default=None,
        help="Write a random all-MiniLM-L6-v2-shaped model to DIR and benchmark it (overrides --model).",
    )
    group.add_argument(
        "--baseline",
        choices=["none", "sentence-transformers"],
        default="none",
        help="Also embed the same sentences with sentence-transformers and print the ratio.",
    )
    group.add_argument("--st-batch-size", type=int, default=32, help="sentence-transformers' batch size.")
    group.add_argument("--output-json", default=None, help="Write the figures to this JSON file.")
    EngineArgs.add_cli_args(parser)
    return parser


def run(args: argparse.Namespace) -> int:
    import numpy as np

    from pagedllm.llm import LLM

    if args.random_minilm is not None:
        args.model = str(write_random_minilm(Path(args.random_minilm)))
    sentences = random_sentences(args.num_prompts, args.seed_workload)
    llm = LLM.from_engine_args(EngineArgs.from_cli_args(args))
    model_config = llm.llm_engine.model_config
    llm.embed(sentences[:8], use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outputs = llm.embed(sentences, use_tqdm=False)
    elapsed = time.perf_counter() - start
    ours = np.array([o.outputs.embedding for o in outputs], dtype=np.float32)
    num_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    report: dict[str, object] = {
        "model": model_config.model,
        "dtype": str(model_config.dtype).removeprefix("torch."),
        "num_prompts": len(sentences),
        "num_prompt_tokens": num_tokens,
        "elapsed_s": elapsed,
        "embeddings_per_s": len(sentences) / elapsed,
        "tokens_per_s": num_tokens / elapsed,
    }
    print(
        f"pagedllm: {len(sentences) / elapsed:.1f} embeddings/s, {num_tokens / elapsed:.0f} tok/s ({elapsed:.2f} s)"
    )
    if args.baseline == "sentence-transformers":
        llm.llm_engine.shutdown()
        del llm
        gc.collect()
        from sentence_transformers import SentenceTransformer

        st = SentenceTransformer(str(model_config.model_path), device="cpu")
        st.encode(sentences[:8], batch_size=args.st_batch_size)
        start = time.perf_counter()
        theirs = st.encode(sentences, batch_size=args.st_batch_size)
        st_elapsed = time.perf_counter() - start
        cosines = (ours * theirs).sum(-1) / (np.linalg.norm(ours, axis=-1) * np.linalg.norm(theirs, axis=-1))
        report["baseline"] = {
            "name": "sentence-transformers",
            "batch_size": args.st_batch_size,
            "elapsed_s": st_elapsed,
            "embeddings_per_s": len(sentences) / st_elapsed,
        }
        report["ratio_vs_sentence_transformers"] = st_elapsed / elapsed
        report["min_cosine_vs_sentence_transformers"] = float(cosines.min())
        print(
            f"sentence-transformers (batch {args.st_batch_size}): {len(sentences) / st_elapsed:.1f} embeddings/s "
            f"({st_elapsed:.2f} s); ratio {st_elapsed / elapsed:.2f}x; min cosine {cosines.min():.6f}"
        )
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(report, f, indent=2)
    return 0
