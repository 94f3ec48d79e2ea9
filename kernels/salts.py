"""Philox salts: one independent noise stream per random decision of a speculative step.

Every random number fspec draws is a pure function of `(seed, position, token id, salt)` (see
`fspec.kernels.philox` for the counter layout). Two decisions that share a salt at the same position share
their noise, and that correlation biases the output: vLLM at PR #41162 reused the draft's Gumbel noise for the
residual resample, which turned the target (.1, .45, .45) into (.100, .394, .506) over 2M trials (vLLM issue
#47386, fixed by salting in #54282). So each decision below has its own salt; a salt must be in
[0, MAX_SALT).
"""

SALT_DRAFT = 0  # Gumbel noise of draft sampling (`gumbel_sample`'s default salt)
SALT_ACCEPT = 1  # acceptance uniform u_k of draft k in rejection sampling (token id 0 of the stream)
SALT_RESIDUAL = 2  # Gumbel noise of the replacement sample from norm(max(p - q, 0)) after a rejection
SALT_BONUS = 3  # Gumbel noise of the bonus token sampled from p when all K drafts are accepted

MAX_SALT = 1 << 10  # the salt field of the Philox counter is 10 bits wide (kernels/philox.py)
