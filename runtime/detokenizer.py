"""Stream a request's output tokens as text: UTF-8-safe deltas, byte-level BPE merges, stop strings.

The window method of vLLM / Hugging Face TGI: decode ``ids[prefix:]`` and ``ids[prefix:read]`` and emit the
difference, so a token whose bytes only make sense after its neighbours (a byte-level BPE piece of an emoji, a
SentencePiece space) is decoded in context. Each step decodes a few tokens, never the whole output.
"""

from __future__ import annotations

from collections.abc import Sequence

from omforge.runtime.sampling_params import SamplingParams
from omforge.runtime.tokenizer import TextTokenizer

# Prompt tokens decoded before the first output token, as context for it (vLLM's initial offset).
PROMPT_CONTEXT = 5
REPLACEMENT = "\ufffd"  # what a decoder makes of an incomplete UTF-8 sequence


class IncrementalDetokenizer:
    """Turns a request's output token ids into text deltas as they arrive.

    Never emits half a UTF-8 character: while the decoded window ends in U+FFFD, its text is held back.
    Stop strings are never split across chunks: the longest suffix of the pending text that is a prefix of a
    stop string is held back until it either completes the stop string (output ends before it; vLLM's default,
    the stop string is not included) or cannot any more (released). Invariants: ``text`` is everything
    streamed so far; once ``stopped`` is set nothing more is emitted. Do not append the EOS or stop token id
    that finished the request (vLLM does not detokenize it either); call :meth:`flush` when the request ends.
    """

    def __init__(self, tokenizer: TextTokenizer, prompt_ids: Sequence[int], params: SamplingParams):
        self.tokenizer = tokenizer
        self.skip_special_tokens = params.skip_special_tokens
        self.stop_strings = list(params.stop)
        self._ids = list(prompt_ids[-PROMPT_CONTEXT:])
        self._prefix = 0  # window start in _ids
        self._read = len(self._ids)  # _ids[:_read] is already decoded into text
        self._pending = ""  # decoded, not yet streamed: it may still become a stop string
        self.text = ""
        self.stopped: str | None = None

    def append(self, token_id: int) -> str:
        """The new text to stream after ``token_id`` (possibly "")."""
        if self.stopped is not None:
            return ""
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix:self._read])
        new_text = self._decode(self._ids[self._prefix:])
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT):
            return ""  # a special token skipped, or a character still incomplete: wait for the next token
        self._prefix, self._read = self._read, len(self._ids)
        self._pending += new_text[len(prefix_text):]
        return self._release(final=False)

    def context(self, token_id: int) -> None:
        """Take ``token_id`` as context of the next token, never as text (a reasoning marker). Call it with
        nothing held back (after :meth:`flush`, or on a detokenizer that has had no tokens)."""
        self._ids.append(token_id)
        self._read = len(self._ids)

    def flush(self) -> str:
        """At finish: release everything held back (a stop string can no longer complete)."""
        if self.stopped is not None:
            return ""
        prefix_text = self._decode(self._ids[self._prefix:self._read])
        self._pending += self._decode(self._ids[self._prefix:])[len(prefix_text):]
        self._prefix = self._read = len(self._ids)
        return self._release(final=True)

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _release(self, final: bool) -> str:
        """Stream the pending text up to the first stop string, or up to what could still start one."""
        pending = self._pending
        found = [(pending.find(s), i) for i, s in enumerate(self.stop_strings) if s in pending]
        if found:
            at, i = min(found)
            self.stopped = self.stop_strings[i]
            out, self._pending = pending[:at], ""
        else:
            keep = 0 if final else self._stop_prefix_length(pending)
            out, self._pending = pending[:len(pending) - keep], pending[len(pending) - keep:]
        self.text += out
        return out

    def _stop_prefix_length(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of some stop string."""
        longest = 0
        for stop in self.stop_strings:
            for n in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:n]):
                    longest = n
                    break
        return longest
