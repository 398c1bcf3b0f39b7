"""A sequence's output on its way to its client: its text as it becomes certain, when it ends,
and the events that say so.

Each token the engine takes goes through stream(): its text (text.detokenizer: partial UTF-8
held back, stop strings) and log-probabilities are held for the step's delta, which
send_held() emits once a step (a verify's several tokens reach the client as one delta, as a
plain step's one does). A sequence ends at a stop token, a stop string, a finished grammar,
max_tokens or the context; its last delta carries what the detokenizer held back, and
announce() tells the client that the choice ended and, once every choice has, the usage.
"""

from __future__ import annotations

from flashformer.serve.request import Event, Sequence, TokenLogprob

__all__ = ["announce", "last_delta", "send_held", "stream"]


def stream(sequence: Sequence, logprobs: list[TokenLogprob], context: int) -> bool:
    """Hold the text the newest token made certain for the step's delta; end the sequence at a
    stop token, a stop string, a finished grammar, max_tokens or the `context` (then the held-back
    text goes too). Whether it ended (its finish_reason set: the engine frees it)."""
    params, token = sequence.request.params, sequence.tokens[-1]
    detokenizer, matcher = sequence.detokenizer, sequence.chooser.matcher
    text, reason = "", None
    if token in params.stop_token_ids:  # never part of the text
        reason = "stop"
    else:
        text = detokenizer.add(token)
        reason = "stop" if detokenizer.stopped else None
    if reason is None and matcher is not None and matcher.finished:
        if matcher.error:  # never a "stop" whose text breaks the grammar
            sequence.finish_reason = "error"
            message = f"structured output: the grammar engine stopped: {matcher.error}"
            send_held(sequence)  # the kept tokens before this one
            sequence.request.emit(Event("error", sequence.index, message=message))
            return True
        reason = "stop"  # the grammar is complete: nothing but a stop token could follow
    if reason is None and len(sequence.tokens) - sequence.prompt_len >= params.max_tokens:
        reason = "length"
    if reason is None and len(sequence.tokens) >= context:
        reason = "length"
    sequence.held_text += text
    sequence.held_logprobs += logprobs
    if reason is None:
        return False
    sequence.finish_reason = reason
    last_delta(sequence)
    return True


def send_held(sequence: Sequence) -> None:
    """The step's held text and log-probabilities as one delta (none when nothing is held)."""
    if sequence.held_text or sequence.held_logprobs:
        sequence.request.emit(Event("delta", sequence.index, sequence.held_text, sequence.held_logprobs))
    sequence.held_text, sequence.held_logprobs = "", []


def last_delta(sequence: Sequence) -> None:
    """An ending sequence's last text (held, then what the detokenizer held back) and its count."""
    sequence.held_text += sequence.detokenizer.finish()
    send_held(sequence)
    sequence.request.completion_tokens += len(sequence.generated)


def announce(sequence: Sequence) -> None:
    """Tell the client that a choice ended; when its request is done, say so with the usage."""
    request = sequence.request
    if sequence.finish_reason != "cancelled":
        stop = sequence.detokenizer.stop_string if sequence.detokenizer is not None else None
        request.emit(Event("finish", sequence.index, finish_reason=sequence.finish_reason, stop=stop))
    if request.finished and not request.cancelled.is_set():
        prompt = len(request.prompt_ids)
        usage = {
            "prompt_tokens": prompt,
            "completion_tokens": request.completion_tokens,
            "total_tokens": prompt + request.completion_tokens,
            # the prompt tokens the prefix cache gave the first choice at its first admission
            "prompt_tokens_details": {"cached_tokens": request.sequences[0].cached_tokens or 0},
        }
        request.emit(Event("done", usage=usage))
