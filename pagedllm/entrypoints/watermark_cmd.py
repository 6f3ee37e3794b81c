"""`pagedllm watermark detect --model M --key K --algorithm A (--text T | --file F)`: score a text against
a watermark key and print the detection (score, p-value, scored tokens) as JSON."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from pagedllm.watermark import ALGORITHMS

    parser = subparsers.add_parser(
        "watermark", help="Detect output watermarks.", description="Output watermark tools."
    )
    actions = parser.add_subparsers(dest="watermark_command", metavar="<action>", required=True)
    detect = actions.add_parser(
        "detect",
        help="Score a text against a watermark key.",
        description="Tokenize the text with the model's tokenizer and test whether it carries the key's "
        "watermark; prints JSON with the score and the p-value (small: watermarked).",
    )
    detect.add_argument("--model", required=True, help="The model (its tokenizer) that generated the text.")
    detect.add_argument(
        "--key", type=int, required=True, help="watermark_config.key of the generating engine."
    )
    detect.add_argument(
        "--algorithm", choices=ALGORITHMS, default="gumbel", help="watermark_config.algorithm."
    )
    detect.add_argument("--alpha", type=float, default=0.5, help="watermark_config.alpha (dual_key_gumbel).")
    source = detect.add_mutually_exclusive_group(required=True)
    source.add_argument("--text", help="The text to score.")
    source.add_argument("--file", type=Path, help="A UTF-8 file holding the text to score.")
    return parser


def run(args: argparse.Namespace) -> int:
    from pagedllm.watermark import detect

    assert args.watermark_command == "detect", args.watermark_command
    try:
        text = args.text if args.text is not None else args.file.read_text(encoding="utf-8")
        result = detect(text, args.key, args.algorithm, alpha=args.alpha, model=args.model)
    except (OSError, ValueError) as e:
        print(f"pagedllm watermark detect: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result.to_dict()))
    return 0
