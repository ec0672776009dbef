"""What the tests need that the installed package does not ship: running a GPU wrapper in a CPU
engine (`gpu_on_cpu`, with torch references of FlashAttention's ops, `flash_reference`).
Imported as `support` (the tests' folder is on the path of the tests and of the scripts they run).
"""
