"""Spec 6.1: CUDA-graph capture sizes, exact values for every worked example."""

from __future__ import annotations

import logging

import pytest
from config_testing import build_cuda
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.config import CUDAGraphMode, SpeculativeConfig

G512 = [1, 2, 4] + list(range(8, 256, 8)) + list(range(256, 513, 16))


def sizes(cfg) -> tuple[int, list[int]]:
    cc = cfg.compilation_config
    return cc.max_cudagraph_capture_size, cc.cudagraph_capture_sizes


def eagle(k: int, **kw) -> SpeculativeConfig:
    return SpeculativeConfig(method="eagle", num_speculative_tokens=k, **kw)


def test_g512_has_51_entries() -> None:
    assert len(G512) == 51 and G512[-1] == 512


@pytest.mark.parametrize(
    ("name", "kwargs", "expected_max", "expected"),
    [
        ("C1", dict(seqs=256, tokens=8192), 512, G512),
        ("C2", dict(seqs=256, tokens=8192, capability=(10, 0)), 512, G512),
        ("C3", dict(seqs=8, tokens=2048), 16, [1, 2, 4, 8, 16]),
        ("C5", dict(seqs=8, tokens=2048, performance_mode="interactivity"), 16, list(range(1, 17))),
        ("C21", dict(seqs=256, tokens=100), 100, [1, 2, 4] + list(range(8, 97, 8)) + [100]),
        (
            "C23",
            dict(seqs=100, tokens=8192),
            200,
            [1, 2, 4] + list(range(8, 97, 8)) + [100] + list(range(104, 201, 8)),
        ),
        ("C24", dict(seqs=300, tokens=8192), 512, sorted(G512 + [300])),
        ("C25", dict(seqs=512, tokens=8192, capability=(10, 0)), 1024, G512 + list(range(528, 1025, 16))),
        ("C26", dict(seqs=1, tokens=8192), 2, [1, 2]),
        ("C27", dict(seqs=3, tokens=8192), 4, [1, 2, 3, 4]),
        ("C28", dict(seqs=256, tokens=5), 5, [1, 2, 4, 5]),
        ("C29", dict(seqs=256, tokens=8192, performance_mode="throughput"), 512, G512),
    ],
)
def test_default_sizes(name: str, kwargs: dict, expected_max: int, expected: list[int]) -> None:
    assert sizes(build_cuda(**kwargs)) == (expected_max, expected), name


def test_c4_interactivity() -> None:
    max_size, result = sizes(build_cuda(256, 8192, performance_mode="interactivity"))
    assert max_size == 512
    assert result == list(range(1, 33)) + list(range(40, 256, 8)) + list(range(256, 513, 16))
    assert len(result) == 76


def test_c22_budget_300() -> None:
    max_size, result = sizes(build_cuda(256, 300))
    assert max_size == 300
    assert result == [s for s in G512 if s <= 288] + [300]
    assert len(result) == 38


@pytest.mark.parametrize(
    ("name", "seqs", "k", "expected_max", "expected"),
    [
        ("C6", 256, 3, 512, G512),
        ("C7", 8, 3, 64, [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]),
        ("C8", 256, 2, 512, sorted(set(G512) | {3, 6, 12, 264, 312, 360, 408, 456, 504})),
        ("C9", 256, 4, 512, sorted(set(G512) | {5, 10, 20, 280, 360, 440})),
        ("C10", 5, 3, 40, [1, 2, 4, 8, 16, 20, 24, 32, 40]),
    ],
)
def test_speculative_sizes(name: str, seqs: int, k: int, expected_max: int, expected: list[int]) -> None:
    assert sizes(build_cuda(seqs, 8192, speculative_config=eagle(k))) == (expected_max, expected), name


def test_c8_c9_lengths() -> None:
    assert len(sizes(build_cuda(256, 8192, speculative_config=eagle(2)))[1]) == 60
    assert len(sizes(build_cuda(256, 8192, speculative_config=eagle(4)))[1]) == 57


def test_c31_dynamic_speculative_decoding() -> None:
    spec = eagle(3, num_speculative_tokens_per_batch_size={4: 3, 6: 2, 8: 1})
    assert spec.dense_draft_lengths(8)[1:] == [3, 3, 3, 3, 2, 2, 1, 1]
    cfg = build_cuda(8, 8192, speculative_config=spec)
    assert sizes(cfg) == (64, [1, 2, 3, 4, 6, 8, 12, 16, 18, 24, 32, 40, 48, 56, 64])


def test_c11_user_sizes_filtered(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="pagedllm.config"):
        cfg = build_cuda(256, 8192, compilation={"cudagraph_capture_sizes": [1, 2, 4, 9000]})
    assert sizes(cfg) == (4, [1, 2, 4])
    assert "overridden" in caplog.text


def test_c12_inconsistent_user_max_raises() -> None:
    with pytest.raises(ValueError, match=r"max_cudagraph_capture_size \(9000\).*\(4\)"):
        build_cuda(
            256,
            8192,
            compilation={"cudagraph_capture_sizes": [1, 2, 4, 9000], "max_cudagraph_capture_size": 9000},
        )


def test_c13_consistent_user_max(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="pagedllm.config"):
        cfg = build_cuda(
            256,
            8192,
            compilation={"cudagraph_capture_sizes": [1, 2, 4, 9000], "max_cudagraph_capture_size": 4},
        )
    assert sizes(cfg) == (4, [1, 2, 4])
    assert "overridden" in caplog.text


def test_c14_duplicates_warn(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="pagedllm.config"):
        cfg = build_cuda(256, 8192, compilation={"cudagraph_capture_sizes": [4, 1, 2, 2]})
    assert sizes(cfg) == (4, [1, 2, 4])
    assert "overridden" in caplog.text


