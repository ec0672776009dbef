"""Tools of the repository, not of the installed package: the offline test assets and the model
zoo (`python -m tools.assets`, `python -m tools.model_zoo`), and the compile checks of the GPU
kernels on a machine without a GPU (`python -m tools.triton_targets`, `python -m
tools.cutlass_check`). Run them from the repository root; nothing in `vllm_kvprune` imports them.
"""
