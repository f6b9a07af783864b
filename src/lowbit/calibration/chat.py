"""Conversations rendered to text with a chat template, as a chat model sees its prompts.

``chat_template`` (``CalibrationConfig.chat_template``, CLI ``--chat-template``):
- ``"auto"`` (the default): the tokenizer's own template (``tokenizer.chat_template``); a
  conversation with a tokenizer that has none is an error;
- ``"none"``: no template: a conversation becomes its messages' contents, one per line (no role
  tokens, no system prompt);
- a path to a file holding a Jinja chat template (the ``chat_template.jinja`` format).
Texts are never templated. A rendered conversation that starts with the tokenizer's BOS text
loses it: windows are started the way the tokenizer starts a text (``lowbit.textstart``), so
the BOS is not doubled. A template that raises on a conversation (roles that do not alternate,
a role it does not know) or that drops a non-empty message is an error naming the sample.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from lowbit.calibration.records import CalibrationError, Conversation, Sample

AUTO = "auto"
NONE = "none"
DEFAULT_CHAT_TEMPLATE = AUTO


class TemplateMode(str, Enum):
    AUTO = AUTO    # the tokenizer's own
    NONE = NONE    # contents only
    FILE = "file"  # a Jinja file

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class TemplateChoice:
    mode: TemplateMode
    path: Path | None = None

    @classmethod
    def parse(cls, value) -> "TemplateChoice":
        """``"auto"``, ``"none"`` or a template file's path (it must exist)."""
        if isinstance(value, TemplateChoice):
            return value
        if isinstance(value, str) and value in (AUTO, NONE):
            return cls(TemplateMode(value))
        if isinstance(value, (str, Path)):
            p = Path(value)
            if not p.is_file():
                raise CalibrationError(f"chat template file {str(p)!r} not found (chat_template is 'auto', 'none' "
                                       f"or a Jinja file)")
            return cls(TemplateMode.FILE, p)
        raise CalibrationError(f"chat_template must be 'auto', 'none' or a file path, got {value!r}")


@dataclass(frozen=True)
class Renderer:
    """Turns samples into text: texts as they are, conversations through ``template``."""

    choice: TemplateChoice
    template: str | None  # the Jinja source (None: no template)
    tokenizer: object

    @classmethod
    def of(cls, value, tokenizer) -> "Renderer":
        choice = TemplateChoice.parse(value)
        if choice.mode is TemplateMode.FILE:
            try:
                return cls(choice, choice.path.read_text(encoding="utf-8"), tokenizer)
            except UnicodeDecodeError as e:
                raise CalibrationError(f"chat template file {str(choice.path)!r} is not UTF-8 text: {e}") from None
        if choice.mode is TemplateMode.AUTO:
            return cls(choice, getattr(tokenizer, "chat_template", None) or None, tokenizer)
        return cls(choice, None, tokenizer)

    def describe(self, used: bool) -> str:
        """What the report says: the template used for conversations, or that none was needed."""
        if not used:
            return "none (no conversations)"
        if self.choice.mode is TemplateMode.NONE:
            return "none (message contents only)"
        if self.choice.mode is TemplateMode.FILE:
            return str(self.choice.path)
        return "the model's own"

    def render(self, sample: Sample) -> str:
        if isinstance(sample, str):
            return sample
        if self.choice.mode is TemplateMode.NONE:
            return "\n".join(m.content for m in sample.messages)
        if self.template is None:
            raise CalibrationError(f"{sample.where}: a conversation needs a chat template and the tokenizer has none: "
                                   f"pass a Jinja file with --chat-template FILE / chat_template=, or "
                                   f"--chat-template none for the contents only")
        return render_conversation(sample, self.tokenizer, self.template)


def render_conversation(conv: Conversation, tokenizer, template: str) -> str:
    """``conv`` through the Jinja ``template`` (the tokenizer's ``apply_chat_template``), without a
    generation prompt; a leading BOS text is dropped (see the module docstring)."""
    if not hasattr(tokenizer, "apply_chat_template"):
        raise CalibrationError(f"{conv.where}: rendering a conversation needs a Hugging Face tokenizer "
                               f"(apply_chat_template)")
    try:
        text = tokenizer.apply_chat_template(conv.as_dicts(), chat_template=template, tokenize=False,
                                             add_generation_prompt=False)
    except Exception as e:  # noqa: BLE001 - a template's raise_exception, or a Jinja error
        msg = " ".join(str(e).split()) or type(e).__name__
        raise CalibrationError(f"{conv.where}: the chat template refused the conversation "
                               f"(roles {', '.join(m.role for m in conv.messages)}): {msg}") from None
    if not isinstance(text, str):
        raise CalibrationError(f"{conv.where}: the chat template gave no text")
    pos = 0
    for i, m in enumerate(conv.messages):  # each non-empty message's content, in order
        if not m.content.strip():
            continue
        at = text.find(m.content, pos)
        if at < 0:
            raise CalibrationError(f"{conv.where}: the chat template left out message {i} (role {m.role!r}): "
                                   f"it renders no such role; give the roles it knows or another template")
        pos = at + len(m.content)
    bos = getattr(tokenizer, "bos_token", None)
    if isinstance(bos, str) and bos and text.startswith(bos):
        text = text[len(bos):]
    return text
