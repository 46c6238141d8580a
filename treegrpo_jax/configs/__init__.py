"""The bundled configs (`--config=<name>.py:<variants>`): `multihop` (the paper's run and its
`:tiny`, `:smollm2`, ... variants), `singlehop`, `resilience`. They ship in the package so an
installed wheel can train; the repository's top-level `configs/` re-exports them (the design
card's layout), and the launch scripts find a bundled config by its file name when no such file
exists where the command runs (`treegrpo-train --config=multihop.py:tiny`)."""
