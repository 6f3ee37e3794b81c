"""llama.cpp in the peer benchmark, through llama-cpp-python's low-level bindings (its own venv): the
model and context at llama.cpp's own defaults (flash attention "auto", n_batch 2048, n_ubatch 512,
weight repacking on), `threads` for generation and for batches, and up to `parallel` sequences decoded
together the way llama.cpp's parallel example and server slots do: one `llama_decode` a step holding one
token of every decoding sequence and prompt chunks of new ones (up to n_batch tokens), each sequence in
its own KV stream (`kv_unified` off: its attention reads its own cells only), greedy argmax of the
logits.

On CPUs with AMX, llama.cpp's AMX weight repacking (an extra buffer type) crashes on products of more
than one row (llama.cpp issue 20824): there `use_extra_bufts` is turned off, and the result says so.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

from common import main


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return set()
    return set(line.partition(":")[2].split())


@dataclass
class _Sequence:
    pending: list[int]  # prompt tokens not yet fed
    pos: int = 0
    generated: int = 0
    last: int | None = None  # the last sampled token, fed at the next step
    logits_row: int = -1  # row of this step's batch whose logits sample the next token


class LlamaCpp:
    def __init__(self, job: dict[str, Any]) -> None:
        import llama_cpp as lc
        import numpy as np

        self.lc, self.np = lc, np
        self.notes: list[str] = []
        lc.llama_backend_init()
        mparams = lc.llama_model_default_params()
        if {"amx_tile", "amx_bf16", "amx_int8"} & _cpu_flags():
            mparams.use_extra_bufts = False
            self.notes.append(
                "AMX CPU: llama.cpp's extra buffer types (AMX weight repacking) turned off, as they crash on "
                "multi-row products (llama.cpp issue 20824)"
            )
        self.model = lc.llama_model_load_from_file(job["model"].encode(), mparams)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {job['model']}")
        self.parallel = job["parallel"]
        per_seq = -(-job["max_model_len"] // 256) * 256
        cparams = lc.llama_context_default_params()
        cparams.n_ctx = per_seq * self.parallel
        cparams.n_seq_max = self.parallel
        cparams.n_threads = cparams.n_threads_batch = job["threads"]
        cparams.kv_unified = False
        cparams.no_perf = True
        self.cparams = cparams
        self.ctx = lc.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create the context")
        self.n_batch = lc.llama_n_batch(self.ctx)
        self.n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))
        self.batch = lc.llama_batch_init(self.n_batch, 0, 1)
        self.memory = lc.llama_get_memory(self.ctx)
        self.mparams = mparams

    def _argmax(self, row: int) -> int:
        logits = self.lc.llama_get_logits_ith(self.ctx, row)
        return int(self.np.ctypeslib.as_array(logits, shape=(self.n_vocab,)).argmax())

    def _add(self, token: int, pos: int, seq_id: int, logits: bool) -> int:
        b, i = self.batch, self.batch.n_tokens
        b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = token, pos, 1, logits
        b.seq_id[i][0] = seq_id
        b.n_tokens = i + 1
        return i

    def generate(self, prompts: list[list[int]], output_len: int) -> int:
        lc = self.lc
        lc.llama_memory_clear(self.memory, True)
        queue = deque(prompts)
        free = list(range(self.parallel))
        active: dict[int, _Sequence] = {}
        produced = 0
        while queue or active:
            while queue and free:
                active[free.pop()] = _Sequence(pending=list(queue.popleft()))
            self.batch.n_tokens = 0
            for seq_id, seq in active.items():  # one token of every decoding sequence first
                if seq.last is not None:
                    seq.logits_row = self._add(seq.last, seq.pos, seq_id, True)
                    seq.pos += 1
            for seq_id, seq in active.items():  # then prompt chunks, up to n_batch in all
                room = self.n_batch - self.batch.n_tokens
                if not seq.pending or room <= 0:
                    continue
                chunk, seq.pending = seq.pending[:room], seq.pending[room:]
                for j, token in enumerate(chunk):
                    last = not seq.pending and j == len(chunk) - 1
                    row = self._add(token, seq.pos + j, seq_id, last)
                    if last:
                        seq.logits_row = row
                seq.pos += len(chunk)
            rc = lc.llama_decode(self.ctx, self.batch)
            if rc != 0:
                raise RuntimeError(f"llama_decode returned {rc} (KV cache full?)")
            for seq_id, seq in list(active.items()):
                if seq.logits_row < 0:
                    continue
                seq.last = self._argmax(seq.logits_row)
                seq.logits_row = -1
                seq.generated += 1
                produced += 1
                if seq.generated == output_len:
                    lc.llama_memory_seq_rm(self.memory, seq_id, -1, -1)
                    del active[seq_id]
                    free.append(seq_id)
        return produced

    def describe(self) -> dict[str, Any]:
        import llama_cpp as lc

        c = self.cparams
        flags = {
            "n_threads": c.n_threads,
            "n_threads_batch": c.n_threads_batch,
            "n_ctx": c.n_ctx,
            "n_seq_max (parallel sequences)": c.n_seq_max,
            "n_batch": self.n_batch,
            "n_ubatch": c.n_ubatch,
            "flash_attn_type": lc.llama_flash_attn_type_name(c.flash_attn_type).decode(),
            "kv_unified": c.kv_unified,
            "use_extra_bufts": self.mparams.use_extra_bufts,
            "system_info": lc.llama_print_system_info().decode().strip(),
        }
        return {"version": {"llama-cpp-python": lc.__version__}, "flags": flags, "notes": self.notes}


if __name__ == "__main__":
    main(LlamaCpp)
