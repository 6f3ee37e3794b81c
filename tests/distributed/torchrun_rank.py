"""One rank of the external_launcher test, started by torchrun: TP=2 greedy generation, the tokens
and logits written to `<out>.<rank>.json`."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

# The rank imports its helpers as pytest's rootdir-relative sys.path would: tests/distributed for
# test_parallel, tests/ for dtype_tolerance.
sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
from test_parallel import _generate, _llm  # noqa: E402

if __name__ == "__main__":
    model_dir, out = sys.argv[1], sys.argv[2]
    llm = _llm(Path(model_dir), tensor_parallel_size=2, distributed_executor_backend="external_launcher")
    result = _generate(llm)
    Path(f"{out}.{os.environ['RANK']}.json").write_text(json.dumps(result))
    llm.llm_engine.shutdown()
