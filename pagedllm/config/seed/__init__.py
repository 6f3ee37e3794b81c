"""The upstream mirror: construction steps and validators of features pagedllm does not run.

The configuration follows the upstream spec, whose procedure also checks Mamba state caches, MLA,
HiSparse, engram layers, dual batch overlap, expert parallelism, multimodal encoders, diffusion and
more. Those checks are the specified behaviour, so they run (`pagedllm.config.construction` calls them
at their paragraphs), but the support gate (`pagedllm.config.support`) rejects every such feature
afterwards. Rule: nothing outside `pagedllm.config` imports this package (an import-linter contract in
pyproject.toml holds it), so no running code depends on a mirrored rule.
"""
