"""Chat templates as transformers finds and renders them, without transformers: the Jinja source
and the special token strings of a Hugging Face tokenizer directory, rendered with jinja2 in
transformers' sandbox with its options and helpers (transformers/utils/chat_template_utils.py:
_compile_jinja_template, render_jinja_template). meshtrain.data.chat.encoder encodes chats with it.

Where the template comes from, first found wins (transformers' order for a local directory):
data.chat_template (a .jinja file); chat_template.jinja beside the tokenizer, and the named
templates of chat_templates/*.jinja; tokenizer_config.json's `chat_template`, a string or a list of
{name, template}. Of several named templates, "default" is used.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
import jinja2.utils

from meshtrain.errors import DataError


@dataclass(frozen=True)
class ChatTemplate:
    text: str  # the Jinja source
    origin: str  # the file it was read from
    special_tokens: dict[str, str]  # bos_token, eos_token, ...: what the template is given

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = False,
        continue_final_message: bool = False,
        **kwargs: Any,
    ) -> str:
        """The text of `messages` as transformers' apply_chat_template(tokenize=False) renders
        it; `kwargs` (date_string, enable_thinking...) override the special tokens. With
        `continue_final_message` the text ends where the last message's content does (no end
        of turn after it), as transformers cuts it: at a tag appended to that content. A
        template that raises (raise_exception, a Jinja or Python error) is a one-line
        DataError."""
        if continue_final_message:
            if not messages or not isinstance(messages[-1].get("content"), str):
                raise DataError("continue_final_message needs a last message with text content")
            last = {**messages[-1], "content": messages[-1]["content"] + _CONTINUE_TAG}
            messages = [*messages[:-1], last]
        try:
            text = _compile(self.text).render(
                messages=messages,
                tools=None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **{**self.special_tokens, **kwargs},
            )
        except Exception as e:
            raise DataError(
                f"the chat template {self.origin} cannot render this conversation: {one_line(e)}"
            ) from None
        if not continue_final_message:
            return text
        at = text.rfind(_CONTINUE_TAG.strip())
        if at < 0:
            raise DataError(
                f"the chat template {self.origin} drops part of the last message, which "
                "continue_final_message continues"
            )
        return text[:at] if text[at:].startswith(_CONTINUE_TAG) else text[:at].rstrip()


_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "  # transformers' marker of the message continued


def load_chat_template(tokenizer: str, override: str | None = None) -> ChatTemplate:
    """The chat template of `data.tokenizer` (a tokenizer.json, or the directory holding it), or
    the .jinja file `override` (data.chat_template), with the tokenizer's special tokens."""
    if tokenizer == "byte":
        raise DataError(
            "data.tokenizer=byte has no chat template; chat data needs a Hugging Face tokenizer"
        )
    path = Path(tokenizer).expanduser()
    directory = path if path.is_dir() else path.parent
    special = _special_tokens(directory)
    if override is not None:
        file = Path(override).expanduser()
        if not file.is_file():
            raise DataError(f"data.chat_template={override!r} is not a file")
        return _checked(ChatTemplate(file.read_text(encoding="utf-8"), str(file), special))
    templates: dict[str, tuple[str, str]] = {}  # name: (source, file)
    files = [directory / "chat_template.jinja", *(directory / "chat_templates").glob("*.jinja")]
    for file in (f for f in files if f.is_file()):
        name = "default" if file.name == "chat_template.jinja" else file.stem
        templates[name] = (file.read_text(encoding="utf-8"), str(file))
    if not templates:  # template files replace the config's template(s)
        config_file = str(directory / "tokenizer_config.json")
        configured = _config(directory).get("chat_template")
        if isinstance(configured, str):
            templates = {"default": (configured, config_file)}
        elif isinstance(configured, list):
            templates = {t["name"]: (t["template"], config_file) for t in configured}
    if "default" not in templates:
        found = "no chat template"
        if templates:
            found = f"chat templates named {', '.join(sorted(templates))} but none named default"
        raise DataError(
            f"data.tokenizer={tokenizer!r} has {found}; set data.chat_template=PATH to a .jinja file"
        )
    return _checked(ChatTemplate(*templates["default"], special))


def _config(directory: Path) -> dict[str, Any]:
    file = directory / "tokenizer_config.json"
    return json.loads(file.read_text(encoding="utf-8")) if file.is_file() else {}


def _special_tokens(directory: Path) -> dict[str, str]:
    """The special token strings transformers gives a template (special_tokens_map): the *_token
    entries of tokenizer_config.json and of its extra_special_tokens dict, and of the legacy
    special_tokens_map.json where the config has no added_tokens_decoder."""
    config = _config(directory)
    legacy = directory / "special_tokens_map.json"
    if "added_tokens_decoder" not in config and legacy.is_file():
        config = {**config, **json.loads(legacy.read_text(encoding="utf-8"))}
    extra = config.get("extra_special_tokens")
    tokens = {}
    for key, value in {**config, **(extra if isinstance(extra, dict) else {})}.items():
        content = value.get("content") if isinstance(value, dict) else value
        if key.endswith("_token") and isinstance(content, str):
            tokens[key] = content
    return tokens


def _checked(template: ChatTemplate) -> ChatTemplate:
    try:
        _compile(template.text)
    except jinja2.TemplateSyntaxError as e:
        raise DataError(
            f"the chat template {template.origin} is not valid Jinja: {one_line(e)} (line {e.lineno})"
        ) from None
    return template


def one_line(error: BaseException) -> str:
    """An exception's message on one line."""
    return " ".join(str(error).split()) or type(error).__name__


class _Generation(jinja2.ext.Extension):
    """transformers' {% generation %}...{% endgeneration %} (its AssistantTracker): the body as
    it is (meshtrain.data.chat.encoder finds the assistant's tokens itself)."""

    tags = {"generation"}  # noqa: RUF012 (jinja's class attribute)

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    """transformers' tojson: json.dumps and its options, without jinja's HTML escaping."""
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _TemplateDict:
    """`dict(...)` for templates, without dict's other attributes."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """jinja's namespace() refusing underscore names (transformers' TemplateNamespace)."""

    def __init__(*args, **kwargs):  # jinja's signature: namespace(self=...) works
        self, attrs = args[0], dict(*args[1:], **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot store underscore-prefixed attributes on a namespace, but got {name!r}"
            )


@functools.lru_cache(maxsize=16)
def _compile(text: str) -> jinja2.Template:
    """transformers' _compile_jinja_template: the same sandbox, options, extensions, filter and
    globals."""
    environment = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    environment.globals["dict"] = _TemplateDict()
    environment.globals["namespace"] = _Namespace
    return environment.from_string(text)
