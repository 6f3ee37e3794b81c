"""The `ray` executor on a local two-node Ray cluster (one CPU per node, so one rank per node):
TP=2 and PP=2 give the tokens and logits of one rank (PP=2 with two batches in flight), a killed
actor fails the engine within 5 s naming its rank, and shutdown leaves no actor alive."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch  # noqa: E402
from test_parallel import CONCURRENT_PROMPTS, _assert_same, _generate, _llm, _one_rank  # noqa: E402

from pagedllm import SamplingParams  # noqa: E402
from pagedllm.platforms import current_platform  # noqa: E402

ray = pytest.importorskip("ray")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from tiny_models import make_tiny_model  # noqa: E402


@pytest.mark.slow
def test_tp2_across_two_nodes(tmp_path: Path) -> None:
    from ray.cluster_utils import Cluster
    from ray.util.state import list_actors

    model_dir = tmp_path / "llama"
    make_tiny_model("llama-llama3rope", model_dir)
    want = _one_rank(model_dir)
    node = {"num_cpus": 1, "object_store_memory": 80 * 2**20}
    cluster = Cluster(initialize_head=True, head_node_args=node)
    cluster.add_node(**node)
    try:
        ray.init(address=cluster.address, log_to_driver=False)
        one = _llm(model_dir, distributed_executor_backend="ray")
        try:
            # Ray sets OMP_NUM_THREADS=1 in its actors: a rank alone on its machine still uses every core
            # (or the driver's OMP_NUM_THREADS, the user's choice).
            want_threads = int(os.environ.get("OMP_NUM_THREADS") or current_platform.get_cpu_count())
            assert one.collective_rpc(lambda worker: torch.get_num_threads()) == [want_threads]
        finally:
            one.llm_engine.shutdown()
        chunked = {"max_num_batched_tokens": 16, "enable_chunked_prefill": True}
        pp = _llm(model_dir, pipeline_parallel_size=2, distributed_executor_backend="ray", **chunked)
        try:
            _assert_same(_generate(pp, CONCURRENT_PROMPTS), _one_rank(model_dir, CONCURRENT_PROMPTS, **chunked))
            assert pp.llm_engine.engine_core.core.max_batches_in_flight == 2  # type: ignore[attr-defined]
        finally:
            pp.llm_engine.shutdown()
        llm = _llm(model_dir, tensor_parallel_size=2, distributed_executor_backend="ray")
        executor = llm.llm_engine.engine_core.core.model_executor  # type: ignore[attr-defined]
        actor_ids = {a._actor_id.hex() for a in executor.actors}
        placed = {a.node_id for a in list_actors(filters=[("state", "=", "ALIVE")]) if a.actor_id in actor_ids}
        assert len(placed) == 2  # one rank on each node
        engine = llm.llm_engine
        try:
            _assert_same(_generate(llm), want)
            # A dead actor mid-request: an error naming its rank within 5 s.
            engine.add_request("r", {"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=30, ignore_eos=True))
            engine.step()
            ray.kill(executor.actors[1])
            start = time.monotonic()
            with pytest.raises(RuntimeError, match="Ray worker rank 1 died"):
                while engine.has_unfinished_requests():
                    engine.step()
            assert time.monotonic() - start < 5
        finally:
            engine.shutdown()
        alive = [a for a in list_actors(filters=[("state", "=", "ALIVE")]) if a.actor_id in actor_ids]
        assert alive == []
    finally:
        ray.shutdown()
        cluster.shutdown()
