"""Structured outputs: constrained decoding with a grammar engine (xgrammar or llguidance).

`params.py` is what a request asks for (light: it travels inside SamplingParams); `backends.py` turns
it into a compiled grammar and per-request matchers; `manager.py` compiles off the step loop and fills
the step's token bitmask; `bitmask.py` applies that bitmask to the logits in the model runner.
"""
