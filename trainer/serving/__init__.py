"""The policy server, in parts (`python -m trainer.serve` is its command line and documents the
HTTP API; `trainer.serve` re-exports what other code imports).

  server       PolicyServer and ServerConfig: the engine behind Starlette under uvicorn, the
               shared front door (`envs.untrusted.door`: header/body/handshake deadlines, the
               connection cap), auth (bearer token or X-Api-Key), bodies, errors in each
               protocol's shape, /generate (token ids in, token ids out), /health, /v1/models,
               /v1/sessions, and what the protocol endpoints share (sampling, event streams)
  render       the one rendering path of the chat protocols: a request in internal form
               (ChatRequest: OpenAI-style messages, function schemas, a tool_choice mode) to
               the prompt's ids, forced tool-call opening, reply reader and grammar
  constrain    grammars for response_format / text.format and forced tool choices
               (llguidance), handed to the engine's sampler as token masks
  chat         POST /v1/chat/completions, OpenAI Chat Completions (a PolicyServer mixin)
  completions  POST /v1/completions, OpenAI Completions (a PolicyServer mixin)
  responses    POST /v1/responses, OpenAI Responses (a PolicyServer mixin)
  messages     POST /v1/messages and /v1/messages/count_tokens, Anthropic Messages (a
               PolicyServer mixin)
  validate     request errors (OpenAI error objects, Anthropic's) and the checks of every
               request field
  text         replies read back from sampled ids: stop strings, settled text, reasoning,
               content and tool calls, the blocks a reply streams as, SSE
  sessions     the bounded session log of exact ids, log-probs, versions, protocol and
               MoE expert ids (what a black-box scaffold's episode trains on)
"""
