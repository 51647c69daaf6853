"""Token-in/token-out policy server: the generation engine behind Starlette under uvicorn.

    python -m trainer.serve --ckpt DIR [--host 127.0.0.1 --port 8000 --chat_format qwen2.5]
    python -m trainer.serve --preset tiny-dense          # random weights (tests, demos)

DIR is a checkpoint written by `python -m models.hf import` (its `hf_extra/` tokenizer files
enable the OpenAI and Anthropic endpoints, and its chat template renders them, as transformers
and vLLM do, unless --chat_format names a built-in format). Endpoints:

  POST /generate              {"input_ids", "max_tokens", "temperature", "top_p", "top_k",
                               "stop_token_ids", "stop", "seed", "min_p", "min_tokens",
                               "ignore_eos", "session_id"} -> {"output_ids", "logprobs",
                               "entropies" (per output token, nats), "finish_reason",
                               "policy_version", "token_versions", ...} (the protocol of
                               envs.policy.HTTPPolicy)
  POST /v1/chat/completions   OpenAI chat completions: messages (content as text or text parts,
                              the developer role as system) and tools rendered with envs.chat,
                              tool calls parsed; tool_choice (none | auto | required | a named
                              function), parallel_tool_calls, response_format (text |
                              json_object | json_schema {name, schema, strict}), n, stop, seed,
                              logprobs and top_logprobs (entries with the token's UTF-8
                              bytes), chat_template_kwargs, min_p, min_tokens, ignore_eos,
                              stream (Server-Sent Events, stream_options.include_usage)
  POST /v1/completions        OpenAI completions: prompt as text, texts, token ids or lists of
                              them; echo, logprobs (int), n, stop, max_tokens, stream
  POST /v1/responses          OpenAI Responses: input as text or items (messages, function_call,
                              function_call_output, reasoning), instructions, function tools,
                              tool_choice, text.format (text | json_object | json_schema),
                              max_output_tokens, stream (the Responses events);
                              output items reasoning / message / function_call, status
                              "incomplete" on the token limit; nothing stored
                              (previous_response_id refused)
  POST /v1/messages           Anthropic Messages: system, text / tool_use / tool_result /
                              thinking blocks, tools, tool_choice (auto | any | tool | none;
                              disable_parallel_tool_use), max_tokens, stop_sequences,
                              thinking (a thinking template's reasoning), stream (Anthropic's
                              events); content blocks thinking / text / tool_use, stop_reason,
                              usage; Anthropic error objects
  POST /v1/messages/count_tokens  the length of the prompt a Messages request renders to
  GET  /v1/models[/{id}]      the served model
  GET  /v1/sessions/{id}      the session log; DELETE frees it
  GET  /health                status, policy version, engine counters

The three chat protocols render through one path (`trainer.serving.render`): each converts its
request to OpenAI-style messages, tools and a tool_choice mode, rendered with the chat format,
and reads its reply from the sampled ids with the same parser; the same conversation sent as
chat completions, Responses items or Anthropic blocks reaches the engine as the same ids.
Sampling fields the server does not implement (penalties, logit_bias, rendering without the
generation prompt or continuing the last message, ...) are refused with a 400 naming them unless
given their neutral value; top_k -1 is off, as in vLLM.

Constrained replies (`trainer.serving.constrain`, llguidance grammars compiled against the
server's tokenizer; the engine samples each token under the grammar's mask, see
`models.engine.constraint`): a response format (chat completions' response_format, Responses'
text.format) makes the reply's content one JSON object (json_object) or one JSON value valid
under the schema (json_schema); a forced tool choice (chat completions' and Responses'
"required" or named function, Anthropic's "any" / "tool") makes the reply tool calls in the chat
format's own syntax (Hermes/Qwen `<tool_call>` JSON, DeepSeek-V3's tool-call tokens), of the
named function where one is named, one call when parallel calls are off, with arguments valid
under the tool's parameters schema; with tool_choice "auto", tools and a response format, the
reply is either. So a forced call always parses, with finish reason tool_calls / stop_reason
tool_use, whatever the model, streamed or not; only max_tokens can cut it (finish reason
length). JSON is written compactly (", " and ": "). With "strict": true a schema keyword the
grammar does not implement is a 400 naming the field (response_format, text.format,
tool_choice); without strict it is ignored. A chat format whose call syntax cannot be expressed
(Kimi K2's) refuses a forced tool choice with a 400. Log-probs of a constrained reply (in the
reply and the session log) are those of the model's distribution renormalised over the tokens
the grammar allowed at each step, at temperature 1 and without top-k / top-p / min-p
truncation: the behaviour policy's log p(token); a teacher-forced pass gives the unmasked ones
(equal where the mask allowed every token). /v1/completions takes no response_format.

Sessions: a request to any of the generating endpoints with "session_id" (body field or
X-Session-Id header) logs every sample's exact ids (the prompt as the engine saw it, a forced
tool-call opening included; the sampled ids) with their log-probs, policy versions, sampling
parameters, the protocol it came in by, whether it was constrained and, from an engine that
records MoE routing (--return_expert_ids, EngineConfig.return_expert_ids), the expert ids of
every position (`envs.policy.encode_expert_ids`), for training on what was served
(`trainer.serving.sessions` lists a record's fields); calls from different protocols share a
session. Text is never re-tokenized: replies are decoded from those ids, and stop strings are cut
from the text only (the log keeps every sampled id).

Requests from all clients go to one engine queue and are decoded together; streamed replies
leave as the engine produces tokens (its `on_tokens` hook). The server binds to loopback by
default; any other address needs a token (--token or ARBOR_SERVE_TOKEN), which every endpoint
but /health then requires, as a bearer token or (Anthropic clients) an X-Api-Key header. Bodies,
connections and session logs are bounded; errors are OpenAI error objects ({"error": {"message",
"type", "param", "code"}}), on the /v1/messages routes Anthropic's ({"type": "error", "error":
{"type", "message"}}), and the server keeps serving. Nothing is unpickled.

Against hostile clients (the front door of `envs.untrusted.door`, shared with the sandbox
server): a request's headers must be complete --header_timeout s after its connection opened (or
after the previous response), its body within --body_timeout s (408) and max_body_bytes (413);
beyond --max_connections open connections the oldest idle one is closed, those that never
carried a valid token first, so silent or dribbling sockets cannot lock real clients out; the
TLS handshake must finish within --handshake_timeout s. A body nested deeper than
max_json_depth is refused before it is parsed. Every number a request carries is checked: token
ids inside the vocabulary, max_tokens within the context, temperature a finite number in
[0, 100], top_p in (0, 1], top_k, n, seed, logprobs integers in range; anything else is a 400
naming the field and value, before the engine sees it (`trainer.serving.validate`).

The server itself is the package `trainer.serving` (server and front door, one module per
protocol, the shared rendering path, request validation, reply text, the session log); this
module is its command line and `EnginePolicy`, and re-exports what other code imports from it.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from typing import Optional

from envs.chat import load_chat, load_tokenizer, make_chat
from envs.net import check_bind
from envs.policy import Generation
from models import hf, transformer
from models.engine import Engine, EngineConfig
from models.presets import get_preset
from trainer import config as config_lib
from trainer import harness
from trainer.serving.server import PolicyServer, ServerConfig, check_vocab
from trainer.serving.sessions import SessionLog
from trainer.serving.validate import (HTTPError, error_response, normalize_messages,
                                      sampling_params)

__all__ = ["EnginePolicy", "HTTPError", "PolicyServer", "ServerConfig", "SessionLog", "build",
           "check_vocab", "checkpoint_chat", "default_chat_format", "error_response", "main",
           "normalize_messages", "parse_args", "run", "sampling_params"]


class EnginePolicy:
  """envs.policy.Policy over an in-process engine (started in its background thread).

  Args:
    engine: the generation engine; started here.
  """

  def __init__(self, engine):
    self.engine = engine
    engine.start()

  async def generate(self, input_ids, params):
    """Samples one completion from the engine.

    Args:
      input_ids: the prompt's token ids.
      params: the envs.policy.SamplingParams.

    Returns:
      The envs.policy.Generation: output ids, log-probs, per-token entropies, finish reason,
      policy versions, (an engine with return_expert_ids) the experts of every position and
      (with EngineConfig.top_logprobs) each token's most likely alternatives.
    """
    out = await asyncio.wrap_future(self.engine.submit(list(input_ids), params))
    return Generation(output_ids=out.output_ids, logprobs=out.logprobs,
                      finish_reason=out.finish_reason, policy_version=out.policy_version,
                      token_versions=out.token_versions, expert_ids=out.expert_ids,
                      entropies=out.entropies, top_logprobs=out.top_logprobs)


# ----------------------------------------------------------------------------- CLI


def default_chat_format(model_cfg) -> str:
  """The chat format of a model family: "deepseek_v3" for MLA models, else "qwen2.5"."""
  return "deepseek_v3" if model_cfg.attention == "mla" else "qwen2.5"


def checkpoint_chat(tokenizer_path: str, tokenizer, chat_format: Optional[str], model_cfg):
  """The chat format the CLI serves with.

  Args:
    tokenizer_path: the tokenizer directory or file.
    tokenizer: the tokenizer loaded from it.
    chat_format: a built-in format name (--chat_format), or None.
    model_cfg: the served model's config (its family picks the fallback format).

  Returns:
    The named built-in format; with no name, the checkpoint's own chat template (as
    transformers and vLLM use it), else `default_chat_format(model_cfg)`.
  """
  if chat_format:
    return make_chat(chat_format, tokenizer)
  return load_chat(tokenizer_path, tokenizer, name=default_chat_format(model_cfg))


def build(args) -> PolicyServer:
  """Builds the model, tokenizer, engine and server from parsed command-line arguments.

  Args:
    args: the `parse_args` namespace.

  Returns:
    The PolicyServer, not yet started; without tokenizer files it serves /generate only.

  Raises:
    ValueError: a non-loopback host without a token, a connection limit that is not positive,
      or a tokenizer with ids beyond the model's vocabulary.
  """
  token = args.token or os.environ.get("ARBOR_SERVE_TOKEN") or None
  check_bind(args.host, token)  # before loading anything
  for name in ("max_connections", "header_timeout", "body_timeout", "handshake_timeout"):
    if not getattr(args, name) > 0:
      raise ValueError(f"--{name}={getattr(args, name)}: expected > 0")
  if args.ckpt:
    model = hf.restore(args.ckpt)
  else:
    model = transformer.init(get_preset(args.preset), seed=args.seed)
  tokenizer = chat = None
  tok_path = args.tokenizer or (os.path.join(args.ckpt, "hf_extra") if args.ckpt else None)
  if tok_path and (args.tokenizer or any(os.path.exists(os.path.join(tok_path, f)) for f in (
      "tokenizer.json", "tiktoken.model", "tokenizer.model"))):
    tokenizer = load_tokenizer(tok_path)
    check_vocab(tokenizer, model.cfg.vocab_size)
    chat = checkpoint_chat(tok_path, tokenizer, args.chat_format, model.cfg)
  engine = Engine(model, EngineConfig(
      slots=args.slots, max_seq_len=args.max_seq_len, prefix_cache_rows=args.prefix_cache_rows,
      steps_per_call=args.steps_per_call, prefill_chunk=args.prefill_chunk,
      top_logprobs=args.top_logprobs, on_update=args.on_update,
      return_expert_ids=getattr(args, "return_expert_ids", False)),
      detokenize=None if tokenizer is None else tokenizer.decode)
  return PolicyServer(engine, ServerConfig(
      host=args.host, port=args.port, token=token, served_name=args.served_name,
      top_logprobs=args.top_logprobs, max_connections=args.max_connections,
      header_timeout_s=args.header_timeout, body_timeout_s=args.body_timeout,
      handshake_timeout_s=args.handshake_timeout, ssl_certfile=args.ssl_certfile,
      ssl_keyfile=args.ssl_keyfile),
      tokenizer=tokenizer, chat=chat)


def run(config, workdir: str) -> dict:
  """Runs trainer.main mode "serve" until interrupted.

  Serves the config's model (model.init: a preset, hf:DIR or an Arbor run's ckpt:DIR) and
  tokenizer behind the policy server (config.serve).

  Args:
    config: a validated mode "serve" config.
    workdir: the run's directory (where a trained tokenizer is found).

  Returns:
    {"served": True}.

  Raises:
    ValueError: a non-loopback host without a token (ARBOR_SERVE_TOKEN), or a tokenizer with
      ids beyond the model's vocabulary.
  """
  token = os.environ.get("ARBOR_SERVE_TOKEN") or None
  check_bind(config.serve.host, token)
  model_cfg = config_lib.model_config(config)
  chat = config_lib.make_chat_format(config, config_lib.tokenizer_source(config, workdir))
  tokenizer = chat.tokenizer
  check_vocab(tokenizer, model_cfg.vocab_size)
  model = (harness.initial_model(config, model_cfg)
           or transformer.init(model_cfg, seed=config.seed))
  top_logprobs = config.serve.top_logprobs
  engine = Engine(model, EngineConfig(slots=config.serve.slots,
                                      max_seq_len=config.serve.max_seq_len,
                                      prefix_cache_rows=config.serve.slots, seed=config.seed,
                                      top_logprobs=top_logprobs),
                  detokenize=tokenizer.decode)
  server = PolicyServer(engine, ServerConfig(host=config.serve.host, port=config.serve.port,
                                             token=token, served_name=config.serve.served_name,
                                             top_logprobs=top_logprobs,
                                             max_connections=config.serve.max_connections,
                                             header_timeout_s=config.serve.header_timeout_s,
                                             body_timeout_s=config.serve.body_timeout_s),
                        tokenizer=tokenizer, chat=chat)
  print(f"serve: {config.model.init} on http://{config.serve.host}:{config.serve.port} "
        "(/generate, /v1/chat/completions, /v1/completions, /v1/responses, /v1/messages, "
        "/v1/models, /health)", flush=True)
  try:
    asyncio.run(server.serve_forever())
  except KeyboardInterrupt:
    pass
  return {"served": True}


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
  """Parses the command line of `python -m trainer.serve` (None: sys.argv)."""
  p = argparse.ArgumentParser(prog="python -m trainer.serve", description=__doc__.split("\n")[0])
  src = p.add_mutually_exclusive_group(required=True)
  src.add_argument("--ckpt", help="checkpoint directory written by `python -m models.hf import`")
  src.add_argument("--preset", help="random weights of a models.presets preset (tests, demos)")
  p.add_argument("--seed", type=int, default=0, help="initialisation seed for --preset")
  p.add_argument("--host", default="127.0.0.1", help="bind address (non-loopback needs --token)")
  p.add_argument("--port", type=int, default=8000, help="port (0 = any free port)")
  p.add_argument("--token", default=None, help="bearer token (default: $ARBOR_SERVE_TOKEN)")
  p.add_argument("--tokenizer", default=None, help="tokenizer path (default: CKPT/hf_extra)")
  p.add_argument("--chat_format", default=None, help="a built-in envs.chat format (default: the "
                 "checkpoint's own chat template, else by model family)")
  p.add_argument("--served_name", default="arbor", help="the model's id in the OpenAI API")
  p.add_argument("--slots", type=int, default=16, help="sequences decoded together")
  p.add_argument("--max_seq_len", type=int, default=4096, help="longest input + output")
  p.add_argument("--prefix_cache_rows", type=int, default=16, help="extra cache rows for reuse")
  p.add_argument("--steps_per_call", type=int, default=16, help="decode steps per device call")
  p.add_argument("--prefill_chunk", type=int, default=512, help="prefill tokens per row and call")
  p.add_argument("--top_logprobs", type=int, default=ServerConfig.top_logprobs,
                 help="most top log-probs a request may ask for per token")
  p.add_argument("--on_update", default="finish", help="finish | resubmit | restart")
  p.add_argument("--return_expert_ids", action="store_true",
                 help="MoE: record each position's experts (in /generate replies and session "
                      "logs, for routing replay)")
  p.add_argument("--max_connections", type=int, default=ServerConfig.max_connections,
                 help="open connections; beyond, the oldest idle one is closed (tokenless first)")
  p.add_argument("--header_timeout", type=float, default=ServerConfig.header_timeout_s,
                 help="a request's headers are due this many s after its connection opened")
  p.add_argument("--body_timeout", type=float, default=ServerConfig.body_timeout_s,
                 help="a request's body is due this many s after its headers (408)")
  p.add_argument("--handshake_timeout", type=float, default=ServerConfig.handshake_timeout_s,
                 help="the TLS handshake is due this many s after connecting")
  p.add_argument("--ssl_certfile", default=None, help="TLS certificate (PEM): serve https")
  p.add_argument("--ssl_keyfile", default=None, help="TLS private key (PEM)")
  return p.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> int:
  """Serves from the command line until interrupted; returns 2 on a bad argument."""
  logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
  args = parse_args(argv)
  try:
    server = build(args)
  except ValueError as e:
    print(f"trainer.serve: {e}", file=sys.stderr)
    return 2
  try:
    asyncio.run(server.serve_forever())
  except KeyboardInterrupt:
    pass
  return 0


if __name__ == "__main__":
  sys.exit(main())
