"""Chat rendering: messages (+ tools) -> prompt token ids, and generated text -> the assistant message.

Serving, the teacher and the judge all render through here, so a stored turn re-renders to the exact ids it was
served with. Modules:

* ``safe_tokenizer`` — chat-template rendering where only the template can write special tokens;
* ``chat``           — ``ChatRenderer``: tools shown natively or written into the system message, the history as
  text such a model reads; ``chat_render_fn`` for the judge and the teacher;
* ``tool_calls``     — ``<tool_call>`` blocks in generated text -> OpenAI tool calls, whole or streamed.
"""

from clawloop.renderers.chat import ChatRenderer, RenderedPrompt, chat_render_fn, template_default_system
from clawloop.renderers.safe_tokenizer import SafeChatTokenizer, TemplateRefusedError
from clawloop.renderers.tool_calls import ParsedAnswer, ToolCallStreamFilter, assistant_message, parse_answer

__all__ = ["ChatRenderer", "ParsedAnswer", "RenderedPrompt", "SafeChatTokenizer", "TemplateRefusedError",
           "ToolCallStreamFilter", "assistant_message", "chat_render_fn", "parse_answer",
           "template_default_system"]
