"""Orchestration: config boundary, cold start, the Tree-GRPO loop, evaluation, checkpoints, logs.

The entry point is `train_and_evaluate(from_config_dict(config), workdir)` (launch/train.py).
Submodules are imported on use: this package pulls in every other one.
"""
