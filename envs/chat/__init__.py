"""Tokenizers and chat templates: the one place in Arbor that renders messages to token ids and
parses tool calls back (the scaffold, the policy server and SFT data all use it).

    tok = load_tokenizer("path/to/tokenizer_dir")       # tokenizer.json | tiktoken | sentencepiece
    chat = load_chat("path/to/tokenizer_dir", tok)       # the checkpoint's own Jinja template
    chat = make_chat("qwen2.5", tok)                     # or: chatml | qwen2.5 | deepseek_v3 | plain
    r = chat.render(messages, tools, add_generation_prompt=False)  # r.ids, r.loss_mask (SFT)
    turn = chat.parse_assistant(output_ids, tools)       # content, reasoning, tool_calls (no raise)
    if chat.extends_history:                             # else: render the whole conversation
      next_ids = input_ids + output_ids + chat.continuation(tool_messages, output_ids)
"""

from envs.chat.formats import (FORMATS, ChatFormat, ChatML, DeepSeekV3, Plain, RenderedChat,
                               make_chat)
from envs.chat.jinja_format import JinjaChat, load_chat, read_chat_templates
from envs.chat.tokenizer import (HFTokenizer, SentencePieceTokenizer, TiktokenTokenizer,
                                 Tokenizer, load_hf_tokenizer, load_tiktoken, load_tokenizer)
from envs.chat.toolcalls import ParsedTurn, ToolCall, check_call, tool_schema, validate
