"""What the replies teach the ``ttft`` policy: every figure a mean over recent requests, never a setting.

Each served request's reply says how many prompt tokens it had and how many of them the
replica found cached (``usage.prompt_tokens_details``), how many it generated, and, for
a stream, when its first token came and when it ended. From those ``Learned`` keeps:

* ``work``: a request's uncached prompt, what another client's waiting request is taken
  to weigh;
* ``error`` and ``scale``: how far the predicted times to first token missed, and the
  observed over the predicted (a request prefilled in a batch is charged the batch's time,
  so the rate the replicas report is below the rate a queue drains at);
* ``hold``: a request's time from its first token to its end (``ttft_inputs.seat_wait``);
* ``output``: the tokens a request generates, whose blocks a running request pins beside
  its prompt's, where no prompt recorded in the pool model accounts for them;
* ``chars_per_token``: rendered characters per prompt token, which converts the pool's
  size in tokens into the blocks of characters the pool model counts. A fixed 4 is wrong
  by the tokenizer and the language: the benchmarks' text runs 5.5 characters a token,
  and at 4 the model held 0.72 of the pool (docs/benchmarks/routing-ttft.md, tenth stop);
* the belief's agreement: how far the share of the prompt believed held at the chosen
  replica was from the cached tokens it reported (``stats``'s ``belief``).
"""

from __future__ import annotations

from .backlog import CHARS_PER_TOKEN
from .base import RouteFeedback
from .ttft_inputs import Mean

__all__ = ["Learned", "Prediction"]

# What a decision predicted of the replica it chose: its name, the time to first token (None
# before any rate), the share of the prompt believed held there, and the rate's scale then.
Prediction = tuple[str, float | None, float, float]


class Learned:
    __slots__ = ("work", "error", "hold", "output", "_observed", "_predicted", "_chars", "_tokens",
                 "_gap", "_gap_prompt", "_gap_n")

    def __init__(self) -> None:
        self.work = Mean()
        self.error = Mean()
        self.hold = Mean()
        self.output = Mean()
        self._observed = Mean()
        self._predicted = Mean()
        self._chars = Mean()
        self._tokens = Mean()
        self._gap = self._gap_prompt = 0.0
        self._gap_n = 0

    def reply(self, feedback: RouteFeedback, predicted: Prediction | None, chars: int,
              held_s: float | None) -> None:
        """A served request's reply: ``chars`` its rendered prompt's length where routing had no
        token ids for it (0 otherwise), ``held_s`` its seat's hold where it was streamed."""
        if held_s is not None:
            self.hold.add(held_s)
        if feedback.completion_tokens:
            self.output.add(float(feedback.completion_tokens))
        prompt = feedback.prompt_tokens
        if not prompt:
            return
        self.learn_chars(chars, prompt)
        cached = feedback.cached_tokens
        if cached is not None:
            self.work.add(float(max(0, prompt - cached)))
        if predicted is None or predicted[0] != feedback.replica:
            return
        if cached is not None:  # the believed share of the prompt, in the replica's tokens
            self._gap += abs(predicted[2] * prompt - cached)
            self._gap_prompt += prompt
            self._gap_n += 1
        if predicted[1] is not None and feedback.ttft_s is not None:
            self.error.add(abs(predicted[1] - feedback.ttft_s))
            self._observed.add(feedback.ttft_s)
            self._predicted.add(predicted[1] / predicted[3])

    def learn_chars(self, chars: int, tokens: int) -> None:
        if chars > 0 and tokens > 0:
            self._chars.add(float(chars))
            self._tokens.add(float(tokens))

    def chars_per_token(self) -> float:
        """Rendered characters per prompt token, as learned (``CHARS_PER_TOKEN`` before any)."""
        tokens = self._tokens.total
        return self._chars.total / tokens if tokens > 0 else CHARS_PER_TOKEN

    def scale(self) -> float:
        """Observed over predicted time to first token at the reported rates (1 before any)."""
        predicted = self._predicted.total
        return self._observed.total / predicted if predicted > 0 and self._observed.total > 0 else 1.0

    def stats(self) -> dict[str, object]:
        """``learned`` and ``belief`` for ``GET /admin/routing``."""
        def mean(m: Mean) -> float | None:
            return m.get(0.0) if len(m) else None

        return {"learned": {"uncached_tokens_per_request": mean(self.work), "rate_scale": 1.0 / self.scale(),
                            "prediction_error_s": mean(self.error), "seat_hold_s": mean(self.hold),
                            "chars_per_token": self.chars_per_token() if len(self._tokens) else None,
                            "output_tokens_per_request": mean(self.output)},
                # How far the belief (held tokens at the chosen replica) was from what it reported
                # reusing, as a share of the prompt tokens: 0 is exact.
                "belief": {"requests": self._gap_n,
                           "gap_share": self._gap / self._gap_prompt if self._gap_prompt else None}}
