"""The command-line programs, one module each, with absl flags at module level (so one per
process): `train`, `eval`, `generate`, `export_hf`, `serve_retriever`. Each `run()` is a console
script of the wheel (`treegrpo-train`, ...) and the body of `launch/<name>.py` in the repository."""
