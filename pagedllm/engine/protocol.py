"""Messages between the front-end (LLMEngine / AsyncLLM) and the EngineCore.

msgspec structs so the same types cross the ZMQ socket of the server unchanged. The core defines them
(core/ never imports engine/); this module is the front-end's one place to import them from.
"""

from pagedllm.core.outputs import EngineCoreOutput, EngineCoreOutputs, FinishReason, SchedulerStats
from pagedllm.core.request import EngineCoreRequest

__all__ = ["EngineCoreOutput", "EngineCoreOutputs", "EngineCoreRequest", "FinishReason", "SchedulerStats"]
