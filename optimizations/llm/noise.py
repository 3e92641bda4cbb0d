"""The constants of the sampling noise and the Gumbel-max draw, shared by ``sampling.py``'s torch ops
and the fused kernel (``kernels/triton_sample.py``), whose tokens must be the torch ops' bit for bit.
A module of their own: ``sampling.py`` imports the kernel (on CUDA), so the kernel cannot import it."""

FMIX_C1, FMIX_C2 = 0x85EBCA6B, 0xC2B2AE35  # MurmurHash3's 32-bit finalizer
POSITION_MUL = 0x9E3779B9  # a row's key: hash(seed) + position * this, mod 2**32
VOCAB_STRIDE = 0x27D4EB2F  # a token's: the row's key + token id * this, mod 2**32
GUMBEL_MAX = 20.0  # above any finite draw of the noise (at most ~16.6)
MIN_TEMPERATURE = 1e-5  # the divisor of a temperature-0 (greedy) row's logits