def test_c15_user_sizes_not_capped_by_ceiling(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="pagedllm.config"):
        cfg = build_cuda(256, 8192, compilation={"cudagraph_capture_sizes": [1, 600]})
    assert sizes(cfg) == (600, [1, 600])
    assert "overridden" not in caplog.text


def test_c16_user_sizes_filtered_by_budget() -> None:
    cfg = build_cuda(256, 2048, compilation={"cudagraph_capture_sizes": [2048, 4096, 1]})
    assert sizes(cfg) == (2048, [1, 2048])


@pytest.mark.parametrize(
    ("name", "tokens", "user_max", "expected_max", "expected"),
    [
        ("C17", 8192, 100, 96, [1, 2, 4] + list(range(8, 97, 8))),
        ("C18", 8192, 600, 592, G512 + [528, 544, 560, 576, 592]),
        ("C19", 512, 600, 512, G512),
    ],
)
def test_user_max_truncated(
    caplog: pytest.LogCaptureFixture,
    name: str,
    tokens: int,
    user_max: int,
    expected_max: int,
    expected: list[int],
) -> None:
    with caplog.at_level(logging.WARNING, logger="pagedllm.config"):
        cfg = build_cuda(256, tokens, compilation={"max_cudagraph_capture_size": user_max})
    assert sizes(cfg) == (expected_max, expected), name
    assert f"Truncating max_cudagraph_capture_size to {expected_max}" in caplog.text


def test_c17_has_15_entries() -> None:
    assert len(sizes(build_cuda(256, 8192, compilation={"max_cudagraph_capture_size": 100}))[1]) == 15


def test_c20_interactivity_user_max(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="pagedllm.config"):
        cfg = build_cuda(
            256, 8192, performance_mode="interactivity", compilation={"max_cudagraph_capture_size": 20}
        )
    assert sizes(cfg) == (20, list(range(1, 21)))
    assert "Truncating" not in caplog.text


def test_c30_enforce_eager_disables_graphs() -> None:
    cfg = build_cuda(256, 8192, eager=True)
    assert sizes(cfg) == (0, [])
    assert cfg.compilation_config.cudagraph_mode == CUDAGraphMode.NONE


def test_cpu_has_no_graphs(caplog: pytest.LogCaptureFixture) -> None:
    from pagedllm.config import CompilationConfig, EngineConfig, ModelConfig
    from pagedllm.platforms import override_platform

    with override_platform("cpu"):
        cfg = EngineConfig(model_config=ModelConfig())
    assert cfg.compilation_config.cudagraph_mode == CUDAGraphMode.NONE
    # pagedllm's decision on spec 7.10: graphs off means no capture sizes on every platform.
    assert sizes(cfg) == (0, [])
    assert cfg.compilation_config.padded_graph_size(1) is None
    with caplog.at_level(logging.WARNING, logger="pagedllm.config"), override_platform("cpu"):
        given = EngineConfig(
            model_config=ModelConfig(),
            compilation_config=CompilationConfig(
                cudagraph_capture_sizes=[1, 2], max_cudagraph_capture_size=2
            ),
        )
    assert sizes(given) == (0, [])
    assert "cpu has no CUDA graphs: ignoring cudagraph_capture_sizes=[1, 2]" in caplog.text


def test_padded_graph_size_table() -> None:
    cc = build_cuda(8, 2048).compilation_config
    assert [cc.padded_graph_size(n) for n in (1, 3, 5, 9, 16)] == [1, 4, 8, 16, 16]
    assert cc.padded_graph_size(17) is None


@settings(max_examples=40, deadline=None)
@given(
    seqs=st.integers(1, 1024),
    tokens=st.integers(1, 16384),
    k=st.integers(0, 6),
    mode=st.sampled_from(["balanced", "interactivity", "throughput"]),
    blackwell=st.booleans(),
)
def test_capture_size_invariants(seqs: int, tokens: int, k: int, mode: str, blackwell: bool) -> None:
    spec = eagle(k) if k else None
    cfg = build_cuda(
        seqs,
        tokens,
        capability=(10, 0) if blackwell else (9, 0),
        performance_mode=mode,
        speculative_config=spec,
    )
    max_size, result = sizes(cfg)
    assert result == sorted(set(result))
    assert all(1 <= s <= tokens for s in result)
    assert max_size == result[-1]


@settings(max_examples=25, deadline=None)
@given(
    seqs=st.integers(1, 1024),
    tokens=st.integers(1, 16384),
    user_max=st.integers(1, 2048),
    mode=st.sampled_from(["balanced", "interactivity"]),
)
def test_capture_size_invariants_with_user_max(seqs: int, tokens: int, user_max: int, mode: str) -> None:
    cfg = build_cuda(
        seqs, tokens, performance_mode=mode, compilation={"max_cudagraph_capture_size": user_max}
    )
    max_size, result = sizes(cfg)
    assert result == sorted(set(result)) and result
    assert all(1 <= s <= min(tokens, user_max) for s in result)
    assert max_size == result[-1]
    assert cfg.compilation_config.padded_graph_size(max_size) == max_size
    assert cfg.compilation_config.padded_graph_size(max_size + 1) is None


@settings(max_examples=15, deadline=None)
@given(seqs=st.integers(1, 1024), tokens=st.integers(1, 16384), level=st.sampled_from([0, 1, 2, 3]))
def test_capture_sizes_empty_when_graphs_off(seqs: int, tokens: int, level: int) -> None:
    eager_cfg = build_cuda(seqs, tokens, eager=True, optimization_level=level)
    assert sizes(eager_cfg) == (0, [])
    if level == 0:
        assert sizes(build_cuda(seqs, tokens, optimization_level=0)) == (0, [])
