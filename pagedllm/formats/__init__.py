"""The file formats a model comes in, read by both the configuration and the weight loader.

`model_source.py` finds a model's files (the embedded default, a local directory or GGUF file, the
Hub); `hf_utils.py` reads transformers configs (config.json, generation_config.json, RoPE settings);
`gguf_metadata.py` reads a GGUF file's header. Below `config/` and `models/loader/`: it imports
neither, only `envs`.
"""
