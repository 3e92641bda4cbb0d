"""How much work one embedding request may bring, derived from what this worker can do in its time.

TorchServe restarts a worker whose batch takes longer than `responseTimeout`, failing every request
of that batch. So the worker measures, once at start on its own device, how fast it tokenizes
(characters per second) and embeds (tokens per second), and admits per request at most a
`batch_size`-th of what fits in SAFETY x responseTimeout: a full batch of requests at the limit
then ends within that fraction of the timeout, with room for the device to be that many times
slower than when measured (other workers, other processes). A request beyond the limit gets its
413 naming it at once, before its work starts.
"""
from __future__ import annotations

from dataclasses import dataclass

from servekit.handlers.common import RequestError

# The fraction of responseTimeout a full batch at the limits is planned to take: the device may run
# at a quarter of the speed measured at start before such a batch is at risk. Half was not enough:
# a CPU worker that measured itself on an idle 2-core machine and then served beside a busy
# neighbour ran a full batch at its limits past a 60 s timeout.
SAFETY = 0.25
# TorchServe's own default when neither the model-config nor the registration sets one.
DEFAULT_RESPONSE_TIMEOUT_S = 120


@dataclass(frozen=True)
class WorkBudget:
    tokens_per_request: int
    chars_per_request: int
    tokens_per_second: float
    chars_per_second: float
    response_timeout_s: float
    batch_size: int

    def check_chars(self, field: str, n_chars: int) -> None:
        """Before tokenizing: the request's texts together, in characters."""
        if n_chars > self.chars_per_request:
            raise RequestError(413, "invalid_request_error",
                               f"'{field}' has {n_chars} characters in all; this worker admits at most "
                               f"{self.chars_per_request} per request (what it tokenizes in its time)",
                               "request_too_large")

    def tokens_error(self, n_tokens: int) -> RequestError:
        """The 413 of a request of `n_tokens` model tokens in all, over `tokens_per_request`."""
        return RequestError(413, "invalid_request_error",
                            f"the request has {n_tokens} tokens in all; this worker admits at most "
                            f"{self.tokens_per_request} tokens per request (what it embeds in its time); "
                            "split it into smaller requests", "request_too_large")

    def report(self) -> dict[str, float]:
        return {"tokens_per_request": self.tokens_per_request, "chars_per_request": self.chars_per_request,
                "measured_tokens_per_second": round(self.tokens_per_second),
                "measured_chars_per_second": round(self.chars_per_second),
                "response_timeout_s": self.response_timeout_s, "batch_size": self.batch_size}


def derive_budget(tokens_per_second: float, chars_per_second: float, response_timeout_s: float,
                  batch_size: int, min_tokens: int, min_chars: int) -> WorkBudget:
    """Per-request limits from measured speeds. `min_tokens`/`min_chars`: floors that keep one
    full-length text always admitted (one model input, one text at the per-text character limit)."""
    share = SAFETY * response_timeout_s / max(1, batch_size)
    return WorkBudget(tokens_per_request=max(min_tokens, int(tokens_per_second * share)),
                      chars_per_request=max(min_chars, int(chars_per_second * share)),
                      tokens_per_second=tokens_per_second, chars_per_second=chars_per_second,
                      response_timeout_s=response_timeout_s, batch_size=batch_size)
