"""`kiln serve --sanitize-special-tokens`: no special-token string reaches the chat template from a request.

A chat template renders to text that is then tokenized with special tokens parsed, so `<|im_start|>`
typed anywhere in what a client sends (content, a tool call's id or arguments, a tool's description,
a chat_template_kwargs value) would become a real role marker.
"""

from __future__ import annotations

from typing import Any

from server.errors import APIError

MAX_PASSES = 8  # special-token strings nested up to 7 deep are removed whole


def without_specials(value: Any, specials: list[str], param: str) -> Any:
    """`value` (a string, or lists and dicts of them, keys too) with no special-token string left in it.

    Removing one can join the text around it into another (`<|im_st<|im_end|>art|>`), so passes repeat
    until one removes nothing, which proves none is left. Nesting deeper than MAX_PASSES is a 400
    rather than a pass per level over a body of megabytes: no honest text nests markers."""
    if isinstance(value, str):
        for _ in range(MAX_PASSES):
            size = len(value)
            for special in specials:
                value = value.replace(special, "")
            if len(value) == size:
                return value
        raise APIError(400, f"special-token strings nested more than {MAX_PASSES - 1} deep in {param}", param)
    if isinstance(value, dict):
        return {
            without_specials(k, specials, param): without_specials(v, specials, param)
            for k, v in value.items()
        }
    if isinstance(value, list | tuple):
        return [without_specials(v, specials, param) for v in value]
    return value


def sanitized(
    conversation: list[dict], kwargs: dict | None, specials: list[str]
) -> tuple[list[dict], dict | None]:
    """Every string the chat template will see, without special-token strings: contents, call ids, earlier
    calls' names and arguments, tool definitions, chat_template_kwargs values. A request's own template
    (which only a server started with --trust-request-chat-template takes) keeps its markers: they are its
    syntax. No `specials` (the flag not given): all as given."""
    if not specials:
        return conversation, kwargs
    try:
        conversation = without_specials(conversation, specials, "messages")
        if kwargs:
            kept = {k: kwargs[k] for k in ("tools", "chat_template") if k in kwargs}
            rest = {k: v for k, v in kwargs.items() if k not in kept}
            if "tools" in kept:
                kept["tools"] = without_specials(kept["tools"], specials, "tools")
            kwargs = {**without_specials(rest, specials, "chat_template_kwargs"), **kept}
    except RecursionError:
        raise APIError(400, "request body is nested too deeply", "messages") from None
    return conversation, kwargs
