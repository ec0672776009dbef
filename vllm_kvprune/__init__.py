"""vllm-kvprune: KV-cache pruning and compression policies for stock vLLM, as a plugin.

`register` is the `vllm.general_plugins` entry point; vLLM calls it in each of its
processes. Importing this package does not import vLLM.
"""

from vllm_kvprune.version import __version__


def register() -> None:
    """Install the plugin into vLLM (idempotent; see `vllm_kvprune.plugin`)."""
    from vllm_kvprune.plugin import register as _register

    _register()


__all__ = ["__version__", "register"]
