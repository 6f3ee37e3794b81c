"""ParallelConfig: tensor / pipeline / data parallel topology and the executor."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from pagedllm.config.utils import config, hash_fields

ExecutorBackend = Literal["uni", "mp", "ray", "external_launcher"]
All2AllBackend = Literal[
    "naive",
    "allgather_reducescatter",
    "deepep_low_latency",
    "deepep_high_throughput",
    "nixl_ep",
    "moonep",
]

# Whether each executor can keep two batches in flight (async scheduling). The executors report it
# here rather than through an import of pagedllm.executor so config construction stays import-light;
# flip an entry when its executor implements the overlap.
EXECUTOR_SUPPORTS_ASYNC: dict[str, bool] = {
    "uni": False,
    "mp": False,
    "ray": False,
    "external_launcher": False,
}


@config
class ParallelConfig:
    """Configuration of distributed execution."""

    tensor_parallel_size: Annotated[int, Field(ge=1)] = 1
    """Number of tensor parallel ranks (each holds a slice of every layer); pagedllm runs 1 for now."""
    pipeline_parallel_size: Annotated[int, Field(ge=1)] = 1
    """Number of pipeline stages (each holds a range of layers)."""
    data_parallel_size: Annotated[int, Field(ge=1)] = 1
    """Number of data parallel engine replicas."""
    data_parallel_index: Annotated[int, Field(ge=0)] = 0
    """Index of this replica among the data parallel ones (vLLM's --data-parallel-rank): the rank this
    server runs behind an external load balancer; `pagedllm serve` numbers its own engine cores."""
    data_parallel_external_lb: bool = False
    """Requests are balanced across data parallel replicas by an external load balancer: this server
    runs one rank (data_parallel_index) of data_parallel_size."""
    rank: Annotated[int, Field(ge=0)] = 0
    """Global rank of this worker (set by the executor)."""
    decode_context_parallel_size: Annotated[int, Field(ge=1)] = 1
    """Decode context parallel size (KV cache sharded along the sequence across TP ranks)."""
    prefill_context_parallel_size: Annotated[int, Field(ge=1)] = 1
    """Prefill context parallel size."""
    dcp_kv_cache_interleave_size: Annotated[int, Field(ge=1)] = 1
    """Tokens per rank interleave of the decode-context-parallel KV cache."""
    cp_kv_cache_interleave_size: Annotated[int, Field(ge=1)] = 1
    """Tokens per rank interleave of the context-parallel KV cache."""
    dcp_comm_backend: Literal["ag_rs", "a2a"] = "ag_rs"
    """Communication pattern of decode context parallelism."""
    disable_custom_all_reduce: bool = False
    """Use the library all-reduce instead of the custom one."""
    disable_nccl_for_dp_synchronization: bool | None = None
    """Synchronize data parallel ranks over gloo instead of NCCL; unset: on with async scheduling."""
    distributed_executor_backend: ExecutorBackend | None = None
    """Executor: "uni" (one process), "mp" (one process per rank), "ray", "external_launcher";
    unset: "uni" for one rank, "mp" otherwise."""
    enable_expert_parallel: bool = False
    """Shard MoE experts across ranks instead of tensor-slicing them."""
    enable_eplb: bool = False
    """Expert-parallel load balancing."""
    expert_placement_strategy: Literal["linear", "round_robin"] = "linear"
    """Placement of experts on expert-parallel ranks."""
    all2all_backend: All2AllBackend = "allgather_reducescatter"
    """All-to-all implementation for expert parallelism."""
    enable_dbo: bool = False
    """Dual batch overlap: split a batch into two micro-batches that overlap compute and communication."""
    enable_fault_tolerance: bool = False
    """Keep the engine alive when a worker fails (not supported by pagedllm)."""
    enable_batch_sharded_sampling: bool | None = None
    """Shard the sampler's batch across tensor parallel ranks."""
    is_moe_model: bool | None = None
    """Whether the model is a mixture of experts; copied from the model config."""

    def __post_init__(self) -> None:
        if self.data_parallel_index >= self.data_parallel_size:
            raise ValueError(
                f"data_parallel_rank={self.data_parallel_index} must be below "
                f"data_parallel_size={self.data_parallel_size}"
            )
        if self.data_parallel_index > 0 and not self.data_parallel_external_lb:
            raise ValueError(
                f"data_parallel_rank={self.data_parallel_index} names the one rank a server runs behind an "
                "external load balancer: add data_parallel_external_lb=True (--data-parallel-external-lb)"
            )
        if self.distributed_executor_backend is None:
            self.distributed_executor_backend = "uni" if self.world_size == 1 else "mp"
        # Upstream sets this from the KV connector; no connector here resolves it automatically.
        self._allow_auto_resolve_cp_interleave_size = False

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size * self.prefill_context_parallel_size

    @property
    def use_ubatching(self) -> bool:
        return self.enable_dbo

    @property
    def use_all2all(self) -> bool:
        return self.enable_expert_parallel and self.data_parallel_size * self.tensor_parallel_size > 1

    def set_dcp_defaults(self) -> None:
        """Context-parallel interleave: follow the decode-context interleave unless set separately."""
        if self.decode_context_parallel_size > 1 and self.cp_kv_cache_interleave_size == 1:
            self.cp_kv_cache_interleave_size = self.dcp_kv_cache_interleave_size

    def executor_supports_async_scheduling(self) -> bool:
        assert self.distributed_executor_backend is not None
        return EXECUTOR_SUPPORTS_ASYNC[self.distributed_executor_backend]

    def compute_hash(self) -> str:
        return hash_fields(
            self,
            (
                "tensor_parallel_size",
                "pipeline_parallel_size",
                "data_parallel_size",
                "decode_context_parallel_size",
                "prefill_context_parallel_size",
                "enable_expert_parallel",
                "all2all_backend",
                "enable_dbo",
                "distributed_executor_backend",
            ),
        )
