"""Text no tokenizer can encode: a lone UTF-16 surrogate that a JSON escape put in a string.

json.loads joins an escaped surrogate pair (`\\ud83d\\ude00`) into one character, and leaves a
lone half (`\\ud800`) in the string as it is: no valid Unicode, which UTF-8 cannot encode and a
tokenizer fails on. Reading a record, meshtrain.data.sources asks here where it holds one.
"""

from __future__ import annotations

import re
from typing import Any

# A JSON escape of a surrogate (U+D800-U+DFFF): only a line that holds one can hold a lone one.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def lone_surrogate(line: bytes, record: Any) -> str | None:
    """Where in `record` (the JSON object parsed from `line`) a string holds a lone surrogate,
    e.g. `messages[0].content`, or None."""
    return _found(record) if _SURROGATE_ESCAPE.search(line) else None


def _found(value: Any, at: str = "") -> str | None:
    if isinstance(value, str):
        return at if any("\ud800" <= char <= "\udfff" for char in value) else None
    if isinstance(value, dict):
        children = ((f"{at}.{key}" if at else str(key), item) for key, item in value.items())
    elif isinstance(value, list):
        children = ((f"{at}[{index}]", item) for index, item in enumerate(value))
    else:
        return None
    return next((found for path, item in children if (found := _found(item, path))), None)
